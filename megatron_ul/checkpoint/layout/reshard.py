"""Layout conversion: merge tensor-parallel shards into full tensors and cut them again for
another TP/PP layout, following the parameter table (pipeline/param_table.py): each
parameter's partition dim and stride, padded vocabulary rows, pipeline stage and replica
source come from the modules that own those rules, never from its name.

SP and DP replicate parameters and optimizer state in the checkpoint (ZeRO-1/3 state is saved
gathered, name-keyed, like plain AdamW's: checkpoint/layout/zero.py), so changing them only changes
metadata. With tied embeddings and PP > 1 the last stage holds a copy of the word embeddings
(`replica.word_embeddings.weight`); merging drops replicas (after checking they equal the
table they copy); cutting for PP > 1 re-derives them, Adam moments included.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import uuid
from dataclasses import fields

import torch

from ...config import ResolvedModelConfig
from ...mpu.layers import tp_slice
from ...pipeline.param_table import parameter_table, stage_parameter_names
from .. import files
from ..files import CheckpointError
from ..full import FullCheckpoint
from ..group_progress import stage_file_size, tensor_groups

log = logging.getLogger("megatron_ul")


def merge_tp(shards: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of mpu.layers._shard: each shard holds its chunk of each of `stride` blocks."""
    blocks = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([torch.cat([b[i] for b in blocks], dim=dim) for i in range(stride)], dim=dim)


def split_tp(full: torch.Tensor, dim: int, stride: int, tp: int) -> list[torch.Tensor]:
    if full.shape[dim] % (tp * stride) != 0:
        raise CheckpointError(
            f"dimension {dim} of size {full.shape[dim]} cannot be split over "
            f"TP {tp} (stride {stride}); choose a TP size that divides it"
        )
    return [tp_slice(full, dim, stride, tp, r).contiguous() for r in range(tp)]


