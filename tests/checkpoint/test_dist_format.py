"""--ckpt-format torch_dist (checkpoint/storage/dcp_pieces.py): every rank writes and reads only
its own pieces through torch.distributed.checkpoint. A layout-changing load reads only the stored
pieces that overlap what a rank holds and continues the loss curve; resume on the same layout
is bit-exact; --async-save writes the same checkpoint as a synchronous save while training
goes on; a flipped byte is named and not loaded."""

import os

import pytest

from megatron_ul.checkpoint import files
from megatron_ul.checkpoint.files import CheckpointError
from tests.checkpoint.dist_runs import (
    DIST,
    ZERO1,
    ZERO3,
    async_against_sync,
    bytes_read_on_layout_change,
    resume_on_other_layouts,
)
from tests.checkpoint.runs import NO_DROPOUT, TINY, assert_bitwise_resume, resume_on_layouts
from tests.distributed import run_distributed

TP2, SP2 = ["--tensor-model-parallel-size", "2"], ["--ds-sequence-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
FOUR_LAYERS = ["--num-layers", "4"]


def _assert_continues(out: dict) -> None:
    original = out.pop("original")
    for name, resumed in out.items():
        diff = max(abs(a - b) for a, b in zip(resumed, original[2:]))
        print(f"{name}: original {original[2:]} resumed {resumed} max diff {diff:.2e}")
        assert len(resumed) == 2 and diff < 1e-5, name


@pytest.mark.slow
def test_loads_on_other_layouts_continuing_the_curve(tmp_path):
    """ZeRO-1 on TP2·SP2, resumed on ZeRO-3 SP2·DP2 (TP1: vocabulary padded for TP1), TP2·PP2
    (plain AdamW, the tied embedding copy read from the table's pieces) and ZeRO-1 on PP2
    interleaved ×DP2 — each rank reading only the pieces it holds."""
    targets = {
        "zero3_sp2_dp2": ZERO3 + SP2,
        "plain_tp2_pp2": TP2 + PP2,
        "zero1_pp2_interleaved_dp2": ZERO1 + PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"],
    }
    out = run_distributed(
        resume_on_other_layouts,
        4,
        TINY + NO_DROPOUT + FOUR_LAYERS,
        ZERO1 + TP2 + SP2,
        targets,
        str(tmp_path),
    )[0]
    _assert_continues(out)


@pytest.mark.slow
def test_loads_on_tp4_and_pp4(tmp_path):
    targets = {
        "tp4": ["--tensor-model-parallel-size", "4"],
        "pp4": ["--pipeline-model-parallel-size", "4"],
        "zero3_tp2_pp2": ZERO3 + TP2 + PP2,
    }
    out = run_distributed(
        resume_on_other_layouts,
        4,
        TINY + NO_DROPOUT + FOUR_LAYERS,
        ZERO3 + SP2,
        targets,
        str(tmp_path),
    )[0]
    _assert_continues(out)


def test_layout_changing_load_reads_only_overlapping_pieces(tmp_path):
    """Saved on TP2 (2 ranks), loaded on ZeRO-3 DP2: each rank holds half of every tensor and
    reads at most 70% of the stored tensor bytes (the torch format reads every file: 100%),
    never less than it holds; the loss curve continues, also from the checkpoint converted
    offline (tools/checkpoint/convert.py) to TP1 in the torch format."""
    block = 512
    results = run_distributed(
        bytes_read_on_layout_change, 2, TINY + NO_DROPOUT, TP2, ZERO3, str(tmp_path), block
    )
    for rank, r in enumerate(results):
        rep, stored = r["report"], r["stored_tensor_bytes"]
        print(
            f"rank {rank}: read {rep.tensor_bytes_read} tensor bytes of {stored} stored "
            f"({rep.tensor_bytes_read / stored:.0%}); it holds {rep.tensor_bytes_needed} "
            f"in {rep.pieces} pieces; {rep.bytes_read} file bytes read"
        )
        assert rep.tensor_bytes_needed <= rep.tensor_bytes_read <= 0.7 * stored
        assert 0.45 * stored <= rep.tensor_bytes_needed <= 0.55 * stored
        for run in ("resumed", "converted_to_tp1_torch"):
            diff = max(abs(a - b) for a, b in zip(r[run], r["original"][2:]))
            print(f"{run}: {r[run]} (original {r['original'][2:]}) max diff {diff:.2e}")
            assert len(r[run]) == 2 and diff < 1e-5, run


def test_async_save_equals_sync_save_while_training_goes_on(tmp_path):
    """2 ranks, ZeRO-1 DP2: --async-save with a writer slowed by 1 s. Training iteration 3
    finishes while iteration 2 is being written; both saves load the same tensors bit for bit,
    the losses are the same, and a run resumed from the asynchronous save of iteration 2
    repeats the uninterrupted losses bit for bit (dropout on)."""
    argv = TINY + ZERO1
    out = run_distributed(async_against_sync, 2, argv, str(tmp_path), 1.0)
    for r in out:
        print(r["sync"], r["async"], "iterations during the write of 2:", r["overlapped"])
        assert r["sync"] == r["async"]
        assert 3 in r["overlapped"]
        assert r["same_tensors"] == {2: True, 4: True}
        assert r["resumed_from_async_2"] == r["sync"][2:]  # bitwise, dropout on


def test_flipped_byte_is_named_and_not_loaded(tmp_path, single_rank):
    from megatron_ul.training.pretrain import configure, setup

    d = str(tmp_path / "ckpt")
    argv = TINY + DIST + ["--train-iters", "2"]
    setup(configure(argv + ["--save", d], 1)).train()
    shard = os.path.join(d, "iter_0000002", "__0_0.distcp")
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"__0_0.distcp: corrupt"):
        setup(configure(argv + ["--load", d], 1))
    index = os.path.join(d, "iter_0000002", ".metadata")  # DCP's index of the pieces
    data = bytearray(open(index, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(index, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"\.metadata: corrupt"):
        setup(configure(argv + ["--load", d], 1))


@pytest.mark.slow
def test_resume_is_bitwise_identical_on_every_layout(tmp_path):
    from tests.checkpoint.test_resume import LAYOUTS as PLAIN
    from tests.checkpoint.test_zero import LAYOUTS as ZERO
    from tests.checkpoint.test_zero import PIPELINES, ZERO3_PIPELINES

    layouts = {**PLAIN, **ZERO, **PIPELINES, **ZERO3_PIPELINES}
    results = run_distributed(resume_on_layouts, 4, TINY + DIST, layouts, str(tmp_path))
    assert_bitwise_resume(results, layouts)


def test_kill_during_async_write_leaves_the_previous_checkpoint_current(tmp_path, single_rank):
    """kill -9 while iteration 2 is written in the background (a writer slowed by 2 s):
    the tracker still names iteration 1, which loads; iteration 2 is only a .tmp directory."""
    from megatron_ul.training.pretrain import configure, setup
    from tools.checkpoint.kill_trial import MODEL, outcome, start_child

    d = str(tmp_path / "ckpt")
    proc = start_child(d, DIST, background=True, write_delay=2.0)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.strip() == "writing 2":
            break
    r = outcome(proc, "".join(seen))
    assert r["last_saved"] == 1 and r["mid_save"], r
    assert files.read_tracker(d) == 1
    assert not os.path.exists(os.path.join(d, "iter_0000002"))
    assert any(n.startswith("iter_0000002.tmp-") for n in os.listdir(d))
    trainer = setup(configure(MODEL + ["--load", d], 1))
    assert trainer.start_iteration == 1


def test_async_save_needs_torch_dist():
    from megatron_ul.config import ConfigError
    from megatron_ul.training.pretrain import configure

    with pytest.raises(ConfigError, match="--async-save needs --ckpt-format torch_dist"):
        configure(TINY + ["--async-save"], 1)
    with pytest.raises(SystemExit):  # argparse: not a choice
        configure(TINY + ["--ckpt-format", "zarr"], 1)
