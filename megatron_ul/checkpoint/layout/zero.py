"""ZeRO state in the layout-independent checkpoint form, so ZeRO-1, ZeRO-3 and plain AdamW
checkpoints are interchangeable and reshard like any other (tools/checkpoint/convert.py).

On save, every dp_cp_sp rank takes part in gathering, ONE parameter at a time, the full fp32
exp_avg / exp_avg_sq (and step) of each parameter of its (tp, pp) part — the name-keyed form
state.optimizer_state writes for the plain optimizer — and the dp0/sp0 rank writes it with the
model. ZeRO-3 (FSDP2) parameters are DTensors: the model is saved as full tensors too. On load,
every rank reads the name-keyed state (resharded over TP/PP first when needed) and keeps its own
shard: ZeRO-1 its pieces of the flat buffer, ZeRO-3 its DTensor chunks. Loading needs no
collectives.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from ...model.chunks import model_dims
from ...mpu.param_spec import param_spec
from ...pipeline.model import global_named_parameters
from ..files import CheckpointError
from ..state import load_optimizer_state, named_parameters, optimizer_state

MOMENTS = ("exp_avg", "exp_avg_sq")


def _zero1(optimizer) -> bool:
    """ZeRO-1/2: the Adam state lives in pieces of a flat buffer."""
    return optimizer.shards_flat_buffer


def _is_dp_cp_sp_root(model) -> bool:
    return model_dims(model).dp_cp_sp_rank == 0


# ---- expert parallelism ----------------------------------------------------------------------
# Expert names carry their global index (model/moe/experts.py), so a checkpoint holds every
# expert under one name whatever the EP size: the writer gathers the other EP ranks' experts on
# save and each rank keeps its own on load. Under ZeRO-1/2 an expert's main weights and moments
# are first gathered over its expert-DP group (onto that group's first rank, which is in the
# EP group of the dp_cp_sp root), then over EP like plain AdamW state; under ZeRO-3 the expert
# DTensors live on an expert-DP mesh, and each is made full there first.
_EXPERT_INDEX = re.compile(r"(\.local_experts\.)\d+\.")


def _expert_names(model) -> set[str]:
    return {n for n, p in global_named_parameters(model) if param_spec(p).grad_group == "expert_dp"}


def _gather_experts(model, mine: Any) -> list | None:
    """Every EP rank's `mine` (CPU objects) on EP rank 0, None elsewhere (collective over the
    EP group; each EP group gathers in its own)."""
    group = model_dims(model).ep_group
    root = dist.get_global_rank(group, 0)
    out: list | None = [None] * dist.get_world_size(group) if dist.get_rank() == root else None
    dist.gather_object(mine, out, dst=root, group=group)
    return out


def _is_other_expert(name: str, local: set[str]) -> bool:
    """`name` is an expert another EP rank holds: the same parameter of another index."""
    template = _EXPERT_INDEX.sub(r"\1*.", name)
    return template != name and any(_EXPERT_INDEX.sub(r"\1*.", n) == template for n in local)


def local_experts_only(model, names) -> set[str]:
    """The names in `names` this rank does not hold because another EP rank holds them."""
    if model_dims(model).ep == 1:
        return set()
    local = set(named_parameters(model))
    return {n for n in names if n not in local and _is_other_expert(n, local)}


def _model_state_with_experts(model, params: dict) -> dict | None:
    experts, root = _expert_names(model), _is_dp_cp_sp_root(model)
    mine = {n: p.detach().cpu().clone() for n, p in params.items() if root or n in experts}
    parts = _gather_experts(model, {n: t for n, t in mine.items() if n in experts})
    if not root or parts is None:
        return None
    for part in parts:
        mine.update(part)
    return mine


def _optimizer_state_with_experts(model, optimizer) -> dict | None:
    experts, root = _expert_names(model), _is_dp_cp_sp_root(model)
    state = optimizer_state(model, optimizer)
    for per_param in state["state"].values():  # ZeRO-3: every rank gathers, one at a time
        for key, value in per_param.items():
            if isinstance(value, DTensor):
                per_param[key] = value.full_tensor().cpu()
    mine = (
        {n: s for n, s in state["state"].items() if n in experts},
        [[n for n in g["param_names"] if n in experts] for g in state["param_groups"]],
    )
    parts = _gather_experts(model, mine)
    if not root or parts is None:
        return None
    for per_name, groups in parts[1:]:
        state["state"].update(per_name)
        for group, names in zip(state["param_groups"], groups):
            group["param_names"] += names
    return state


# ---- save ----------------------------------------------------------------------------------
def checkpoint_model_state(model, optimizer=None) -> dict[str, torch.Tensor] | None:
    """{name: full CPU tensor} on the dp_cp_sp root, None elsewhere (the optimizer's fp32 main
    weights where it keeps them). Collective over dp_cp_sp when parameters are DTensors
    (ZeRO-3) or the main weights are ZeRO-1/2 pieces: gathered one at a time; over the EP
    group under expert parallelism (every expert in the root's state)."""
    params, root = named_parameters(model, optimizer), _is_dp_cp_sp_root(model)
    pieces = {name: _main_pieces(optimizer, p) for name, p in params.items()}
    if model_dims(model).ep > 1:
        main = {}
        for n, p in params.items():  # every rank: the gathers are collectives
            shards = pieces[n]
            if shards is not None:
                main[n] = _gather_main(model, p, shards, optimizer)
            else:
                main[n] = p.full_tensor() if isinstance(p, DTensor) else p
        return _model_state_with_experts(model, main)
    if not root and not any(
        isinstance(p, DTensor) or pieces[name] is not None for name, p in params.items()
    ):
        return None
    out = {}
    for name, p in params.items():
        shards = pieces[name]
        if shards is not None:
            full = _gather_main(model, p, shards, optimizer)
        else:
            full = p.full_tensor() if isinstance(p, DTensor) else p
        if root:  # other ranks take part in the gather and keep nothing
            out[name] = full.detach().cpu().clone()
    return out if root else None


def _main_pieces(optimizer, p) -> list | None:
    """ZeRO-1/2's pieces of p's fp32 main copy on this rank; None where p is its own."""
    return None if optimizer is None else optimizer.main_shards(p)


def _gather_main(model, p, shards: list, optimizer) -> torch.Tensor:
    """p's fp32 main weights from the ZeRO-1/2 pieces every rank of its shard group holds
    (dp_cp_sp; an expert's: expert-DP): a SUM of disjoint pieces over zeros onto the group's
    first rank, exact (collective)."""
    full = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
    for start, piece in shards:
        full[start : start + piece.numel()] = piece
    group = optimizer.shard_group(p)
    if dist.get_world_size(group) > 1:
        dist.reduce(full, dst=dist.get_global_rank(group, 0), group=group)
    return full.view(p.shape)


def checkpoint_optimizer_state(model, optimizer) -> dict | None:
    """The name-keyed optimizer state of this (tp, pp) part on the dp_cp_sp root, None elsewhere.
    Collective over dp_cp_sp for ZeRO-1 and ZeRO-3."""
    if _zero1(optimizer):
        return _gather_zero1(model, optimizer)
    if model_dims(model).ep > 1:
        return _optimizer_state_with_experts(model, optimizer)
    if not _is_dp_cp_sp_root(model) and not any(
        isinstance(p, DTensor) for p in named_parameters(model).values()
    ):
        return None  # plain AdamW: replicated over dp_cp_sp, the root has it all
    state, root = optimizer_state(model, optimizer), _is_dp_cp_sp_root(model)
    for per_param in state["state"].values():  # ZeRO-3: DTensor moments, one at a time
        for key, value in per_param.items():
            if isinstance(value, DTensor):
                full = value.full_tensor()  # collective: every rank takes part
                per_param[key] = full.cpu() if root else None  # only the writer keeps it
    return state if root else None


def _gather_zero1(model, optimizer) -> dict | None:
    """Reduce (SUM of disjoint pieces, zeros elsewhere: exact) each parameter's two moments onto
    the dp_cp_sp root; all ranks loop over the parameters in the same (buffer) order."""
    names = {id(p): n for n, p in named_parameters(model).items()}
    inner = optimizer.optimizer
    piece_state = {
        (name, lo): inner.state.get(piece, {})
        for (name, _, _, lo, _), piece in zip(optimizer.pieces, inner_params(optimizer))
    }
    step = next((s["step"] for s in piece_state.values() if "step" in s), None)
    is_root = _is_dp_cp_sp_root(model)
    pieces_of: dict[int, list] = {}  # by id() of the parameter
    for name, p, offset, lo, hi in optimizer.pieces:
        pieces_of.setdefault(id(p), []).append((offset, lo, hi, piece_state[(name, lo)]))
    gathered = {}
    for p in optimizer.params:
        group = optimizer.shard_group(p)
        is_group_root = dist.get_rank(group) == 0
        both = torch.zeros(2, p.numel(), dtype=torch.float32, device=p.device)
        held = False
        for start, lo, hi, s in pieces_of.get(id(p), []):
            if "exp_avg" in s:
                held = True
                for row, key in enumerate(MOMENTS):
                    both[row, lo - start : hi - start] = s[key]
        flags = torch.tensor([float(held)], device=p.device)
        if dist.get_world_size(group) > 1:
            root = dist.get_global_rank(group, 0)
            dist.reduce(both, dst=root, group=group)
            dist.reduce(flags, dst=root, group=group)
        if is_group_root and flags.item() > 0:  # other ranks keep nothing they reduced
            gathered[names[id(p)]] = {
                "step": step.clone() if torch.is_tensor(step) else step,
                **{k: both[i].view_as(p).cpu().clone() for i, k in enumerate(MOMENTS)},
            }
    groups = _zero1_groups(model, optimizer)
    if model_dims(model).ep > 1:  # the other EP ranks' experts, from their expert-DP roots
        experts = _expert_names(model)
        mine = (
            {n: s for n, s in gathered.items() if n in experts},
            [[n for n in g["param_names"] if n in experts] for g in groups],
        )
        parts = _gather_experts(model, mine)
        if is_root and parts is not None:
            for per_name, names_per_group in parts[1:]:
                gathered.update(per_name)
                for group_state, more in zip(groups, names_per_group):
                    group_state["param_names"] += more
    if not is_root:
        return None
    return {"state": gathered, "param_groups": groups}


def inner_params(optimizer) -> list[torch.Tensor]:
    """The inner AdamW's piece tensors in optimizer.pieces order (decay group, then no-decay:
    see DistributedOptimizer._build_inner)."""
    decay, no_decay = optimizer.optimizer.param_groups
    it_decay, it_no = iter(decay["params"]), iter(no_decay["params"])
    return [next(it_no) if p.dim() == 1 else next(it_decay) for _, p, _, _, _ in optimizer.pieces]


def _zero1_groups(model, optimizer) -> list[dict]:
    """Plain AdamW's two groups (decay: dim != 1, no decay: 1-D), named by parameter."""
    params = named_parameters(model)
    groups = []
    for group, one_d in zip(optimizer.optimizer.param_groups, (False, True)):
        hyper = {k: v for k, v in group.items() if k != "params"}
        names = [n for n, p in params.items() if p.requires_grad and (p.dim() == 1) == one_d]
        groups.append({**hyper, "param_names": names})
    return groups


# ---- load ----------------------------------------------------------------------------------
def load_model_state(model, state: dict, source: str, optimizer=None) -> None:
    """A full name-keyed model state into the model (the optimizer's main copies where it
    keeps them), its names and shapes checked first."""
    params = named_parameters(model, optimizer)
    others = local_experts_only(model, state)
    state = {n: t for n, t in state.items() if n not in others}
    missing, unexpected = set(params) - set(state), set(state) - set(params)
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: parameter names differ from the model: missing "
            f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    for name, p in params.items():
        if tuple(state[name].shape) != tuple(p.shape):
            raise CheckpointError(
                f"{source}: {name} has shape {tuple(state[name].shape)} in the "
                f"checkpoint but {tuple(p.shape)} in this model"
            )
    load_checkpoint_model_state(model, state, optimizer)  # ZeRO-3: each rank its chunk


def load_checkpoint_model_state(model, state: dict, optimizer=None) -> None:
    """Copy full tensors into the parameters (the optimizer's main copies where it keeps them);
    a DTensor keeps only its own chunk. Shapes and names must already have been checked."""
    with torch.no_grad():
        for name, p in named_parameters(model, optimizer).items():
            full = state[name]
            if isinstance(p, DTensor):
                p.to_local().copy_(_my_chunk(full, p))
            else:
                p.copy_(full)
            for start, piece in _main_pieces(optimizer, p) or ():  # ZeRO-1/2's fp32 main
                piece.copy_(full.reshape(-1)[start : start + piece.numel()])


def _my_chunk(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's local part of `full` laid out like `like` (no communication)."""
    return distribute_tensor(
        full.to(like.device, like.dtype), like.device_mesh, like.placements, src_data_rank=None
    ).to_local()


def load_checkpoint_optimizer_state(model, optimizer, saved: dict, source: str) -> None:
    """Each rank keeps its shard of the name-keyed state `saved` (of this rank's part)."""
    others = local_experts_only(model, saved["state"])
    if others:  # the other EP ranks' experts
        saved = {
            **saved,
            "state": {n: s for n, s in saved["state"].items() if n not in others},
            "param_groups": [
                {**g, "param_names": [n for n in g["param_names"] if n not in others]}
                for g in saved["param_groups"]
            ],
        }
    if _zero1(optimizer):
        _load_zero1(model, optimizer, saved, source)
        return
    params = named_parameters(model, optimizer)
    if any(isinstance(p, DTensor) for p in params.values()):
        state = {
            n: (
                {k: (_as_dtensor(v, params[n]) if k in MOMENTS else v) for k, v in s.items()}
                if n in params
                else s
            )
            for n, s in saved["state"].items()
        }
        saved = {**saved, "state": state}
    load_optimizer_state(model, optimizer, saved, source)


def _as_dtensor(full: torch.Tensor, like: torch.Tensor):
    if not isinstance(like, DTensor) or full.shape != like.shape:
        return full  # a shape mismatch is reported by load_optimizer_state
    chunk = _my_chunk(full, like)
    return DTensor.from_local(
        chunk,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def _load_zero1(model, optimizer, saved: dict, source: str) -> None:
    """Validate the name-keyed state against the model (names, groups, shapes) with the plain
    loader's checks, then cut every piece this rank owns out of its parameter's moments."""
    names = {id(p): n for n, p in named_parameters(model).items()}
    _check_zero1(model, optimizer, saved, source)
    inner = optimizer.optimizer
    state, index = {}, {}
    for position, p in enumerate(q for g in inner.param_groups for q in g["params"]):
        index[id(p)] = position
    for (_, p, offset, lo, hi), piece in zip(optimizer.pieces, inner_params(optimizer)):
        s = saved["state"].get(names[id(p)])
        if s is None:
            continue
        state[index[id(piece)]] = {
            "step": s["step"].clone() if torch.is_tensor(s["step"]) else s["step"],
            **{k: s[k].reshape(-1)[lo - offset : hi - offset].clone() for k in MOMENTS},
        }
    groups = []
    for group, saved_group in zip(inner.param_groups, saved["param_groups"]):
        hyper = {k: v for k, v in saved_group.items() if k != "param_names"}
        groups.append({**hyper, "params": [index[id(q)] for q in group["params"]]})
    inner.load_state_dict({"state": state, "param_groups": groups})


def _check_zero1(model, optimizer, saved: dict, source: str) -> None:
    from ..state import optim_error

    ours = _zero1_groups(model, optimizer)
    if len(ours) != len(saved["param_groups"]):
        raise optim_error(source, "the number of parameter groups differs")
    for group, saved_group in zip(ours, saved["param_groups"]):
        if sorted(group["param_names"]) != sorted(saved_group["param_names"]):
            diff = set(group["param_names"]) ^ set(saved_group["param_names"])
            raise optim_error(source, f"parameter groups differ ({sorted(diff)[:4]})")
    params = named_parameters(model)
    for name, s in saved["state"].items():
        if name not in params:
            raise optim_error(source, f"state for unknown parameter {name}")
        for key in MOMENTS:
            if key in s and s[key].shape != params[name].shape:
                raise optim_error(
                    source,
                    f"{name}.{key} has shape {tuple(s[key].shape)}, the "
                    f"model {tuple(params[name].shape)}",
                )
