"""The torch storage format (--ckpt-format torch, Megatron-LM's): the dp0/cp0/sp0 rank of each
(tp, pp) writes that part's model and optimizer state, in the layout-independent name-keyed
form (ZeRO state gathered first: checkpoint/layout/zero.py), into one torch.save file,
DIR/iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt, with the common state. A load on the same
TP/PP/VP layout reads its own file; on another it merges the whole iteration to TP1/PP1 and
cuts its part (checkpoint/layout/reshard.py). Conversions and imports write this format."""

from __future__ import annotations

import copy
import logging
import os

import torch
import torch.distributed as dist

from ...model.chunks import model_dims
from .. import files
from ..files import CheckpointError
from ..full import FullCheckpoint
from ..group_progress import stage_file_size, tensor_groups
from ..layout import reshard
from ..layout.zero import (
    checkpoint_model_state,
    checkpoint_optimizer_state,
    load_checkpoint_optimizer_state,
    load_model_state,
)
from ..state import named_parameters
from .base import LoadJob, Opened, SaveJob, Written, check_optimizer_kind

log = logging.getLogger("megatron_ul")


class TorchFiles:
    name = "torch"
    optimizer_kind = "replicated"

    def write(self, job: SaveJob) -> Written:
        dims = model_dims(job.model)
        # Collective over dp_cp_sp under ZeRO (gathers one parameter at a time); None off the
        # writer.
        model_sd = checkpoint_model_state(job.model, job.optimizer)
        optim_sd = checkpoint_optimizer_state(job.model, job.optimizer) if job.save_optim else None
        records: dict = {}
        try:
            if dims.dp_cp_sp_rank == 0:  # DP, CP and SP coordinates all 0
                payload = {**job.common, "model": model_sd, "optimizer": optim_sd}
                path = files.model_file(job.tmp, dims.tp_rank, dims.pp_rank, dims.pp)
                records[os.path.relpath(path, job.tmp)] = files.save_torch(payload, path)
        except CheckpointError as e:
            return Written(records, str(e))
        return Written(records)

    def metadata(self, digests: dict) -> dict:
        return {}

    def open(self, job: LoadJob, model) -> Opened:
        """This rank's model and optimizer state, resharded in memory when the checkpoint's
        TP/PP/VP layout differs from this run's."""
        meta, iter_dir, saved, ours = job.meta, job.iter_dir, job.meta["layout"], job.run_layout
        dims = model_dims(model)
        # A stage file holds the layers of every model chunk of its pp rank: the virtual
        # pipeline size decides which layers those are, as much as TP and PP do.
        if (saved["tp"], saved["pp"], saved.get("vp")) == (ours["tp"], ours["pp"], ours["vp"]):
            path = files.model_file(iter_dir, dims.tp_rank, dims.pp_rank, ours["pp"])
            payload = files.load_torch(
                path,
                "model and optimizer of this rank",
                files.expected_record(meta, iter_dir, path),
            )
            common = {k: v for k, v in payload.items() if k not in ("model", "optimizer")}
            return Opened(common, path, (payload["model"], payload["optimizer"]))
        if dist.get_rank() == 0:
            _say_resharding(job)
        full = self.read_full(meta, iter_dir, job.load_optim)
        table = reshard.layout_table(meta, ours["tp"], ours["pp"], ours["vp"])
        model_sd, optim_sd = reshard.shard_for(
            full, table, list(named_parameters(model)), dims.tp_rank, ours["tp"]
        )
        return Opened(full.common, iter_dir, (model_sd, optim_sd))

    def restore(self, job: LoadJob, opened: Opened, model, optimizer) -> None:
        model_sd, optim_sd = opened.state
        load_model_state(model, model_sd, opened.source, optimizer)
        if job.load_optim:
            check_optimizer_kind(job.meta, opened.source, self.optimizer_kind)
            # Name-keyed full state whatever optimizer saved it; ZeRO ranks keep their shard.
            load_checkpoint_optimizer_state(model, optimizer, optim_sd, opened.source)
        return None

    def read_full(
        self, meta: dict, iter_dir: str, with_optim: bool, progress: bool = False
    ) -> FullCheckpoint:
        meta_path = os.path.join(iter_dir, files.METADATA)
        layout, vocab = meta["layout"], meta["model"]["vocab_size"]
        tp, pp = layout["tp"], layout["pp"]
        table = reshard.saved_table(meta)
        parts = [(s, t) for s in range(pp) for t in range(tp)]
        what = f"reading {iter_dir}"
        loaded = {
            (s, t): _load_shard(meta, iter_dir, files.model_file(iter_dir, t, s, pp))
            for s, t in tensor_groups(
                parts, len(parts), what, progress, stage_file_size(iter_dir, pp)
            )
        }
        by_stage = [[loaded[s, t] for t in range(tp)] for s in range(pp)]
        params: dict[str, torch.Tensor] = {}
        optim_state: dict[str, dict] | None = {} if with_optim and meta.get("optimizer") else None
        replicas: dict[str, torch.Tensor] = {}
        for name, info in table.items():
            shards = by_stage[info["stage"]]
            if name not in shards[0]["model"]:
                raise CheckpointError(
                    f"{meta_path} places {name} on pipeline stage "
                    f"{info['stage']} but its file in {iter_dir} does not hold "
                    f"it; the checkpoint is incomplete"
                )
            merged = reshard.merge_one([sh["model"][name] for sh in shards], info, vocab)
            (replicas if info["replica_of"] else params)[name] = merged
            if optim_state is not None and not info["replica_of"]:
                per_rank = [sh["optimizer"]["state"].get(name) for sh in shards]
                if per_rank[0] is not None:
                    optim_state[name] = {
                        k: (
                            reshard.merge_one([r[k] for r in per_rank], info, vocab)
                            if k in ("exp_avg", "exp_avg_sq")
                            else v
                        )
                        for k, v in per_rank[0].items()
                    }
        _check_replicas(replicas, params, table, iter_dir)
        groups = None
        if optim_state is not None:  # union of the stages' groups, in order, without replicas
            groups = copy.deepcopy(by_stage[0][0]["optimizer"]["param_groups"])
            for s in range(1, pp):
                for g, other in zip(groups, by_stage[s][0]["optimizer"]["param_groups"]):
                    g["param_names"] += other["param_names"]
            for g in groups:
                g["param_names"] = [n for n in g["param_names"] if not table[n]["replica_of"]]
        common = {k: v for k, v in by_stage[0][0].items() if k not in ("model", "optimizer")}
        return FullCheckpoint(meta, common, params, optim_state, groups)


