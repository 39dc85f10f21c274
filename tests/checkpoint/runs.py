"""Module-level functions run on spawned gloo ranks by the checkpoint tests."""

from __future__ import annotations

import os

import torch.distributed as dist

from megatron_ul.checkpoint import files
from megatron_ul.training.pretrain import configure, setup

TINY = [
    "--mock-data",
    "--vocab-size",
    "200",
    "--make-vocab-size-divisible-by",
    "16",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--lr",
    "1e-3",
    "--lr-warmup-iters",
    "1",
    "--min-lr",
    "1e-4",
    "--seed",
    "7",
    "--log-interval",
    "100",
    "--distributed-timeout-minutes",
    "1.5",
    "--adam-eps",
    "1e-6",
]
NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]
TINY_TWO_ITERS = TINY + ["--train-iters", "2"]  # conftest's `saved` checkpoint


def assert_continues_the_curve(out: dict) -> None:
    """out = {"original": 4 losses, name: the 2 losses of a run resumed at iteration 2}."""
    original = out.pop("original")
    assert len(original) == 4
    for name, resumed in out.items():
        diff = max(abs(a - b) for a, b in zip(resumed, original[2:]))
        print(f"{name}: original {original[2:]} resumed {resumed} max diff {diff:.2e}")
        assert len(resumed) == 2 and diff < 1e-5, name


def assert_bitwise_resume(results: list[dict], layouts) -> None:
    """Per layout, the run resumed at iteration 2 repeats the uninterrupted losses exactly."""
    for layout in layouts:
        full, resumed = results[0][layout]
        print(f"{layout}: uninterrupted {full}\n  resumed at 2 {resumed}")
        assert len(full) == 4 and len(resumed) == 2
        assert resumed == full[2:], layout  # bitwise: float equality
    for r in results:  # every rank reports the same losses
        assert r == results[0]


def train(rank: int, world: int, argv: list[str]) -> list[float]:
    return setup(configure(argv, world)).train()


def train_then_resume(
    rank: int, world: int, argv: list[str], save_dir: str, k: int, iters: int
) -> tuple[list[float], list[float]]:
    """Uninterrupted run of `iters` (saving every k), then a run resumed from iteration k."""
    full = train(
        rank,
        world,
        argv + ["--train-iters", str(iters), "--save", save_dir, "--save-interval", str(k)],
    )
    dist.barrier()
    if rank == 0:  # make iteration k the latest, as if the first run had stopped there
        files.write_tracker(save_dir, k)
    dist.barrier()
    resumed = train(rank, world, argv + ["--train-iters", str(iters), "--load", save_dir])
    return full, resumed


def load_error(rank: int, world: int, argv: list[str]) -> str:
    """The message of the error that setting up (loading) with `argv` raises, or ''."""
    try:
        setup(configure(argv, world))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def listing(root: str) -> dict[str, float]:
    """{path: mtime} of everything under root (to show nothing was overwritten or deleted)."""
    out = {}
    for base, dirs, names in os.walk(root):
        for n in dirs + names:
            path = os.path.join(base, n)
            out[path] = os.stat(path).st_mtime_ns
    return out


def convert_cli(argv: list[str]) -> int:
    """tools/checkpoint/convert.py's main, called in-process (no interpreter start-up)."""
    from tools.checkpoint import convert

    return convert.main(argv)


def resume_on_layouts(rank: int, world: int, argv: list[str], layouts: dict, tmp: str) -> dict:
    """For each layout: uninterrupted 4 iterations and a resume from iteration 2 (same layout)."""
    return {
        name: train_then_resume(rank, world, argv + flags, os.path.join(tmp, name), 2, 4)
        for name, flags in layouts.items()
    }


def _on_rank0(fn):
    dist.barrier()
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def convert_chain(rank: int, world: int, argv: list[str], tmp: str) -> dict:
    """World 4: train TP2·DP2 (saving at 2), convert TP2 -> TP1 -> TP2 with the CLI and resume
    on TP1·DP4 and on TP2·SP2; also load the TP2 checkpoint directly on TP1·SP4 (reshard on
    load). Returns the losses of each run."""
    src, tp1, tp2 = (os.path.join(tmp, n) for n in ("tp2", "tp2_to_tp1", "tp1_to_tp2"))
    run = lambda flags: train(rank, world, argv + ["--train-iters", "4"] + flags)  # noqa: E731
    out = {
        "original": run(
            ["--tensor-model-parallel-size", "2", "--save", src, "--save-interval", "2"]
        )
    }

    def convert_both():
        files.write_tracker(src, 2)
        for load, save, tp in [(src, tp1, "1"), (tp1, tp2, "2")]:
            assert (
                convert_cli(
                    ["--load-dir", load, "--save-dir", save, "--target-tensor-parallel-size", tp]
                )
                == 0
            )

    _on_rank0(convert_both)
    out["tp1_dp4"] = run(["--load", tp1])
    out["tp2_sp2"] = run(
        ["--tensor-model-parallel-size", "2", "--ds-sequence-parallel-size", "2", "--load", tp2]
    )
    out["tp1_sp4_on_load"] = run(["--ds-sequence-parallel-size", "4", "--load", src])
    return out


def convert_pipeline_chain(rank: int, world: int, argv: list[str], tmp: str) -> dict:
    """World 4, 4 layers, tied embeddings: train TP2·PP2 (saving at 2); convert PP2 -> PP1 and
    PP1 -> PP2 interleaved (chunks of 1 layer) with the CLI and resume on SP2·DP2 and on
    PP2·DP2 interleaved; also load the TP2·PP2 checkpoint directly on PP4 (reshard on load).
    Returns the losses of each run."""
    src, pp1, pp2v = (os.path.join(tmp, n) for n in ("tp2_pp2", "to_pp1", "to_pp2_interleaved"))
    run = lambda flags: train(rank, world, argv + ["--train-iters", "4"] + flags)  # noqa: E731
    out = {
        "original": run(
            [
                "--tensor-model-parallel-size",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--save",
                src,
                "--save-interval",
                "2",
            ]
        )
    }

    def convert_both():
        files.write_tracker(src, 2)
        assert (
            convert_cli(
                [
                    "--load-dir",
                    src,
                    "--save-dir",
                    pp1,
                    "--target-tensor-parallel-size",
                    "1",
                    "--target-pipeline-parallel-size",
                    "1",
                ]
            )
            == 0
        )
        assert (
            convert_cli(
                [
                    "--load-dir",
                    pp1,
                    "--save-dir",
                    pp2v,
                    "--target-tensor-parallel-size",
                    "1",
                    "--target-pipeline-parallel-size",
                    "2",
                    "--target-num-layers-per-virtual-pipeline-stage",
                    "1",
                ]
            )
            == 0
        )

    _on_rank0(convert_both)
    out["pp1_sp2_dp2"] = run(["--ds-sequence-parallel-size", "2", "--load", pp1])
    out["pp2_interleaved_dp2"] = run(
        [
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
            "--load",
            pp2v,
        ]
    )
    out["pp4_on_load"] = run(["--pipeline-model-parallel-size", "4", "--load", src])
    return out
