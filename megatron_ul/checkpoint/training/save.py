"""Save training checkpoints: crash-safe, checksummed, exact to the bit on resume, and loadable
on another layout (load.py reshards them), in any storage format (checkpoint/storage).

Save protocol (every step survives a kill -9 of any process at any moment):
 1. rank 0 takes the save directory's lock (files.claim_save_dir), draws a save id and
    broadcasts it; every rank writes (and fsyncs) its files into DIR/iter_N.tmp-<id>: its RNG
    states, and what the --ckpt-format writes (torch: the model and optimizer from the dp0/sp0
    rank of each (tp, pp); torch_dist: every rank its own pieces, in the background with
    --async-save: a PendingSave, completed once every writer finished);
 2. every rank reports its files' sizes and SHA-256 (or its error: then all ranks fail the
    save together); rank 0 writes metadata.json, fsyncs the directories and renames the tmp
    directory into place (an existing iter_N is first renamed aside and deleted only
    afterwards, through a `.del-` rename);
 3. rank 0 points latest_checkpointed_iteration.txt at N (tmp file + os.replace), last, then
    applies the opt-in retention and clean-up.
"""

from __future__ import annotations

import functools
import logging
import os
import uuid
from dataclasses import asdict
from typing import Any

import torch.distributed as dist

from ...config import ResolvedConfig
from ...model.chunks import model_dims
from ...pipeline.param_table import local_parameter_table
from .. import files, storage
from ..files import FORMAT, CheckpointError
from ..state import rng_state
from ..storage.base import SaveJob, Written
from .record import Resume, run_layout

log = logging.getLogger("megatron_ul")


