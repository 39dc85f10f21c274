"""--context-parallel-size: validation names the flags, and the load-balanced data layout gives
every (Ulysses, ring) rank its tokens with the matching labels, loss mask and position ids."""

import pytest
import torch

from megatron_ul.config import ConfigError
from megatron_ul.data.batches import build_micro_batch
from megatron_ul.data.sequence_layout import rank_positions, ring_local_positions
from megatron_ul.training.pretrain import configure

OK = [
    "--mock-data",
    "--vocab-size",
    "100",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "8",
    "--seq-length",
    "64",
    "--attention-dropout",
    "0",
]


def test_ring_ranks_count_towards_the_model_parallel_size():
    cfg = configure(
        OK + ["--ds-sequence-parallel-size", "2", "--context-parallel-size", "2"], world_size=8
    )
    assert cfg.parallel.data_parallel_size == 2


def test_two_heads_train_on_eight_sequence_ranks():
    cfg = configure(
        OK[:-4]
        + [
            "--num-attention-heads",
            "2",
            "--attention-dropout",
            "0",
            "--ds-sequence-parallel-size",
            "2",
            "--context-parallel-size",
            "4",
        ],
        world_size=8,
    )
    assert cfg.parallel.data_parallel_size == 1


@pytest.mark.parametrize(
    "flags,world,expected",
    [
        (
            [
                "--seq-length",
                "24",
                "--ds-sequence-parallel-size",
                "2",
                "--context-parallel-size",
                "4",
            ],
            8,
            "--seq-length 24 is not divisible by 2 × --ds-sequence-parallel-size × "
            "--context-parallel-size = 16",
        ),
        (
            [
                "--seq-length",
                "40",
                "--ds-sequence-parallel-size",
                "2",
                "--context-parallel-size",
                "2",
                "--tensor-model-parallel-size",
                "4",
                "--sequence-parallel",
            ],
            16,
            "(and × --tensor-model-parallel-size with --sequence-parallel) = 16",
        ),
        (
            ["--context-parallel-size", "2", "--attention-dropout", "0.1"],
            2,
            "--attention-dropout 0.1 is not supported with --context-parallel-size 2",
        ),
        (
            ["--context-parallel-size", "3"],
            4,
            "× --context-parallel-size × --pipeline-model-parallel-size = 1×1×3×1",
        ),
        (["--context-parallel-size", "0"], 1, "--context-parallel-size must be >= 1"),
        (
            ["--ds-sequence-parallel-size", "16", "--context-parallel-size", "2"],
            32,
            "--num-attention-heads 8 is not divisible by --tensor-model-parallel-size × "
            "--ds-sequence-parallel-size = 1×16",
        ),
    ],
)
def test_bad_ring_configuration_names_the_flags(flags, world, expected):
    with pytest.raises(ConfigError) as err:
        configure(OK + flags, world_size=world)
    assert expected in str(err.value)


def test_ring_ranks_hold_chunks_r_and_2r_minus_1_minus_r():
    assert ring_local_positions(0, 2, 8).tolist() == [0, 1, 6, 7]
    assert ring_local_positions(1, 2, 8).tolist() == [2, 3, 4, 5]
    # Ulysses ranks split their ring rank's pair of chunks contiguously
    assert rank_positions(16, 1, 2, 0, 2).tolist() == [12, 13, 14, 15]
    every = torch.cat([rank_positions(48, u, 2, r, 3) for r in range(3) for u in range(2)])
    assert sorted(every.tolist()) == list(range(48))


@pytest.mark.parametrize("ulysses,ring", [(1, 2), (2, 2), (1, 4)])
def test_micro_batch_follows_the_ring_layout(ulysses, ring):
    n, eod = 32, 0
    texts = torch.randint(1, 50, (2, n + 1), generator=torch.Generator().manual_seed(0))
    texts[:, [5, 17, 30]] = eod
    full = build_micro_batch(texts, eod_token=eod, reset_position_ids=True, eod_mask_loss=True)
    for r in range(ring):
        for u in range(ulysses):
            mine = build_micro_batch(
                texts,
                u,
                ulysses,
                eod_token=eod,
                reset_position_ids=True,
                eod_mask_loss=True,
                cp_rank=r,
                cp_size=ring,
            )
            where = rank_positions(n, u, ulysses, r, ring)
            for key in ("tokens", "labels", "loss_mask", "position_ids"):
                assert torch.equal(mine[key], full[key][:, where]), key


