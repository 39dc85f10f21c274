"""MoE checkpoints: every expert is saved under its global name whatever the EP size, so a
checkpoint written at EP 2 resumes at EP 1 and one written at EP 1 resumes at EP 2, each
continuing the original loss curve (fp32, 1e-5); a resume with another expert count is
refused naming the flag."""

import os

import pytest
import torch
import torch.distributed as dist

from megatron_ul.checkpoint import files
from tests.checkpoint import conftest as checkpoint_fixtures
from tests.checkpoint.runs import NO_DROPOUT, TINY, load_error, train
from tests.distributed import run_distributed

MOE = [
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-aux-loss-coeff",
    "0.01",
    "--disable-bias-linear",
    "--swiglu",
    "--moe-token-dispatcher-type",
    "alltoall",
]
ARGV = TINY + NO_DROPOUT + MOE + ["--train-iters", "4"]
EP2 = ["--expert-model-parallel-size", "2"]
single_rank = checkpoint_fixtures.single_rank  # the one-rank gloo group's fixture


def _tracker(save_dir: str, iteration: int) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        files.write_tracker(save_dir, iteration)
    dist.barrier()


def _across_ep(rank: int, world: int, argv: list[str], tmp: str) -> dict:
    """EP 2 saves at 2; EP 1 resumes it (saving 3 and 4); EP 2 resumes EP 1's iteration 3.
    Returns the losses and each stage file's expert names."""
    ep2, ep1 = os.path.join(tmp, "ep2"), os.path.join(tmp, "ep1")
    out = {"original": train(rank, world, argv + EP2 + ["--save", ep2, "--save-interval", "2"])}
    _tracker(ep2, 2)
    out["ep1_from_ep2"] = train(
        rank, world, argv + ["--load", ep2, "--save", ep1, "--save-interval", "1"]
    )
    _tracker(ep1, 3)
    out["ep2_from_ep1"] = train(rank, world, argv + EP2 + ["--load", ep1])
    out["refused"] = load_error(rank, world, argv + ["--load", ep2, "--num-experts", "2"])
    return out


def _expert_names(path: str) -> set[str]:
    state = torch.load(path, weights_only=False)["model"]
    return {n for n in state if ".local_experts." in n}


@pytest.mark.parametrize("fmt", ["torch", pytest.param("torch_dist", marks=pytest.mark.slow)])
def test_expert_checkpoints_resume_across_ep_sizes(fmt, tmp_path):
    out = run_distributed(_across_ep, 2, ARGV + ["--ckpt-format", fmt], str(tmp_path))[0]
    original, refused = out.pop("original"), out.pop("refused")
    for name, resumed, start in [
        ("ep1_from_ep2", out["ep1_from_ep2"], 2),
        ("ep2_from_ep1", out["ep2_from_ep1"], 3),
    ]:
        diff = max(abs(a - b) for a, b in zip(resumed, original[start:]))
        print(f"{name}: original {original[start:]} resumed {resumed} max diff {diff:.2e}")
        assert len(resumed) == 4 - start and diff < 1e-5, name
    assert "--num-experts" in refused, refused
    if fmt == "torch_dist":
        return
    # every expert of every MoE layer is in the EP 2 checkpoint's one stage file
    for d in ("ep2", "ep1"):
        stage = files.model_file(
            str(tmp_path / d / files.iteration_dir_name(2 if d == "ep2" else 3)), 0, 0, 1
        )
        names = _expert_names(stage)
        assert {n.split(".local_experts.")[1].split(".")[0] for n in names} == {"0", "1", "2", "3"}


def test_experts_reshard_over_tp_and_back_bit_exact(tmp_path, single_rank):
    """The conversion command's reshard path splits each expert like the dense MLP (TP 2) and
    merges it back: every weight and Adam moment returns bit for bit."""
    from tests.checkpoint.runs import convert_cli

    src, tp2, back = (str(tmp_path / n) for n in ("src", "tp2", "back"))
    train(0, 1, ARGV + ["--train-iters", "2", "--save", src])
    for load, save, tp in [(src, tp2, "2"), (tp2, back, "1")]:
        argv = ["--load-dir", load, "--save-dir", save, "--target-tensor-parallel-size", tp]
        assert convert_cli(argv) == 0
    shard = torch.load(
        files.model_file(os.path.join(tp2, "iter_0000002"), 1, 0, 1), weights_only=False
    )
    fc1 = "layers.0.mlp.experts.local_experts.3.linear_fc1.weight"
    a, b = (
        torch.load(files.model_file(os.path.join(d, "iter_0000002"), 0, 0, 1), weights_only=False)
        for d in (src, back)
    )
    assert shard["model"][fc1].shape[0] == a["model"][fc1].shape[0] // 2  # split over TP
    assert set(a["model"]) == set(b["model"])
    for name, t in a["model"].items():  # padded vocabulary rows (outside the softmax) reset
        rows = 200 if name in ("word_embeddings.weight", "output_layer.weight") else None
        assert torch.equal(t[:rows], b["model"][name][:rows]), name
        for key in ("exp_avg", "exp_avg_sq"):
            moments = (x["optimizer"]["state"][name][key][:rows] for x in (a, b))
            assert torch.equal(*moments), (name, key)