def consumed_valid_samples(cfg: ResolvedConfig, iteration: int) -> int:
    t = cfg.train
    return (
        (iteration // t.eval_interval) * t.eval_iters * t.global_batch_size
        if t.eval_interval
        else 0
    )


def special_token_ids(cfg: ResolvedConfig) -> dict:
    """bos/eos ids of the run's tokenizer, recorded for exports (Hugging Face configs carry
    them). GPT-2's BPE has one end-of-text id for both; SentencePiece its own bos and eos;
    for mock data (whose documents end with the model's last id) Megatron's NullTokenizer
    convention, vocab_size - 1."""
    d = cfg.data
    return _special_token_ids(
        None if d.mock_data else d.tokenizer_type,
        d.vocab_file,
        d.merge_file,
        d.tokenizer_model,
        d.given_vocab_size,
        cfg.model.vocab_size,
    )


@functools.lru_cache(maxsize=4)
def _special_token_ids(
    kind, vocab_file, merge_file, tokenizer_model, given_vocab_size: int, vocab_size: int
) -> dict:
    from ...data.tokenizers import build_tokenizer

    eod = vocab_size - 1
    bos = None
    if kind is not None:
        try:
            tokenizer = build_tokenizer(
                kind,
                vocab_file=vocab_file,
                merge_file=merge_file,
                tokenizer_model=tokenizer_model,
                vocab_size=given_vocab_size or None,
            )
            eod = tokenizer.eod
            processor = getattr(tokenizer, "processor", None)  # SentencePiece
            bos = processor.bos_id() if processor is not None else None
        except (OSError, ValueError, ImportError) as e:
            log.warning("cannot record bos/eos ids: tokenizer %s (%s)", kind, e)
            return {}
    return {"bos_token_id": bos if bos is not None and bos >= 0 else eod, "eos_token_id": eod}


def _on_rank0(action) -> Any:
    """Run `action` on rank 0 and broadcast its result, or re-raise its CheckpointError on
    every rank (so that no rank is left waiting in a collective)."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", action())
        except CheckpointError as e:
            box[0] = ("error", str(e))
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise CheckpointError(value)
    return value


def save_dir_of(cfg: ResolvedConfig) -> str:
    """--save, which every saving path needs (the training loop saves only with it)."""
    if cfg.checkpoint.save is None:
        raise CheckpointError("saving a checkpoint needs --save DIR")
    return cfg.checkpoint.save


def claim_save_dir(cfg: ResolvedConfig) -> None:
    """Collective: rank 0 takes the --save directory's lock (files.claim_save_dir) so that a
    second job saving into it fails at start-up, naming the holder, and refuses a run that
    would save over complete checkpoints there (check_nothing_overwritten)."""

    def claim() -> None:
        files.claim_save_dir(save_dir_of(cfg))
        recover_publishes(cfg)
        check_nothing_overwritten(cfg)

    _on_rank0(claim)


def recover_publishes(cfg: ResolvedConfig) -> None:
    """Rank 0: finish or roll back the publishes a kill or a full disk interrupted in --save
    (whose lock this job holds) and in --load, when no other job holds that one (a publish under
    way there is its own; a read-only --load keeps its tracker, which is consistent). One log
    line per publish."""
    c = cfg.checkpoint
    if c.save is not None and files.interrupted_publishes(c.save):
        files.claim_save_dir(c.save)
        for line in files.recover_publish(c.save):
            log.warning("%s", line)
    if c.load is None or c.load == c.save or not files.interrupted_publishes(c.load):
        return
    held = os.path.realpath(c.load) in files.held_save_dirs()
    try:
        files.claim_save_dir(c.load)
    except CheckpointError as e:
        log.warning("%s: not finishing its interrupted save (%s)", c.load, e)
        return
    try:
        for line in files.recover_publish(c.load):
            log.warning("%s", line)
    except CheckpointError as e:
        log.warning("%s", e)
    finally:
        if not held:
            files.release_save_dir(c.load)


def start_iteration(cfg: ResolvedConfig) -> int:
    """The iteration this run starts from: the --load tracker's (0 without --load or with
    --finetune). CheckpointError when the tracker was lost (files.lost_tracker_error)."""
    c = cfg.checkpoint
    if c.load is None or not os.path.isdir(c.load):
        return 0
    iteration = files.read_tracker(c.load)
    if iteration is None:
        lost = files.lost_tracker_error(c.load)
        if lost is not None:
            raise lost
    if iteration is not None:
        files.find_iteration_dir(c.load, iteration)  # the tracker names one that exists
    return 0 if c.finetune or iteration is None else iteration


def check_nothing_overwritten(cfg: ResolvedConfig) -> None:
    """Refuse, before any work, a run whose saves would land on complete checkpoints in
    --save: those after its start iteration (a run from scratch: all of them), unless
    --overwrite-checkpoints."""
    c = cfg.checkpoint
    start = start_iteration(cfg)
    save_dir = save_dir_of(cfg)
    later = [i for i in files.complete_iterations(save_dir) if i > start or start == 0]
    if later and not c.overwrite_checkpoints:
        names = ", ".join(files.iteration_dir_name(i) for i in later[:4])
        more = " …" if len(later) > 4 else ""
        resumes_here = start and c.load is not None and os.path.samefile(c.load, save_dir)
        if resumes_here:  # an interrupted save was recovered by now: set back on purpose
            tracker = os.path.join(save_dir, files.TRACKER)
            raise CheckpointError(
                f"{tracker} names iteration {start}, but --save {save_dir} holds newer "
                f"complete checkpoints this run would save over: {names}{more} (no "
                f"interrupted save left them: was the tracker set back by hand?); to resume "
                f"from the newest: echo {later[-1]} > {tracker}; to continue from iteration "
                f"{start} and replace them: --overwrite-checkpoints"
            )
        raise CheckpointError(
            f"--save {save_dir} holds complete checkpoints this run (starting at iteration "
            f"{start}) would save over: {names}{more}; resume with --load {save_dir}, "
            f"choose another --save, or pass --overwrite-checkpoints"
        )


def _begin_save(save_dir: str, iteration: int, overwrite: bool) -> str:
    """Rank 0: the directory's lock, the check that no complete checkpoint of `iteration`
    would be replaced (unless `overwrite`), then a fresh save id."""
    files.claim_save_dir(save_dir)
    final = os.path.join(save_dir, files.iteration_dir_name(iteration))
    if not overwrite and files.is_complete(final):
        raise CheckpointError(
            f"{final}: a complete checkpoint of iteration {iteration} is "
            f"already there; not replaced (pass --overwrite-checkpoints to "
            f"replace it)"
        )
    return uuid.uuid4().hex[:12]


def _write_files(
    cfg: ResolvedConfig,
    model,
    optimizer,
    scheduler,
    iteration: int,
    tmp: str,
    grad_scaler,
    position: Resume,
    background: bool,
) -> Written:
    """This rank's files in `tmp`: its RNG states, and what the storage format writes of the
    model, the optimizer and the common state. A local error is returned, not raised: every
    rank still takes part in the format's collectives and in the agreement after them."""
    rng_records, rng_error = {}, None
    try:
        path = files.rng_file(tmp, dist.get_rank())
        rng_records[os.path.relpath(path, tmp)] = files.save_torch(rng_state(), path)
    except CheckpointError as e:
        rng_error = str(e)
    job = SaveJob(
        model,
        optimizer,
        not cfg.checkpoint.no_save_optim and optimizer is not None,
        tmp,
        _common_payload(cfg, scheduler, iteration, grad_scaler, position),
        background,
    )
    written = storage.storage_format(cfg.checkpoint.ckpt_format).write(job)
    written.records = {**rng_records, **written.records}
    written.error = rng_error or written.error
    return written


