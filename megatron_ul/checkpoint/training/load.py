"""Load a training checkpoint, on any layout: each rank reads what it needs (resharded in memory
when TP/PP differ, piece by piece for torch_dist), every file checked against its recorded
SHA-256, the model's flags against the checkpoint's; an error on any rank is raised on every
rank, naming it."""

from __future__ import annotations

import logging
import os
from dataclasses import asdict

import torch.distributed as dist

from ...config import ResolvedConfig
from .. import files, storage
from ..files import CheckpointError
from ..state import set_rng_state
from ..storage import dcp_pieces
from ..storage.base import LoadJob, Opened
from . import resume_rules
from .record import Resume, run_layout
from .save import _on_rank0, recover_publishes

log = logging.getLogger("megatron_ul")

# ModelConfig fields that decide parameter shapes or the function the weights compute.
MODEL_FIELDS = {
    "num_layers": "--num-layers",
    "hidden_size": "--hidden-size",
    "num_attention_heads": "--num-attention-heads",
    "num_query_groups": "--num-query-groups",
    "kv_channels": "--kv-channels",
    "ffn_hidden_size": "--ffn-hidden-size",
    "vocab_size": "--vocab-size",
    "swiglu": "--swiglu",
    "add_bias_linear": "--disable-bias-linear",
    "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "position_embedding_type": "--position-embedding-type",
    "normalization": "--normalization",
    "norm_epsilon": "--norm-epsilon",
    "gelu_approximate": "--gelu-approximate",
    "num_experts": "--num-experts",
    "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
    "moe_layer_freq": "--moe-layer-freq",
    "moe_shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
    "moe_router_topk": "--moe-router-topk",
    "moe_router_pre_softmax": "--moe-router-pre-softmax",
}
ROPE_FIELDS = {"rotary_base": "--rotary-base"}  # compared when both use rotary embeddings


def check_model_matches(meta: dict, cfg: ResolvedConfig, path: str) -> None:
    saved, ours = meta["model"], asdict(cfg.model)
    checked = dict(MODEL_FIELDS)
    if saved.get("position_embedding_type") == ours["position_embedding_type"] == "rope":
        checked.update(ROPE_FIELDS)
    diffs = [
        f"{flag}: checkpoint {saved.get(field)!r}, this run {ours[field]!r}"
        for field, flag in checked.items()
        if saved.get(field, ours[field]) != ours[field]
    ]
    if (
        ours["position_embedding_type"] == "learned_absolute"
        and saved.get("max_position_embeddings") != ours["max_position_embeddings"]
    ):
        diffs.append(
            f"--max-position-embeddings: checkpoint "
            f"{saved.get('max_position_embeddings')}, this run "
            f"{ours['max_position_embeddings']}"
        )
    if diffs:
        raise CheckpointError(
            f"{path}: the checkpoint's model differs from this run's flags:\n  "
            + "\n  ".join(diffs)
            + "\nuse the checkpoint's model flags"
        )


last_load_report: list = [None]  # this process's last torch_dist load (tests, benchmarks)


def _load_scheduler(
    cfg: ResolvedConfig, scheduler, optimizer, payload: dict, source: str, optimizer_loaded: bool
) -> None:
    """The LR schedule, and every setting that differs from the checkpoint's refused or
    applied as resume_rules says."""
    c, saved = cfg.checkpoint, payload["opt_param_scheduler"]
    diffs = resume_rules.differences(
        payload.get("args"), saved, asdict(cfg), scheduler.state_dict(), optimizer_loaded
    )
    keep = resume_rules.apply_rules(
        diffs, c.override_opt_param_scheduler, c.use_checkpoint_opt_param_scheduler, source
    )
    scheduler.load_state_dict(
        {"num_steps": saved["num_steps"]} if c.override_opt_param_scheduler else saved
    )
    if optimizer_loaded:
        resume_rules.apply_to_optimizer(dcp_pieces.torch_optimizer(optimizer), cfg.train, keep)


def _load_grad_scaler(grad_scaler, payload: dict, source: str) -> None:
    saved = payload.get("grad_scaler")
    if grad_scaler is None:
        return
    if saved is None:
        log.warning(
            "%s holds no fp16 loss-scaler state (saved without --fp16); the scale "
            "starts from --initial-loss-scale / --loss-scale",
            source,
        )
        return
    grad_scaler.load_state_dict(saved)


def _load_rng(cfg: ResolvedConfig, meta: dict, iter_dir: str) -> None:
    if not meta.get("rng"):
        if dist.get_rank() == 0:
            log.warning(
                "%s has no RNG states (converted or imported); RNG streams start from --seed",
                iter_dir,
            )
    elif meta["layout"] != run_layout(cfg):
        if dist.get_rank() == 0:
            log.warning(
                "layout differs from the checkpoint's: RNG streams start from --seed "
                "(dropout masks will not continue the original run's)"
            )
    else:
        path = files.rng_file(iter_dir, dist.get_rank())
        set_rng_state(
            files.load_torch(
                path, "this rank's RNG states", files.expected_record(meta, iter_dir, path)
            )
        )


