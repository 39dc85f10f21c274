"""Configuration rules that catch a problem at validation instead of later (or keep behaviour
equal to Megatron-LM): the FFN width over TP, SwiGLU's default width, EOD flags with
--mock-data, the precision --dry-run reports, the normalization announcement."""

import logging

import pytest
import torch

from megatron_ul.config import ConfigError, ModelConfig
from megatron_ul.data.batches import build_micro_batch
from megatron_ul.model import norms
from megatron_ul.training.data import build_datasets, eod_token_for
from megatron_ul.training.dry_run import describe
from megatron_ul.training.memory_estimator import estimate_config
from megatron_ul.training.pretrain import configure

BASE = [
    "--mock-data",
    "--vocab-size",
    "1000",
    "--num-layers",
    "2",
    "--hidden-size",
    "96",
    "--num-attention-heads",
    "6",
    "--seq-length",
    "32",
]


def test_ffn_width_not_divisible_by_tp_is_refused_naming_the_flag():
    with pytest.raises(
        ConfigError,
        match="--ffn-hidden-size 250 is not divisible by --tensor-model-parallel-size 3",
    ):
        configure(BASE + ["--ffn-hidden-size", "250", "--tensor-model-parallel-size", "3"], 3)
    # SwiGLU's default width for hidden 96 is 256: not divisible by TP 3 either
    with pytest.raises(ConfigError, match="default FFN width 256 .*set --ffn-hidden-size"):
        configure(BASE + ["--swiglu", "--tensor-model-parallel-size", "3"], 3)


@pytest.mark.parametrize("hidden,expected", [(4096, 10880), (2048, 5440), (5120, 13632), (64, 128)])
def test_swiglu_default_ffn_width_is_megatron_lms(hidden, expected):
    # Megatron-LM arguments.py: int((4 * hidden * 2 / 3) / 64) * 64, i.e. rounded down
    assert ModelConfig(hidden_size=hidden, swiglu=True).ffn_size == expected
    assert ModelConfig(hidden_size=hidden).ffn_size == 4 * hidden


def test_eod_flags_work_on_mock_data():
    cfg = configure(
        BASE
        + [
            "--eod-mask-loss",
            "--reset-position-ids",
            "--reset-attention-mask",
            "--train-iters",
            "4",
        ],
        1,
    )
    eod = eod_token_for(cfg)
    assert eod == 999  # NullTokenizer's convention: vocab_size - 1
    train, _, _ = build_datasets(cfg)
    texts = torch.stack([torch.from_numpy(train[i]["text"]) for i in range(4)])
    assert (texts == eod).sum() >= 4  # documents end inside the samples
    mb = build_micro_batch(
        texts, eod_token=eod, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True
    )
    tokens = mb["tokens"]
    assert bool((mb["loss_mask"][tokens == eod] == 0).all())
    assert int((mb["position_ids"] == 0).sum()) > tokens.shape[0]  # positions restart
    assert len(mb["cu_seqlens"]) > tokens.shape[0] + 1  # documents inside the rows


def test_mock_data_needs_two_ids_for_eod():
    with pytest.raises(ConfigError, match="--vocab-size"):
        configure(["--mock-data", "--vocab-size", "1"], 1)


@pytest.mark.parametrize(
    "flag,text,act_bytes",
    [
        ([], "precision fp32, 4-byte", 4),
        (["--bf16"], "precision bf16", 2),
        (["--fp16"], "precision fp16", 2),
    ],
)
def test_dry_run_reports_the_precision_it_will_use(flag, text, act_bytes):
    cfg = configure(BASE + flag + ["--dry-run"], 1)
    out = describe(cfg)
    assert text in out and f"{act_bytes}-byte activations" in out
    fp32 = estimate_config(configure(BASE + ["--dry-run"], 1)).activation_bytes
    # activations: 2-byte under bf16 and fp16 alike (fp32 norm inputs and softmax stay)
    assert (estimate_config(cfg).activation_bytes < fp32) == (act_bytes == 2)


def test_dry_run_says_which_attention_kernel_it_plans():
    out = describe(configure(BASE + ["--use-flash-attn", "--dry-run"], 1))
    assert (
        "attention kernel on a GPU: sdpa efficient (--use-flash-attn given, but float32 activations"
    ) in out
    out = describe(configure(BASE + ["--use-flash-attn", "--bf16", "--dry-run"], 1))
    assert (
        "attention kernel on a GPU: flash-attn where flash-attn is installed, else sdpa flash"
    ) in out


def test_apex_announcement_tells_installed_from_missing(monkeypatch, caplog):
    for have_apex, expected in (
        (True, "apex is installed; its fused kernels need a CUDA"),
        (False, "apex is not installed"),
    ):
        monkeypatch.setattr(norms, "HAVE_APEX", have_apex)
        monkeypatch.setattr(norms, "_announced", set())
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=norms.__name__):
            norms.RMSNorm(8, 1e-5, device="cpu")
        assert [expected in r.getMessage() for r in caplog.records] == [True]