def _agree(model, iteration: int, records: dict, digests: dict, error: str | None):
    """Collective, after every rank has written its files: (the parameter table, every
    rank's file records, every rank's piece digests); an error on any rank fails the save on
    every rank. Each pipeline stage knows its own parameters; rank 0 records them all."""
    dims = model_dims(model)
    mine = (
        local_parameter_table(model, dims.tp, dims.pp_rank)
        if dims.expert_dp_rank == 0 and dims.tp_rank == 0  # each EP rank: its own experts
        else {}
    )
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, records, digests, error))
    errors = [e for _, _, _, e in gathered if e]
    if errors:
        raise CheckpointError(
            f"saving iteration {iteration} failed (the previous checkpoint "
            f"is untouched):\n  " + "\n  ".join(errors[:4])
        )
    return (
        {name: info for part, _, _, _ in gathered for name, info in part.items()},
        {rel: record for _, part, _, _ in gathered for rel, record in part.items()},
        {
            rel: {str(o): sha for o, sha in d.items()}
            for _, _, part, _ in gathered
            for rel, d in part.items()
        },
    )


def _common_payload(cfg, scheduler, iteration, grad_scaler, position) -> dict:
    """What every format stores once besides the tensors."""
    return {
        "iteration": iteration,
        "checkpoint_version": 3.0,
        "grad_scaler": grad_scaler.state_dict() if grad_scaler is not None else None,
        "opt_param_scheduler": scheduler.state_dict(),
        "consumed_samples": position.consumed_samples,
        "consumed_valid_samples": position.consumed_valid_samples,
        "args": asdict(cfg),
    }


def _publish(save_dir: str, tmp: str, final: str, save_id: str, iteration: int) -> None:
    """Rank 0: make the complete tmp directory the iteration, then move the tracker. The
    intent (files.write_intent) is on disk before the first rename, so that the next start
    finishes or rolls back a publish that a kill or a full disk stopped at any step; an error
    before the tmp directory's rename is rolled back here."""
    intent, aside, renamed = files.intent_path(save_dir, save_id), None, False
    try:
        for root, dirs, _ in os.walk(tmp):
            for d in dirs:
                files.fsync_dir(os.path.join(root, d))
        files.fsync_dir(tmp)
        files.write_intent(save_dir, iteration, save_id)
        if os.path.exists(final):  # replace: move the old copy aside, delete it last
            aside = f"{final}.old-{save_id}"
            os.rename(final, aside)
        os.rename(tmp, final)
        renamed = True
        files.fsync_dir(save_dir)
        # The intent holds the tracker's new contents: renaming it needs no free space.
        os.replace(intent, os.path.join(save_dir, files.TRACKER))
        files.fsync_dir(save_dir)
    except (OSError, CheckpointError) as e:
        if isinstance(e, CheckpointError):
            what = str(e)
        else:
            what = f"{e.filename or save_dir}: {e.strerror or e}"
        if not renamed:
            _roll_back(intent, aside, final)
        raise CheckpointError(
            f"publishing iteration {iteration} failed ({what}); "
            + (
                f"the next start with --save {save_dir} finishes it"
                if renamed
                else "the previous checkpoint is current"
            )
        ) from e
    if aside is not None:
        files.remove_dir(aside, save_id)


def _roll_back(intent: str, aside: str | None, final: str) -> None:
    """Undo a publish stopped before the tmp directory's rename (what is left, the next start
    rolls back)."""
    try:
        if aside is not None and os.path.isdir(aside) and not os.path.exists(final):
            os.rename(aside, final)
        if os.path.exists(intent):
            os.remove(intent)
    except OSError as e:
        log.warning("%s: left for the next start to roll back (%s)", intent, e)


def _tidy(cfg: ResolvedConfig, save_id: str, iteration: int) -> None:
    """Rank 0, after a save completed, holding the lock: opt-in retention and removal of what
    killed saves left behind."""
    c, save_dir = cfg.checkpoint, save_dir_of(cfg)
    if c.remove_unfinished_checkpoints:
        for d in files.stale_temporaries(save_dir):
            log.info("removing %s (left by an interrupted save or cleanup)", d)
            files.rmtree_quietly(d)
    if c.keep_last_n_checkpoints:
        complete = files.complete_iterations(save_dir)
        for old in complete[: -c.keep_last_n_checkpoints]:
            if old != iteration:
                path = os.path.join(save_dir, files.iteration_dir_name(old))
                log.info(
                    "removing %s (--keep-last-n-checkpoints %d)", path, c.keep_last_n_checkpoints
                )
                files.remove_dir(path, save_id)


