"""Layout conversion: merge tensor-parallel shards into full tensors by each parameter's
partition_dim/partition_stride, and cut them again for another TP/PP layout.

SP and DP replicate parameters and optimizer state in the checkpoint (ZeRO-1/3 state is saved
gathered, name-keyed, like plain AdamW's: checkpoint/zero.py), so changing them only changes
metadata. Parameter names carry 0-based global layer indices, so pipeline stages are
assigned by name with the pipeline's own rule (pipeline.model.chunk_layer_numbers, interleaved
chunks included): the first stage holds the embeddings, the last the final norm and output head
and, with tied embeddings and PP > 1, its copy of the word embeddings under
`replica.word_embeddings.weight`. Merging drops replicas (after checking they equal the table
they copy); cutting for PP > 1 re-derives them, Adam moments included.
"""
from __future__ import annotations

import copy
import logging
import math
import os
import uuid
from dataclasses import dataclass

import torch

from ..mpu.layers import tp_slice
from ..pipeline.model import REPLICA_PREFIX, replicated_name, stage_layer_indices
from . import files
from .files import CheckpointError

log = logging.getLogger("megatron_ul")


def merge_tp(shards: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of mpu.layers._shard: each shard holds its chunk of each of `stride` blocks."""
    blocks = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([torch.cat([b[i] for b in blocks], dim=dim) for i in range(stride)], dim=dim)


def split_tp(full: torch.Tensor, dim: int, stride: int, tp: int) -> list[torch.Tensor]:
    if full.shape[dim] % (tp * stride) != 0:
        raise CheckpointError(f"dimension {dim} of size {full.shape[dim]} cannot be split over "
                              f"TP {tp} (stride {stride}); choose a TP size that divides it")
    return [tp_slice(full, dim, stride, tp, r).contiguous() for r in range(tp)]


def padded_vocab(model_cfg: dict, tp: int) -> int:
    multiple = model_cfg["make_vocab_size_divisible_by"] * tp
    return int(math.ceil(model_cfg["vocab_size"] / multiple) * multiple)


def set_vocab_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Trim or zero-pad dim 0 (padding rows are outside the softmax, so their values are inert)."""
    if t.shape[0] >= rows:
        return t[:rows].clone()
    pad = torch.zeros((rows - t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype)
    return torch.cat([t, pad], dim=0)


def model_chunks_for(num_layers: int, pp: int, vp: int | None) -> int:
    """Model chunks per pp rank for --num-layers-per-virtual-pipeline-stage `vp` (None: 1)."""
    if num_layers % pp != 0:
        raise CheckpointError(f"--num-layers {num_layers} is not divisible by the target "
                              f"pipeline size {pp}")
    if vp is None:
        return 1
    if pp == 1 or num_layers % (pp * vp) != 0:
        raise CheckpointError(f"--num-layers {num_layers} does not split into {pp} pipeline "
                              f"stages of chunks of {vp} layers; the virtual pipeline size "
                              f"needs PP > 1 and num_layers divisible by PP x {vp}")
    return num_layers // (pp * vp)


def stage_names(names, pp_rank: int, pp: int, model_cfg: dict,
                vp: int | None = None) -> list[str]:
    """The parameter names pipeline stage `pp_rank` of `pp` (chunks of `vp` layers) holds,
    from the merged (replica-free) names."""
    chunks = model_chunks_for(model_cfg["num_layers"], pp, vp)
    layers = set(stage_layer_indices(model_cfg["num_layers"], pp, chunks, pp_rank))
    first, last = pp_rank == 0, pp_rank == pp - 1
    chosen = []
    for name in names:
        if name.startswith("layers."):
            keep = int(name.split(".")[1]) in layers
        elif name.startswith(("word_embeddings.", "position_embeddings.")):
            keep = first
        else:  # final_norm, output_layer
            keep = last
        if keep:
            chosen.append(name)
    tied = not model_cfg["untie_embeddings_and_output_weights"]
    if last and not first and tied and "word_embeddings.weight" in names:
        chosen.append(REPLICA_PREFIX + "word_embeddings.weight")
    return chosen


@dataclass
class FullCheckpoint:
    """One iteration merged to TP1/PP1: unpadded full tensors keyed by canonical name."""
    metadata: dict
    common: dict                  # iteration, scheduler, consumed samples, args
    params: dict
    optim_state: dict | None      # name -> {exp_avg, exp_avg_sq, step}
    optim_groups: list | None     # hyper-parameters and param_names per group


def _merge_one(shards: list, info: dict, vocab: int) -> torch.Tensor:
    dim = info["partition_dim"]
    full = shards[0] if dim is None else merge_tp(shards, dim, info["partition_stride"])
    return set_vocab_rows(full, vocab) if info["vocab_padded"] else full


def read_full(iter_dir: str, with_optim: bool = True) -> FullCheckpoint:
    meta_path = os.path.join(iter_dir, files.METADATA)
    meta = files.read_json(meta_path, "checkpoint metadata")
    files.check_format(meta, meta_path)
    layout, vocab = meta["layout"], meta["model"]["vocab_size"]
    tp, pp = layout["tp"], layout["pp"]
    by_stage = [[files.load_torch(files.model_file(iter_dir, t, s, pp), "model shard")
                 for t in range(tp)] for s in range(pp)]
    params, optim_state = {}, ({} if with_optim and meta.get("optimizer") else None)
    replicas = {}
    for name, info in meta["params"].items():
        stage = next((s for s in range(pp) if name in by_stage[s][0]["model"]), None)
        if stage is None:
            raise CheckpointError(f"{meta_path} lists {name} but no stage file of {iter_dir} "
                                  f"holds it; the checkpoint is incomplete")
        shards = by_stage[stage]
        merged = _merge_one([sh["model"][name] for sh in shards], info, vocab)
        (replicas if name.startswith(REPLICA_PREFIX) else params)[name] = merged
        if optim_state is not None and not name.startswith(REPLICA_PREFIX):
            per_rank = [sh["optimizer"]["state"].get(name) for sh in shards]
            if per_rank[0] is not None:
                optim_state[name] = {k: (_merge_one([r[k] for r in per_rank], info, vocab)
                                         if k in ("exp_avg", "exp_avg_sq") else v)
                                     for k, v in per_rank[0].items()}
    _check_replicas(replicas, params, iter_dir)
    groups = None
    if optim_state is not None:  # union of the stages' groups, in order, without replicas
        groups = copy.deepcopy(by_stage[0][0]["optimizer"]["param_groups"])
        for s in range(1, pp):
            for g, other in zip(groups, by_stage[s][0]["optimizer"]["param_groups"]):
                g["param_names"] += other["param_names"]
        for g in groups:
            g["param_names"] = [n for n in g["param_names"] if not n.startswith(REPLICA_PREFIX)]
    common = {k: v for k, v in by_stage[0][0].items() if k not in ("model", "optimizer")}
    return FullCheckpoint(meta, common, params, optim_state, groups)


def _check_replicas(replicas: dict, params: dict, iter_dir: str) -> None:
    """Tied copies equal their table after every step; say so loudly if a checkpoint's don't
    (the first stage's table is the one kept)."""
    for name, copy_ in replicas.items():
        table = params.get(replicated_name(name))
        if table is None or not torch.equal(table, copy_):
            diff = ("missing" if table is None
                    else f"max diff {float((table - copy_).abs().max()):.3e}")
            log.warning("%s: the last stage's tied embedding copy %s differs from %s (%s); "
                        "keeping the first stage's table", iter_dir, name,
                        replicated_name(name), diff)


def shard_for(full: FullCheckpoint, names, tp_rank: int, tp: int) -> tuple[dict, dict | None]:
    """(model state, optimizer state) of TP rank `tp_rank` of `tp` for parameters `names`
    (`replica.` names get a copy of the table they replicate, Adam moments included)."""
    rows = padded_vocab(full.metadata["model"], tp)

    def cut(t: torch.Tensor, info: dict) -> torch.Tensor:
        if info["vocab_padded"]:
            t = set_vocab_rows(t, rows)
        dim = info["partition_dim"]
        return t.clone() if dim is None else split_tp(t, dim, info["partition_stride"],
                                                      tp)[tp_rank]
    infos = full.metadata["params"]
    source = {n: replicated_name(n) for n in names}
    model = {n: cut(full.params[source[n]], infos[source[n]]) for n in names}
    if full.optim_state is None:
        return model, None
    state = {n: {k: (cut(v, infos[source[n]]) if k in ("exp_avg", "exp_avg_sq") else v)
                 for k, v in full.optim_state[source[n]].items()}
             for n in names if source[n] in full.optim_state}
    groups = []
    for g in full.optim_groups:
        members = set(g["param_names"])
        groups.append({**{k: v for k, v in g.items() if k != "param_names"},
                       "param_names": [n for n in names if source[n] in members]})
    return model, {"state": state, "param_groups": groups}


def target_metadata(full: FullCheckpoint, tp: int, pp: int, sp: int, dp: int,
                    with_optim: bool, vp: int | None = None) -> dict:
    meta = copy.deepcopy(full.metadata)
    meta["layout"] = {"tp": tp, "pp": pp, "sp": sp, "dp": dp, "world": tp * pp * sp * dp,
                      "sequence_parallel": meta["layout"].get("sequence_parallel", False),
                      "vp": vp}
    rows = padded_vocab(meta["model"], tp)
    params = {n: i for n, i in meta["params"].items() if not n.startswith(REPLICA_PREFIX)}
    for name in stage_names(list(full.params), pp - 1, pp, meta["model"], vp):
        if name.startswith(REPLICA_PREFIX):
            params[name] = copy.deepcopy(params[replicated_name(name)])
    for info in params.values():
        if info["vocab_padded"]:
            info["shape"][0] = rows
    meta["params"] = params
    meta["optimizer"] = "replicated" if with_optim and full.optim_state is not None else None
    meta["rng"] = False   # per-rank RNG streams belong to the old layout
    return meta


def convert(load_dir: str, save_dir: str, tp: int, pp: int, sp: int | None = None,
            dp: int | None = None, with_optim: bool = True, iteration: int | None = None,
            vp: int | None = None) -> str:
    """Write the latest (or given) iteration of `load_dir` into `save_dir` for a new layout.
    Never touches `load_dir`; refuses to replace an existing iteration in `save_dir`."""
    if os.path.abspath(load_dir) == os.path.abspath(save_dir):
        raise CheckpointError("--save-dir must differ from --load-dir (conversion never "
                              "rewrites its source)")
    iteration = files.read_tracker(load_dir) if iteration is None else iteration
    if iteration is None:
        raise CheckpointError(f"{os.path.join(load_dir, files.TRACKER)}: missing; {load_dir} "
                              f"holds no complete checkpoint")
    full = read_full(files.find_iteration_dir(load_dir, iteration), with_optim)
    old = full.metadata["layout"]
    model_chunks_for(full.metadata["model"]["num_layers"], pp, vp)   # refuse before writing
    meta = target_metadata(full, tp, pp, sp or old["sp"], dp or old["dp"], with_optim, vp)
    return write_layout(full, meta, save_dir, iteration, tp, pp, with_optim, vp)


def write_layout(full: FullCheckpoint, meta: dict, save_dir: str, iteration: int, tp: int,
                 pp: int, with_optim: bool, vp: int | None = None) -> str:
    """Write `full` as iteration `iteration` of `save_dir` cut for TP `tp` × PP `pp` (chunks
    of `vp` layers when interleaved; tmp directory renamed into place, tracker last); refuses
    to replace an existing iteration."""
    final = os.path.join(save_dir, files.iteration_dir_name(iteration))
    if os.path.exists(final):
        raise CheckpointError(f"{final} already exists; choose an empty --save-dir")
    os.makedirs(save_dir, exist_ok=True)
    tmp = f"{final}.tmp-{uuid.uuid4().hex[:12]}"
    os.makedirs(tmp)
    names = list(full.params)
    for s in range(pp):
        stage = stage_names(names, s, pp, meta["model"], vp)
        for t in range(tp):
            model, optim = shard_for(full, stage, t, tp)
            files.save_torch({**full.common, "model": model,
                              "optimizer": optim if with_optim else None},
                             files.model_file(tmp, t, s, pp))
    files.write_json_durably(os.path.join(tmp, files.METADATA), meta)
    os.rename(tmp, final)
    files.fsync_dir(save_dir)
    files.write_tracker(save_dir, iteration)
    return final


def param_info(name: str, shape, model_cfg: dict) -> dict:
    """How mpu.layers shards a parameter of the GPTModel, from its canonical name (for
    checkpoints made without building a model, e.g. Hugging Face imports)."""
    column = name.endswith(("qkv.weight", "qkv.bias", "fc1.weight", "fc1.bias",
                            "word_embeddings.weight", "output_layer.weight"))
    row = name.endswith(("proj.weight", "fc2.weight")) and not column
    stride = 2 if model_cfg["swiglu"] and ".fc1." in name else 1
    return {"shape": list(shape), "partition_dim": 0 if column else 1 if row else None,
            "partition_stride": stride if column else 1,
            "vocab_padded": name.endswith(("word_embeddings.weight", "output_layer.weight"))}
