"""The long-context flags: parsed from the command line, each bad value rejected with an error
naming the flag, and shown by --dry-run with their effect on the memory estimate."""

import pytest

from megatron_ul.config import ConfigError
from megatron_ul.training.dry_run import describe
from megatron_ul.training.pretrain import configure

BASE = [
    "--mock-data",
    "--vocab-size",
    "32000",
    "--seq-length",
    "65536",
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
]


def test_flags_reach_the_config():
    cfg = configure(
        BASE
        + [
            "--tiled-loss-chunk-size",
            "1024",
            "--tiled-mlp-chunk-size",
            "4096",
            "--activation-checkpoint-cpu-offload",
            "--window-size",
            "4096",
            "0",
            "--attention-block-tiles",
            "8",
        ]
    )
    m = cfg.model
    assert (m.tiled_loss_chunk_size, m.tiled_mlp_chunk_size) == (1024, 4096)
    assert m.attention_block_tiles == 8 and configure(BASE).model.attention_block_tiles == 1
    assert m.activation_checkpoint_cpu_offload and m.attention_window == 4096
    assert configure(BASE + ["--window-size", "-1", "0"]).model.attention_window is None


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tiled-loss-chunk-size", "0"], "--tiled-loss-chunk-size must be >= 1"),
        (["--tiled-mlp-chunk-size", "-5"], "--tiled-mlp-chunk-size must be >= 1"),
        (["--window-size", "128", "4"], "RIGHT must be 0"),
        (["--window-size", "128"], "--window-size takes two numbers"),
        (["--window-size", "-3", "0"], "LEFT must be >= 0"),
        (["--attention-block-tiles", "0"], "--attention-block-tiles must be >= 1"),
        # 65536 tokens over SP 2 · TP 2 (Megatron-SP): 16384 per rank
        (
            ["--attention-block-tiles", "3"]
            + ["--ds-sequence-parallel-size", "2", "--tensor-model-parallel-size", "2"]
            + ["--sequence-parallel", "--num-attention-heads", "4"],
            "--attention-block-tiles 3 does not divide the 16384 tokens",
        ),
        (
            ["--attention-block-tiles", "2", "--fused-layers"],
            "--attention-block-tiles with --fused-layers",
        ),
    ],
)
def test_bad_values_name_the_flag(flags, message):
    with pytest.raises(ConfigError, match=message):
        configure(BASE + flags)


def test_offload_without_full_recompute_is_refused():
    with pytest.raises(ConfigError, match="needs --recompute-granularity full"):
        configure(["--mock-data", "--vocab-size", "100", "--activation-checkpoint-cpu-offload"])


def test_dry_run_shows_the_options_and_their_memory():
    plain = describe(configure(BASE))
    tiled = describe(
        configure(
            BASE
            + [
                "--tiled-loss-chunk-size",
                "1024",
                "--activation-checkpoint-cpu-offload",
                "--tokenizer-type",
                "NullTokenizer",
                "--reset-attention-mask",
                "--attention-block-tiles",
                "4",
            ]
        )
    )
    assert "long context: loss untiled; MLP untiled" in plain
    assert (
        "tiled loss 1024 tokens/chunk" in tiled
        and "offloaded to host" in tiled
        and "document masking" in tiled
        and "attention block in 4 tiles" in tiled
    )
    assert "host memory (offloaded)" in tiled and "loss working set" in plain

    def total(text):
        row = text.split("| total ")[1].split(" GiB")[0]  # "(peak: PHASE) 0.49"
        return float(row.split()[-1].strip("|"))

    assert total(tiled) < total(plain) / 3  # 65536 × 32000 fp32 logits are gone