def save_checkpoint(
    cfg: ResolvedConfig,
    model,
    optimizer,
    scheduler,
    iteration: int,
    grad_scaler=None,
    position: Resume | None = None,
    background: bool = False,
):
    """Collective over all ranks. Returns the iteration directory, or with background=True
    (--async-save; torch_dist only) a PendingSave that completes it once every rank's writer
    has finished. optimizer=None saves the weights only; grad_scaler is the fp16 loss scaler
    (optim/precision.py), if any; `position` the true data position (samples consumed across
    batch-size changes; the training loop keeps it), by default iteration × the current global
    batch."""
    if position is None:
        position = Resume(
            iteration,
            iteration * cfg.train.global_batch_size,
            consumed_valid_samples(cfg, iteration),
        )
    save_dir = save_dir_of(cfg)
    save_id = _on_rank0(
        lambda: _begin_save(save_dir, iteration, cfg.checkpoint.overwrite_checkpoints)
    )
    final = os.path.join(save_dir, files.iteration_dir_name(iteration))
    tmp = f"{final}.tmp-{save_id}"
    pending = PendingSave(cfg, model, optimizer, iteration, tmp, final, save_id)
    written = _write_files(
        cfg, model, optimizer, scheduler, iteration, tmp, grad_scaler, position, background
    )
    pending.records, pending.error, pending.digests = (
        written.records,
        written.error,
        written.digests,
    )
    if written.future is not None:
        pending.future = written.future
        return pending
    pending.complete()
    return final


class PendingSave:
    """A save whose files are (being) written: complete() agrees over all ranks that every
    rank finished, then rank 0 writes metadata.json, renames the directory into place and
    moves the tracker. Until then the previous checkpoint stays current."""

    def __init__(self, cfg, model, optimizer, iteration, tmp, final, save_id):
        self.cfg, self.model, self.optimizer = cfg, model, optimizer
        self.iteration, self.tmp, self.final, self.save_id = iteration, tmp, final, save_id
        self.records: dict = {}
        self.digests: dict = {}
        self.error: str | None = None
        self.future = None  # the background writer's (records, digests)

    def written_everywhere(self, device) -> bool:
        """Collective: has every rank's background writer finished (successfully or not)?"""
        import torch

        done = torch.tensor([float(self.future is None or self.future.done())], device=device)
        if dist.get_world_size() > 1:
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return bool(done.item())

    def complete(self) -> str:
        """Collective: wait for this rank's writer, agree, publish. CheckpointError on every
        rank when any rank failed (the tmp directory is removed, the previous checkpoint
        stays current)."""
        if self.future is not None:
            try:
                records, digests = self.future.result()
                self.records, self.digests = {**self.records, **records}, digests
            except CheckpointError as e:
                self.error = self.error or str(e)
            self.future = None
        try:
            params, records, digests = _agree(
                self.model, self.iteration, self.records, self.digests, self.error
            )
        except CheckpointError:
            if dist.get_rank() == 0:
                files.rmtree_quietly(self.tmp)
            raise
        _on_rank0(
            lambda: _finish_save(
                self.cfg,
                self.model,
                self.optimizer,
                self.iteration,
                self.tmp,
                self.final,
                self.save_id,
                params,
                records,
                digests,
            )
        )
        return self.final


def _finish_save(
    cfg: ResolvedConfig,
    model,
    optimizer,
    iteration: int,
    tmp: str,
    final: str,
    save_id: str,
    params: dict,
    records: dict,
    digests: dict,
) -> None:
    """Rank 0, after every rank has written its files: metadata, publication, tidying."""
    save_dir = save_dir_of(cfg)
    fmt = storage.storage_format(cfg.checkpoint.ckpt_format)
    with_optim = not (cfg.checkpoint.no_save_optim or optimizer is None)
    meta = {
        "format": FORMAT,
        "iteration": iteration,
        "layout": run_layout(cfg),
        "model": asdict(cfg.model),
        "params": params,
        "storage": fmt.name,
        # ZeRO state is stored gathered like plain AdamW's, or in pieces, as the format does;
        # either loads on any layout.
        "optimizer": fmt.optimizer_kind if with_optim else None,
        "zero_stage": cfg.parallel.zero_stage,
        "special_tokens": special_token_ids(cfg),
        "files": records,
        "rng": True,
        "save_id": save_id,  # which save wrote it: the publish intent names the same id
    }
    meta.update(fmt.metadata(digests))
    try:
        files.write_metadata(tmp, meta)
        _publish(save_dir, tmp, final, save_id, iteration)
    except CheckpointError:
        if os.path.isdir(tmp):
            files.rmtree_quietly(tmp)
        raise
    log.info("saved checkpoint at iteration %d to %s", iteration, final)
    _tidy(cfg, save_id, iteration)