def set_vocab_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Trim or zero-pad dim 0 (padding rows are outside the softmax, so their values are inert)."""
    if t.shape[0] >= rows:
        return t[:rows].clone()
    pad = torch.zeros((rows - t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype)
    return torch.cat([t, pad], dim=0)


def model_config(meta: dict) -> ResolvedModelConfig:
    """The model recorded in checkpoint metadata, as the resolved config it was saved from
    (fields this version does not know are ignored)."""
    known = {f.name for f in fields(ResolvedModelConfig)}
    return ResolvedModelConfig(**{k: v for k, v in meta["model"].items() if k in known})


def layout_table(meta: dict, tp: int, pp: int, vp: int | None) -> dict[str, dict]:
    """The parameter table of this checkpoint's model in layout TP `tp` × PP `pp` (chunks of
    `vp` layers); CheckpointError when the layers do not split that way."""
    try:
        return parameter_table(model_config(meta), tp, pp, vp)
    except ValueError as e:
        raise CheckpointError(f"target layout: {e}") from None


def check_target_layout(
    meta: dict, tp: int, pp: int, sp: int, dp: int, vp: int | None, sequence_parallel: bool = False
) -> None:
    """Refuse a target layout the trainer would refuse, with the trainer's own validation
    (config_rules.validate), before anything is written."""
    from ...config import Config, ConfigError, DataConfig, ParallelConfig, TrainConfig, resolve
    from ...config_rules import validate

    cfg = Config(
        model=model_config(meta),
        parallel=ParallelConfig(
            tensor_model_parallel_size=tp,
            ds_sequence_parallel_size=sp,
            pipeline_model_parallel_size=pp,
            sequence_parallel=sequence_parallel,
            world_size=tp * sp * pp * dp,
            num_layers_per_virtual_pipeline_stage=vp,
        ),
        # any batch the interleaved schedule accepts: only the layout is judged here
        train=TrainConfig(global_batch_size=dp * pp),
        data=DataConfig(mock_data=True),
    )
    try:
        validate(resolve(cfg))
    except ConfigError as e:
        raise CheckpointError(
            f"the target layout TP{tp} PP{pp} SP{sp} DP{dp}"
            f"{f' VP{vp}' if vp else ''} would be refused by the trainer "
            f"(the --target-* flags set these):\n{e}"
        ) from None


def saved_table(meta: dict) -> dict[str, dict]:
    """The table a checkpoint was written with: metadata["params"] (checkpoints written before
    the table recorded stages get it re-derived from their model and layout)."""
    params = meta["params"]
    if all("stage" in entry for entry in params.values()):
        return params
    layout = meta["layout"]
    return layout_table(meta, layout["tp"], layout["pp"], layout.get("vp"))


def merge_one(shards: list, info: dict, vocab: int) -> torch.Tensor:
    dim = info["partition_dim"]
    full = shards[0] if dim is None else merge_tp(shards, dim, info["partition_stride"])
    return set_vocab_rows(full, vocab) if info["vocab_padded"] else full


def read_full(iter_dir: str, with_optim: bool = True, progress: bool = False) -> FullCheckpoint:
    """The iteration in `iter_dir` merged to TP1/PP1, read by the storage format that wrote it
    (with `progress`, a line per tensor group on stderr)."""
    from ..storage import format_of

    meta = files.read_metadata(iter_dir)
    fmt = format_of(meta, os.path.join(iter_dir, files.METADATA))
    return fmt.read_full(meta, iter_dir, with_optim, progress)


def shard_for(
    full: FullCheckpoint, table: dict[str, dict], names, tp_rank: int, tp: int
) -> tuple[dict, dict | None]:
    """(model state, optimizer state) of TP rank `tp_rank` of `tp` for parameters `names`, cut
    by their entries in `table` (the target layout's; a replica gets a copy of the parameter
    it replicates, Adam moments included)."""

    def cut(t: torch.Tensor, info: dict) -> torch.Tensor:
        if info["vocab_padded"]:
            t = set_vocab_rows(t, info["shape"][0])
        dim = info["partition_dim"]
        return t.clone() if dim is None else split_tp(t, dim, info["partition_stride"], tp)[tp_rank]

    source = {n: table[n]["replica_of"] or n for n in names}
    model = {n: cut(full.params[source[n]], table[n]) for n in names}
    if full.optim_state is None or full.optim_groups is None:  # set together: both or none
        return model, None
    state = {
        n: {
            k: (cut(v, table[n]) if k in ("exp_avg", "exp_avg_sq") else v)
            for k, v in full.optim_state[source[n]].items()
        }
        for n in names
        if source[n] in full.optim_state
    }
    groups = []
    for g in full.optim_groups:
        members = set(g["param_names"])
        groups.append(
            {
                **{k: v for k, v in g.items() if k != "param_names"},
                "param_names": [n for n in names if source[n] in members],
            }
        )
    return model, {"state": state, "param_groups": groups}


def target_metadata(
    full: FullCheckpoint,
    tp: int,
    pp: int,
    sp: int,
    dp: int,
    with_optim: bool,
    vp: int | None = None,
) -> dict:
    meta = copy.deepcopy(full.metadata)
    meta["layout"] = {
        "tp": tp,
        "pp": pp,
        "sp": sp,
        "dp": dp,
        "world": tp * pp * sp * dp,
        "sequence_parallel": meta["layout"].get("sequence_parallel", False),
        "vp": vp,
    }
    meta["params"] = layout_table(meta, tp, pp, vp)
    meta["optimizer"] = "replicated" if with_optim and full.optim_state is not None else None
    meta["rng"] = False  # per-rank RNG streams belong to the old layout
    from ..storage.torch_files import TorchFiles  # (it imports this module)

    meta["storage"] = TorchFiles.name  # write_layout writes the torch files
    meta.pop("piece_sha256", None)
    return meta


def convert(
    load_dir: str,
    save_dir: str,
    tp: int,
    pp: int,
    sp: int | None = None,
    dp: int | None = None,
    with_optim: bool = True,
    iteration: int | None = None,
    vp: int | None = None,
) -> str:
    """Write the latest (or given) iteration of `load_dir` into `save_dir` for a new layout.
    Never touches `load_dir`; refuses to replace an existing iteration in `save_dir`."""
    if os.path.abspath(load_dir) == os.path.abspath(save_dir):
        raise CheckpointError(
            "--save-dir must differ from --load-dir (conversion never rewrites its source)"
        )
    iteration = files.read_tracker(load_dir) if iteration is None else iteration
    if iteration is None:
        raise CheckpointError(
            f"{os.path.join(load_dir, files.TRACKER)}: missing; {load_dir} "
            f"holds no complete checkpoint"
        )
    iter_dir = files.find_iteration_dir(load_dir, iteration)
    old = files.read_metadata(iter_dir)
    sp, dp = sp or old["layout"]["sp"], dp or old["layout"]["dp"]
    check_target_layout(old, tp, pp, sp, dp, vp, old["layout"].get("sequence_parallel", False))
    full = read_full(iter_dir, with_optim, progress=True)
    return write_target(full, save_dir, iteration, tp, pp, sp, dp, with_optim, vp)


def write_target(
    full: FullCheckpoint,
    save_dir: str,
    iteration: int,
    tp: int,
    pp: int,
    sp: int,
    dp: int,
    with_optim: bool,
    vp: int | None = None,
) -> str:
    """Write `full` as iteration `iteration` of `save_dir` for the layout TP × PP (× VP), with
    SP and DP recorded; returns the iteration directory."""
    meta = target_metadata(full, tp, pp, sp, dp, with_optim, vp)
    return write_layout(full, meta, save_dir, iteration, tp, pp, with_optim, vp)


def write_layout(
    full: FullCheckpoint,
    meta: dict,
    save_dir: str,
    iteration: int,
    tp: int,
    pp: int,
    with_optim: bool,
    vp: int | None = None,
) -> str:
    """Write `full` as iteration `iteration` of `save_dir` cut for TP `tp` × PP `pp` (chunks
    of `vp` layers when interleaved; tmp directory renamed into place, tracker last); refuses
    to replace an existing iteration."""
    final = os.path.join(save_dir, files.iteration_dir_name(iteration))
    if os.path.exists(final):
        raise CheckpointError(f"{final} already exists; choose an empty --save-dir")
    os.makedirs(save_dir, exist_ok=True)
    tmp = f"{final}.tmp-{uuid.uuid4().hex[:12]}"
    os.makedirs(tmp)
    try:
        table, records = meta["params"], {}
        parts = [(s, t) for s in range(pp) for t in range(tp)]
        size = stage_file_size(tmp, pp)
        for s, t in tensor_groups(parts, len(parts), f"writing {final}", size=size):
            stage = stage_parameter_names(table, s)
            model, optim = shard_for(full, table, stage, t, tp)
            path = files.model_file(tmp, t, s, pp)
            records[os.path.relpath(path, tmp)] = files.save_torch(
                {**full.common, "model": model, "optimizer": optim if with_optim else None},
                path,
            )
        files.write_metadata(tmp, {**meta, "files": records})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed conversion leaves nothing behind
        raise
    os.rename(tmp, final)
    files.fsync_dir(save_dir)
    files.write_tracker(save_dir, iteration)
    return final
