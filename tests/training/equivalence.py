"""The layout-equivalence harness (the one every suite uses: layouts, pipeline, ZeRO,
recompute): train the same model on the same data under a parallel layout and under a single
process, and compare per-step losses and final parameters."""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import DTensor

from megatron_ul.checkpoint.layout.reshard import merge_tp
from megatron_ul.model.chunks import model_dims
from megatron_ul.mpu.param_spec import param_spec
from megatron_ul.pipeline.model import global_named_parameters
from megatron_ul.training.pretrain import configure, setup
from tests.distributed import run_distributed

BASE = [
    "--mock-data",
    "--vocab-size",
    "1000",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    "5",
    "--lr",
    "1e-3",
    "--lr-warmup-iters",
    "1",
    "--min-lr",
    "1e-4",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--seed",
    "42",
    "--log-interval",
    "100",
    "--distributed-timeout-minutes",
    "1.5",
    # Adam turns a gradient error δg into an update error of up to lr·δg/eps on elements
    # whose gradient is about eps in size (a rare token's embedding row has some). At eps
    # 1e-6 (gain 1000) fp32 rounding alone moved such an element by 1.16e-5 of its tensor's
    # largest value in 5 steps (the one-process fp32 run against the same run in fp64), so
    # the test compared seeds, not layouts: Llama TP2 missed 1e-5 for 5 of 25 seeds (either
    # initialisation) while agreeing to 2e-14 in fp64. At 1e-5 the gain is 100.
    "--adam-eps",
    "1e-5",
]

GPT2_STYLE = ["--num-attention-heads", "4"]
LLAMA_GQA = [
    "--num-attention-heads",
    "8",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--position-embedding-type",
    "rope",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
]
# Document masking (--reset-attention-mask): a 16-token vocabulary whose EOD (15, the
# NullTokenizer's) ends a document every 16 tokens or so.
DOCUMENTS = [
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "16",
    "--reset-attention-mask",
    "--reset-position-ids",
    "--eod-mask-loss",
]


def train_and_collect(rank: int, world: int, argv: list[str]) -> dict:
    """Train on this rank; return the losses, (from DP0/SP0 ranks) the TP shards of the
    parameters and the bytes of optimizer state this rank holds.

    ZeRO-3 parameters are DTensors sharded over dp_cp_sp: gathering one is a collective, so every
    rank gathers before the DP0/SP0 ranks keep the result."""
    trainer = setup(configure(argv, world))
    dims = model_dims(trainer.model)
    losses = trainer.train()
    shards = {}
    experts = set()  # sharded over EP, replicated over expert-DP only
    # Global names (layer numbers, not per-stage indices), so pipeline stages merge.
    for name, p in global_named_parameters(trainer.model):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        if param_spec(p).grad_group == "expert_dp":
            experts.add(name)
        shards[name] = (
            full.detach().clone(),
            param_spec(p).partition_dim,
            param_spec(p).partition_stride,
        )
    if dims.dp_cp_sp_rank != 0:  # keep DP, CP and SP coordinate 0, and every EP rank's experts
        shards = {n: s for n, s in shards.items() if n in experts and dims.expert_dp_rank == 0}
    return {
        "losses": losses,
        "tp_rank": dims.tp_rank,
        "shards": shards,
        "optimizer_state": _optimizer_state_bytes(trainer.optimizer),
    }


def _optimizer_state_bytes(optimizer) -> int:
    state = optimizer.state_dict()
    inner = (
        state["optimizer"]["state"]
        if "optimizer" in state and "format" in state
        else state["state"]
    )
    total = 0
    for per_param in inner.values():
        for value in per_param.values():
            if hasattr(value, "numel") and value.dim() > 0:
                local = value.to_local() if isinstance(value, DTensor) else value
                total += local.numel() * local.element_size()
    return total