def _say_resharding(job: LoadJob) -> None:
    saved, ours = job.meta["layout"], job.run_layout
    vp_flag = f" --target-num-layers-per-virtual-pipeline-stage {ours['vp']}" if ours["vp"] else ""
    log.info(
        "resharding %s on load: TP%d PP%d VP%s -> TP%d PP%d VP%s (to do it once "
        "offline: python -m tools.checkpoint.convert --load-dir %s --save-dir NEW "
        "--target-tensor-parallel-size %d --target-pipeline-parallel-size %d%s)",
        job.iter_dir,
        saved["tp"],
        saved["pp"],
        saved.get("vp"),
        ours["tp"],
        ours["pp"],
        ours["vp"],
        job.checkpoint_dir,
        ours["tp"],
        ours["pp"],
        vp_flag,
    )


def _load_shard(meta: dict, iter_dir: str, path: str) -> dict:
    return files.load_torch(path, "model shard", files.expected_record(meta, iter_dir, path))


def _check_replicas(replicas: dict, params: dict, table: dict, iter_dir: str) -> None:
    """Tied copies equal their table after every step; say so loudly if a checkpoint's don't
    (the first stage's table is the one kept)."""
    for name, copy_ in replicas.items():
        source = table[name]["replica_of"]
        table_value = params.get(source)
        if table_value is None or not torch.equal(table_value, copy_):
            diff = (
                "missing"
                if table_value is None
                else f"max diff {float((table_value - copy_).abs().max()):.3e}"
            )
            log.warning(
                "%s: the last stage's tied embedding copy %s differs from %s (%s); "
                "keeping the first stage's table",
                iter_dir,
                name,
                source,
                diff,
            )
