"""The torch_dist storage format (--ckpt-format torch_dist): every rank writes and reads only
its own pieces of the model and Adam moments through torch.distributed.checkpoint
(checkpoint/storage/dcp_pieces.py), whatever layout saved them; rank 0 writes the common state
and the optimizer's hyper-parameters and step to DIR/iter_N/common.pt. Saves may run in the
background (--async-save)."""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future

import torch
import torch.distributed as dist

from .. import files
from ..files import CheckpointError
from ..full import FullCheckpoint
from ..group_progress import tensor_groups
from ..layout import reshard
from . import dcp_pieces
from .base import LoadJob, Opened, SaveJob, Written, check_optimizer_kind

log = logging.getLogger("megatron_ul")


class TorchDist:
    name = "torch_dist"
    optimizer_kind = "sharded"

    def write(self, job: SaveJob) -> Written:
        written = Written()
        try:
            if dist.get_rank() == 0:
                payload = {
                    **job.common,
                    "optimizer": (
                        dcp_pieces.optimizer_common(job.optimizer) if job.save_optim else None
                    ),
                }
                path = os.path.join(job.tmp, files.COMMON_FILE)
                written.records[files.COMMON_FILE] = files.save_torch(payload, path)
        except CheckpointError as e:
            written.error = str(e)
        # Collective (DCP plans globally): every rank takes part even after a local error.
        try:
            outcome = dcp_pieces.save(
                job.model, job.optimizer, job.save_optim, job.tmp, job.background
            )
        except CheckpointError as e:
            written.error = written.error or str(e)
            return written
        if isinstance(outcome, Future):
            written.future = outcome
        else:
            written.records.update(outcome[0])
            written.digests = outcome[1]
        return written

    def metadata(self, digests: dict) -> dict:
        return {"piece_sha256": digests}

    def open(self, job: LoadJob, model) -> Opened:
        path = os.path.join(job.iter_dir, files.COMMON_FILE)
        payload = files.load_torch(
            path, "common state", files.expected_record(job.meta, job.iter_dir, path)
        )
        if job.load_optim:
            check_optimizer_kind(job.meta, path, self.optimizer_kind)
        return Opened(payload, path)

    def restore(self, job: LoadJob, opened: Opened, model, optimizer) -> dcp_pieces.LoadReport:
        """Collective: this rank's pieces of the model (and Adam moments) straight into its
        parameters and optimizer state."""
        # An optimizer that had not stepped yet has no moments to read.
        moments = job.load_optim and opened.payload["optimizer"]["step"] is not None
        report = dcp_pieces.load(
            model,
            optimizer if moments else None,
            moments,
            job.iter_dir,
            dcp_pieces.digests_of(job.meta),
            job.meta["files"].get(dcp_pieces.DCP_METADATA),
        )
        log.debug(
            "rank %d read %d bytes (%d of tensor data; it holds %d)",
            dist.get_rank(),
            report.bytes_read,
            report.tensor_bytes_read,
            report.tensor_bytes_needed,
        )
        if job.load_optim:
            dcp_pieces.restore_optimizer_common(
                optimizer, opened.payload["optimizer"], opened.source
            )
        return report

    def read_full(
        self, meta: dict, iter_dir: str, with_optim: bool, progress: bool = False
    ) -> FullCheckpoint:
        """One whole tensor at a time (dcp_pieces.read_tensor)."""
        path = os.path.join(iter_dir, files.COMMON_FILE)
        common = files.load_torch(path, "common state", files.expected_record(meta, iter_dir, path))
        saved_optim = common.pop("optimizer", None)
        vocab, digests = meta["model"]["vocab_size"], dcp_pieces.digests_of(meta)
        table = {n: info for n, info in reshard.saved_table(meta).items() if not info["replica_of"]}
        index = meta["files"].get(dcp_pieces.DCP_METADATA)

        def full(key: str, info: dict):
            t = dcp_pieces.read_tensor(iter_dir, key, digests, index)
            return reshard.set_vocab_rows(t, vocab) if info["vocab_padded"] else t

        moments = bool(
            with_optim and meta.get("optimizer") and saved_optim and saved_optim["step"] is not None
        )
        params: dict[str, torch.Tensor] = {}
        state: dict[str, dict] = {}

        # a parameter and its moments are one tensor group
        def nbytes(item) -> int:
            name = item[0]
            return params[name].nbytes + sum(t.nbytes for t in state.get(name, {}).values())

        read = tensor_groups(table.items(), len(table), f"reading {iter_dir}", progress, nbytes)
        for name, info in read:
            params[name] = full(f"model/{name}", info)
            if moments:
                state[name] = {
                    "step": saved_optim["step"].clone(),
                    **{k: full(f"optim/{name}/{k}", info) for k in dcp_pieces.MOMENTS},
                }
        if not moments:
            return FullCheckpoint(meta, common, params, None, None)
        # AdamW's two groups: weight decay for all but the 1-D parameters (optim/__init__.py)
        groups = [
            {
                **hyper,
                "param_names": [
                    n for n, info in table.items() if (len(info["shape"]) == 1) == one_d
                ],
            }
            for hyper, one_d in zip(saved_optim["param_groups"], (False, True))
        ]
        return FullCheckpoint(meta, common, params, state, groups)