def merge_tp_shards(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Full parameters of one model replica from its TP shards on every pipeline stage.

    Tied-embedding replicas (`replica.*`, last stage) must equal the first stage's table
    exactly and are then dropped."""
    by_tp: dict[int, dict] = {}
    for r in per_rank:
        stage_shards = by_tp.setdefault(r["tp_rank"], {})
        for name, shard in r["shards"].items():
            assert name not in stage_shards, f"{name} held by two pipeline stages"
            stage_shards[name] = shard
    tp = len(by_tp)
    full = {}
    for name, (tensor, dim, stride) in by_tp[0].items():
        if name.startswith("replica."):
            continue
        if dim is None:
            full[name] = tensor
            continue
        full[name] = merge_tp([by_tp[t][name][0] for t in range(tp)], dim, stride)
    for name in [n for n in by_tp[0] if n.startswith("replica.")]:
        for t in range(tp):
            assert torch.equal(by_tp[t][name][0], by_tp[t][name[len("replica.") :]][0]), (
                f"tied embedding copies diverged on TP rank {t}"
            )
    return full


def _run(argv: list[str], world: int):
    results = run_distributed(train_and_collect, world, argv)
    losses = results[0]["losses"]
    for r in results:  # every rank must agree on the reported loss
        assert r["losses"] == losses
    return losses, merge_tp_shards(results), [r["optimizer_state"] for r in results]


def run_layout(argv: list[str], world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """(losses, full parameters) of a run with `argv` on `world` ranks."""
    losses, params, _ = _run(argv, world)
    return losses, params


def run_zero_layout(argv: list[str], world: int):
    """(losses, full parameters, per-rank optimizer-state bytes): for ZeRO's sharding checks."""
    return _run(argv, world)


def _key_bias_mask(bias: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """True on the key rows of a fused QKV bias laid out [groups, heads/groups + 2, d]."""
    per_group = heads // groups
    mask = torch.zeros(
        groups, per_group + 2, bias.numel() // (groups * (per_group + 2)), dtype=torch.bool
    )
    mask[:, per_group] = True
    return mask.flatten()


def compare(reference, candidate, heads: int, groups: int) -> tuple[float, float]:
    """(max per-step |loss diff|, max over tensors of max|diff| / max|reference|).

    The key bias is the one exception, compared in absolute terms: softmax is invariant to
    adding q·b_k to every score of a query, so its exact gradient is zero and it moves only by
    rounding noise that Adam amplifies; its size is no scale to be relative to.
    """
    ref_losses, ref_params = reference
    losses, params = candidate
    assert len(losses) == len(ref_losses)
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    assert params.keys() == ref_params.keys()
    param_diff = 0.0
    for name, ref in ref_params.items():
        diff = (params[name] - ref).abs()
        if name.endswith("attention.qkv.bias"):
            key = _key_bias_mask(ref, heads, groups)
            assert float(diff[key].max()) < 1e-5, f"{name} (key rows) differs"
            diff, ref = diff[~key], ref[~key]
        param_diff = max(param_diff, float(diff.max() / ref.abs().max()))
    return loss_diff, param_diff


@functools.cache
def _one_process(model_flags: tuple[str, ...]):
    return run_layout(BASE + list(model_flags), 1)


def one_process_reference(model_flags: list[str]):
    """The one-process run of BASE + model_flags, run once per session: every layout of that
    model compares with it."""
    return _one_process(tuple(model_flags))


def assert_matches_one_process(label: str, model: tuple, flags: list[str], world: int) -> None:
    """The layout bar: BASE + the model's flags + `flags` on `world` ranks reproduces the
    one-process run, per-step loss within 1e-5 and final parameters within 1e-5 (relative).
    model: (flags, query heads, kv groups)."""
    model_flags, heads, groups = model
    loss_diff, param_diff = compare(
        one_process_reference(model_flags),
        run_layout(BASE + model_flags + flags, world),
        heads,
        groups,
    )
    print(f"{label}: max loss diff {loss_diff:.2e}, max param rel diff {param_diff:.2e}")
    assert loss_diff < 1e-5
    assert param_diff < 1e-5
