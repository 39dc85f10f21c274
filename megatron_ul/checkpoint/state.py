"""What goes into a checkpoint, keyed by layout-independent names.

Names come from pipeline.model.global_named_parameters: the 0-based global layer index
(`layers.3.mlp.fc1.weight` is the fourth layer of the whole model whatever pipeline stage or
model chunk holds it), i.e. the PP=1 module names, so pipeline stages and other layouts map onto
them. The last stage's tied embedding copy is saved in its own stage file as
`replica.word_embeddings.weight` (with its own Adam moments), so every stage file is
self-contained; layout conversion drops it and re-derives it from `word_embeddings.weight`.
Optimizer state is keyed by the same names, so it reshards exactly like its parameter.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from ..mpu.random import get_rng_tracker
from ..pipeline.model import global_named_parameters


def named_parameters(model, optimizer=None) -> dict[str, torch.Tensor]:
    """{layout-independent name: parameter} for this rank's part of the model. With the
    optimizer, a parameter with an fp32 main copy (a half-precision model, or optimizer
    offload: optim/mixed_precision.py) is represented by that copy (`optimizer.main_param`):
    checkpoints hold the fp32 main weights, and the optimizer's state is keyed by it. (ZeRO-1/2
    keep their main pieces apart, `optimizer.main_shards`: layout/zero.py and the torch_dist
    pieces read those.)"""
    main = optimizer.main_param if optimizer is not None else (lambda p: p)
    return {name: main(p) for name, p in global_named_parameters(model)}


def model_state(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().cpu().clone() for name, p in named_parameters(model).items()}


def optimizer_state(model, optimizer) -> dict:
    """torch optimizer state re-keyed from positions to parameter names."""
    names = {id(p): n for n, p in named_parameters(model, optimizer).items()}
    torch_state = optimizer.state_dict()
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    per_name = {
        names[id(ordered[index])]: {
            k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()
        }
        for index, s in torch_state["state"].items()
    }
    groups = []
    for group, saved in zip(optimizer.param_groups, torch_state["param_groups"]):
        hyper = {k: v for k, v in saved.items() if k != "params"}
        groups.append({**hyper, "param_names": [names[id(p)] for p in group["params"]]})
    return {"state": per_name, "param_groups": groups}


def load_optimizer_state(model, optimizer, saved: dict, source: str) -> None:
    """Inverse of optimizer_state; `source` names the file in error messages."""
    names = {id(p): n for n, p in named_parameters(model, optimizer).items()}
    index_of, torch_groups = {}, []
    position = 0
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        ours = [names[id(p)] for p in group["params"]]
        if sorted(ours) != sorted(saved_group["param_names"]):
            diff = set(ours) ^ set(saved_group["param_names"])
            raise optim_error(source, f"parameter groups differ ({sorted(diff)[:4]})")
        hyper = {k: v for k, v in saved_group.items() if k != "param_names"}
        torch_groups.append({**hyper, "params": list(range(position, position + len(ours)))})
        for name in ours:
            index_of[name] = position
            position += 1
    if len(optimizer.param_groups) != len(saved["param_groups"]):
        raise optim_error(source, "the number of parameter groups differs")
    params = named_parameters(model, optimizer)
    state = {}
    for name, s in saved["state"].items():
        if name not in index_of:
            raise optim_error(source, f"state for unknown parameter {name}")
        for key in ("exp_avg", "exp_avg_sq"):
            if key in s and s[key].shape != params[name].shape:
                raise optim_error(
                    source,
                    f"{name}.{key} has shape {tuple(s[key].shape)}, the "
                    f"model {tuple(params[name].shape)}",
                )
        state[index_of[name]] = s
    optimizer.load_state_dict({"state": state, "param_groups": torch_groups})


def optim_error(source: str, what: str):
    from .files import CheckpointError

    return CheckpointError(
        f"{source}: optimizer state does not fit this model: {what}; "
        f"pass --no-load-optim to start the optimizer afresh"
    )


def rng_state() -> dict:
    """This rank's RNG streams: torch default (CPU and CUDA), the mpu tracker, python, numpy."""
    np_state = np.random.get_state()
    assert isinstance(np_state, tuple), "numpy's legacy state: (name, keys, pos, gauss, cached)"
    state = {
        "torch": torch.get_rng_state(),
        "tracker": get_rng_tracker().get_states(),
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_rng_tracker().set_states(state["tracker"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            n["keys"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
