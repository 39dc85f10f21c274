"""configure (parse, resolve, check flags, paths and data) → initialize → build model, data,
optimizer → train."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from ..checkpoint.files import CheckpointError
from ..checkpoint.training.load import load_checkpoint
from ..checkpoint.training.record import Resume
from ..checkpoint.training.save import claim_save_dir
from ..config import ConfigError, ResolvedConfig
from ..data.gpt_dataset import DataError
from ..exit_signals import catch_exit_signals, release_unless
from ..initialize import initialize_distributed, shutdown
from ..model.gpt import GPTModel, use_half_precision
from ..mpu.parallel_state import ParallelDims
from ..mpu.param_init import deferred, materialize
from ..optim import TrainingOptimizer, build_optimizer
from ..optim.lr_schedule import LRSchedule
from ..optim.mixed_precision import half_dtype
from ..optim.precision import GradScaler, build_grad_scaler
from ..optim.zero3 import shard_model
from ..pipeline.model import PipelineStageModel, build_pipeline_model
from ..timers import NO_TIMERS, Timers
from .attention_check import refuse_unrunnable_attention
from .configure import configure
from .data import build_datasets, eod_token_for, global_batches
from .exit import RunControl
from .loop import is_reporting_rank, train

log = logging.getLogger("megatron_ul")


def build_model(
    cfg: ResolvedConfig, device, dims: ParallelDims, timers: Timers = NO_TIMERS
) -> GPTModel | PipelineStageModel:
    """This rank's model (chunks under pipelining) on the rank grid `dims`. Each rank computes
    only the parameters it holds: its TP slice and pipeline stage and, under ZeRO-3, its dp_cp_sp
    shard (built on the meta device, sharded by FSDP2, then materialised)."""
    half = half_dtype(cfg.train)
    if cfg.parallel.zero_stage == 3:
        with deferred():
            model = _build_unsharded(cfg, device, dims, timers)
        model = materialize(shard_model(model, dims, half), device)
    else:
        model = _build_unsharded(cfg, device, dims, timers)
    if half is not None:
        # ZeRO-3 keeps fp32 shards (FSDP2 casts what it gathers); the others cast here.
        use_half_precision(
            model,
            half,
            fp32_residual=cfg.train.fp32_residual_connection,
            cast_parameters=cfg.parallel.zero_stage != 3,
        )
    return model


def _build_unsharded(
    cfg: ResolvedConfig, device, dims: ParallelDims, timers: Timers
) -> GPTModel | PipelineStageModel:
    if cfg.parallel.pipeline_model_parallel_size > 1:
        return build_pipeline_model(cfg, device, timers, dims=dims)  # this rank's model chunks
    return GPTModel(
        cfg.model,
        seed=cfg.train.seed,
        sequence_parallel=cfg.parallel.sequence_parallel,
        device=device,
        timers=timers,
        dims=dims,
    )


@dataclass
class Trainer:
    cfg: ResolvedConfig
    model: GPTModel | PipelineStageModel
    optimizer: TrainingOptimizer
    scheduler: LRSchedule
    train_batches: Iterator
    valid_batches: Iterator | None
    start_iteration: int = 0
    grad_scaler: GradScaler | None = None  # fp16 only; checkpointed with the model
    timers: Timers = NO_TIMERS  # --timing-log-level; the model holds them too
    resume: Resume | None = None  # data position loaded from the checkpoint

    def train(self) -> list[float]:
        position = replace(self.resume) if self.resume else None
        control = RunControl(
            self.cfg,
            self.model,
            self.optimizer,
            self.scheduler,
            self.start_iteration,
            grad_scaler=self.grad_scaler,
            position=position,
        )
        losses = train(
            self.cfg,
            self.model,
            self.optimizer,
            self.scheduler,
            self.train_batches,
            self.valid_batches,
            self.start_iteration,
            control.after_iteration,
            grad_scaler=self.grad_scaler,
            timers=self.timers,
        )
        control.finish()
        return losses


def setup(cfg: ResolvedConfig) -> Trainer:
    """Initialize distributed state and build everything training needs."""
    # The rank grid is built once here and handed to everything that communicates.
    device, dims = initialize_distributed(cfg)
    refuse_unrunnable_attention(cfg, device)  # before any buffer or model is built
    if cfg.checkpoint.save:
        claim_save_dir(cfg)  # a second job saving into the same directory stops here
    if torch.distributed.get_rank() != 0 and not is_reporting_rank(dims):
        logging.getLogger().setLevel(logging.WARNING)  # one rank tells the story
    timers = Timers(cfg.logging.timing_log_level, device.type, cfg.logging.timing_device_sync)
    model = build_model(cfg, device, dims, timers)
    if torch.distributed.get_rank() == 0:
        n = sum(p.numel() for p in model.parameters())
        log.info("parameters on rank 0: %.2f M (padded vocab %d)", n / 1e6, model.padded_vocab_size)
        m = cfg.model
        log.info(
            "transformer layers: %s",
            f"fused (torch.compile per layer, backend {m.fused_layers_backend})"
            if m.fused_layers
            else "eager (--fused-layers compiles them; off by default: compile time)",
        )
    optimizer = build_optimizer(model, cfg.train, cfg.parallel, dims)
    t = cfg.train
    scheduler = LRSchedule(
        optimizer,
        max_lr=t.lr,
        min_lr=t.min_lr,
        warmup_steps=t.lr_warmup_iters,
        decay_steps=t.lr_decay_iters,
        decay_style=t.lr_decay_style,
    )
    grad_scaler = build_grad_scaler(cfg.train)
    resume = (
        load_checkpoint(cfg, model, optimizer, scheduler, grad_scaler)
        if cfg.checkpoint.load
        else Resume()
    )
    eod = eod_token_for(cfg)
    train_ds, valid_ds, _ = build_datasets(cfg)
    train_batches = global_batches(cfg, dims, train_ds, device, eod, resume.consumed_samples)
    valid_batches = (
        global_batches(cfg, dims, valid_ds, device, eod, resume.consumed_valid_samples)
        if valid_ds is not None
        else None
    )
    return Trainer(
        cfg,
        model,
        optimizer,
        scheduler,
        train_batches,
        valid_batches,
        resume.iteration,
        grad_scaler,
        timers,
        resume,
    )


def main(argv=None) -> int:
    # Every rank logs warnings; progress lines come from the reporting rank (see loop.py).
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    try:
        cfg = configure(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.train.dry_run:
        from .dry_run import dry_run

        return dry_run(cfg)
    # pretrain_gpt.py caught SIGTERM/SIGUSR1 before its imports; a signal during start-up stops
    # training after its first iteration (--exit-signal-handler) or takes its default effect now
    if cfg.checkpoint.exit_signal_handler:
        catch_exit_signals()  # main() may be called without pretrain_gpt.py (tests)
    release_unless(cfg.checkpoint.exit_signal_handler)
    try:
        setup(cfg).train()
    except (CheckpointError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        shutdown()
    return 0