def _on_every_rank(step):
    """Collective: run `step` (which does not communicate, or fails on all ranks together) on
    every rank; when it fails on any rank, every rank raises, naming each failed rank and its
    error — so rank 0 reports another rank's missing or corrupt file, not a broken
    connection."""
    result, error = None, None
    local: Exception | None = None
    try:
        result = step()
    except CheckpointError as e:
        error, local = str(e), e
    except Exception as e:
        error, local = f"{type(e).__name__}: {e}", e
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e]
    if not failed:
        return result
    if len(failed) == len(errors) and len({e for _, e in failed}) == 1:
        if isinstance(local, CheckpointError):
            raise local  # one shared file: said once, as raised
        raise CheckpointError(error) from local
    raise CheckpointError(
        f"loading the checkpoint failed on {len(failed)} of {len(errors)} "
        f"ranks:\n" + "\n".join(f"  rank {rank}: {e}" for rank, e in failed)
    )


def _locate(cfg: ResolvedConfig):
    """(iteration, its directory, its checked metadata), or None when there is nothing to
    load."""
    load_dir = cfg.checkpoint.load
    if load_dir is None:
        return None
    iteration = files.read_tracker(load_dir)
    if iteration is None:
        lost = files.lost_tracker_error(load_dir)
        if lost is not None:
            raise lost
        partial = files.unfinished_saves(load_dir)
        log.warning(
            "no complete checkpoint in %s (no %s)%s; training starts from scratch",
            load_dir,
            files.TRACKER,
            f"; unfinished saves: {partial}" if partial else "",
        )
        return None
    iter_dir = files.find_iteration_dir(load_dir, iteration)
    meta = files.read_metadata(iter_dir)
    check_model_matches(meta, cfg, os.path.join(iter_dir, files.METADATA))
    storage.format_of(meta, os.path.join(iter_dir, files.METADATA))  # one this version reads
    return iteration, iter_dir, meta


def load_checkpoint(cfg: ResolvedConfig, model, optimizer, scheduler, grad_scaler=None) -> Resume:
    """Collective: each rank reads what it needs; an error on any rank is raised on every rank
    (_on_every_rank). Returns where training resumes."""
    c = cfg.checkpoint
    # A publish that a kill or a full disk interrupted is finished or rolled back first.
    _on_rank0(lambda: recover_publishes(cfg))
    found = _on_every_rank(lambda: _locate(cfg))
    if found is None:
        return Resume()
    iteration, iter_dir, meta = found
    load_optim = not (c.finetune or c.no_load_optim)
    fmt = storage.format_of(meta, os.path.join(iter_dir, files.METADATA))
    job = LoadJob(meta, iter_dir, run_layout(cfg), load_optim, c.load or "")
    opened = _on_every_rank(lambda: fmt.open(job, model))
    # The model (and optimizer) restored; collective for a format that reads pieces in place.
    report = _on_every_rank(lambda: fmt.restore(job, opened, model, optimizer))
    if report is not None:
        last_load_report[0] = report
    resume = _on_every_rank(
        lambda: _apply(cfg, scheduler, optimizer, grad_scaler, iteration, iter_dir, meta, opened)
    )
    # The fp32 main weights were loaded: round them into a half-precision model (ZeRO-1:
    # and all-gather them, the one collective of a load, so outside the checked steps).
    if optimizer is not None:
        optimizer.copy_main_to_model()
    # Said only now: every rank's load succeeded (_on_every_rank's collective verdict).
    if dist.get_rank() == 0:
        if c.finetune:
            log.info("loaded weights of %s for fine-tuning; starting at iteration 0", iter_dir)
        else:
            log.info("loaded checkpoint %s at iteration %d", iter_dir, iteration)
    return resume


def _apply(
    cfg: ResolvedConfig,
    scheduler,
    optimizer,
    grad_scaler,
    iteration: int,
    iter_dir: str,
    meta: dict,
    opened: Opened,
) -> Resume:
    """Everything a load does after the model (and optimizer) is restored: the schedule, the
    resume rules, the loss scaler, the RNG states, where training resumes."""
    c = cfg.checkpoint
    payload, source = opened.payload, opened.source
    if c.finetune:
        return Resume()
    load_optim = not c.no_load_optim
    if load_optim:
        _load_scheduler(cfg, scheduler, optimizer, payload, source, optimizer is not None)
    elif dist.get_rank() == 0:
        # Megatron-LM's --no-load-optim skips the scheduler too: the iteration continues, the
        # LR schedule starts again at step 0 (warm-up included).
        log.info(
            "--no-load-optim: optimizer and LR schedule start afresh at iteration %d", iteration
        )
    if not load_optim:
        resume_rules.say_run_differences(payload.get("args"), asdict(cfg))
    _load_grad_scaler(grad_scaler, payload, source)
    if not c.no_load_rng:
        _load_rng(cfg, meta, iter_dir)
    return Resume(iteration, payload["consumed_samples"], payload["consumed_valid_samples"])