def test_every_ring_rank_computes_the_same_number_of_causal_scores():
    n, ring = 64, 4
    causal = torch.ones(n, n).tril()
    work = [int(causal[ring_local_positions(r, ring, n)].sum()) for r in range(ring)]
    assert len(set(work)) == 1


def test_estimator_counts_ring_ranks_as_sequence_and_zero_ranks():
    from megatron_ul.config import ModelConfig
    from megatron_ul.training.memory_estimator import Layout, estimate

    m = ModelConfig(
        num_layers=2,
        hidden_size=256,
        num_attention_heads=4,
        seq_length=4096,
        vocab_size=1000,
        attention_dropout=0.0,
    )
    ulysses, hybrid = Layout(sp=4), Layout(sp=2, cp=2)
    assert hybrid.world == ulysses.world == 4
    a, b = estimate(m, ulysses, zero_stage=1), estimate(m, hybrid, zero_stage=1)
    assert a.optimizer_bytes == b.optimizer_bytes  # ZeRO shards over DP×CP×SP
    # same tokens per rank; the ring's unit working set comes on top
    assert b.activation_bytes == a.activation_bytes
    assert b.total_bytes > a.total_bytes


@pytest.mark.parametrize(
    "flags,expected",
    [
        # fp32, head dim 18: SDPA's flash and efficient kernels refuse it on CUDA (math: N×N)
        (["--kv-channels", "18"], "no fused attention kernel on CUDA takes head dim 18 in float32"),
        (
            ["--kv-channels", "18", "--context-parallel-size", "2"],
            "ring attention on CUDA needs fp32/fp16/bf16 activations and a head dim divisible by 4",
        ),
        # bf16, head dim 260: flash takes at most 256 (padding the rest), efficient needs % 8
        (["--kv-channels", "260", "--bf16"], "takes head dim 260 in bfloat16"),
    ],
)
def test_a_head_dim_no_fused_kernel_takes_is_refused_before_building(flags, expected):
    from megatron_ul.training.attention_check import refuse_unrunnable_attention

    cfg = configure(OK + flags, world_size=2)
    with pytest.raises(ConfigError, match="--kv-channels") as err:
        refuse_unrunnable_attention(cfg, torch.device("cuda"))
    assert expected in str(err.value)
    refuse_unrunnable_attention(cfg, torch.device("cpu"))  # the CPU flash kernel takes it
    refuse_unrunnable_attention(configure(OK, world_size=2), torch.device("cuda"))


def test_documents_with_a_window_always_reach_a_kernel_that_does_both():
    """No path drops one of the two: flash-attn's varlen kernel takes window_size, the tiles,
    the per-document blocks and the ring's masked units take both."""
    import itertools

    from megatron_ul.model.attention.backends import RingUnits, select
    from megatron_ul.model.attention.dispatch import AttentionCall

    both = {"flash-attn varlen", "document tiles", "document blocks"}
    for device, dtype, ring, flash, dropout in itertools.product(
        ("cpu", "cuda"),
        (torch.float32, torch.bfloat16),
        (False, True),
        (False, True),
        (False, True),
    ):
        call = AttentionCall(
            torch.device(device), dtype, 64, 8, 2, True, 64, ring, flash, dropout=dropout
        )
        kernel = select(call)
        if ring:  # the units the window or documents cut run a kernel that takes a bias
            assert isinstance(kernel, RingUnits) and kernel.cut, (call, kernel)
            assert kernel.masked.takes_bias, (call, kernel)
        else:
            assert kernel.name in both, (call, kernel)
