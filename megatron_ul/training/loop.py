"""The training loop: iterate global batches, step, evaluate, log."""

from __future__ import annotations

import functools
import logging

from ..config import ResolvedConfig
from ..model.chunks import model_dims
from ..model.moe.layer import aux_loss_report
from ..mpu.parallel_state import ParallelDims
from ..optim.precision import build_grad_scaler
from ..timers import NO_TIMERS, Timers
from .metrics import MetricsLogger
from .step import evaluate_loss, train_step

log = logging.getLogger("megatron_ul")


def train(
    cfg: ResolvedConfig,
    model,
    optimizer,
    scheduler,
    train_batches,
    valid_batches=None,
    start_iteration: int = 0,
    after_iteration=None,
    grad_scaler=None,
    timers: Timers = NO_TIMERS,
) -> list[float]:
    """Run to --train-iters; returns the per-iteration global loss (same on every rank).

    after_iteration(iteration) -> bool (checkpointing and exit conditions) stops early on True.
    grad_scaler: the fp16 loss scaler (restored from a checkpoint); built here when None.
    timers: the run's phase timers (the model's all-to-alls report to the same object).
    """
    metrics = MetricsLogger(
        cfg,
        model.padded_vocab_size,
        is_reporting_rank=is_reporting_rank(model_dims(model)),
        timers=timers,
    )
    if cfg.model.num_experts is not None:
        dims = model_dims(model)
        device = next(model.parameters()).device
        metrics.extra_scalars = functools.partial(aux_loss_report, model, cfg.model, dims, device)
    losses = []
    model.train()
    if grad_scaler is None:
        grad_scaler = build_grad_scaler(cfg.train)  # fp16 only
    try:
        for iteration in range(start_iteration + 1, cfg.train.train_iters + 1):
            lr = scheduler.lr
            loss, grad_norm = train_step(
                model,
                optimizer,
                next(train_batches),
                clip_grad=cfg.train.clip_grad,
                iteration=iteration,
                grad_scaler=grad_scaler,
                timers=timers,
            )
            if grad_scaler is None or not grad_scaler.last_step_skipped:
                scheduler.step()  # Megatron does not advance the schedule on a skipped step
            losses.append(loss)
            metrics.iteration(iteration, loss, lr, grad_norm)
            if (
                valid_batches is not None
                and cfg.train.eval_interval
                and iteration % cfg.train.eval_interval == 0
            ):
                metrics.validation(iteration, run_evaluation(cfg, model, valid_batches, iteration))
            if after_iteration is not None and after_iteration(iteration):
                break
    finally:
        # --overlap-param-gather leaves the last all-gathers in flight until the next
        # forward: wait for them before anything else reads the parameters.
        optimizer.finish_param_sync()
        metrics.close()
    return losses


def run_evaluation(cfg: ResolvedConfig, model, valid_batches, iteration: int) -> float:
    losses = [evaluate_loss(model, next(valid_batches)) for _ in range(cfg.train.eval_iters)]
    value = sum(losses) / len(losses)
    if is_reporting_rank(model_dims(model)):
        log.info("validation at iteration %d | lm loss %.6E", iteration, value)
    return value


def is_reporting_rank(dims: ParallelDims) -> bool:
    """Megatron reports from the last pipeline stage's first TP/SP/DP rank."""
    return dims.is_last_stage and dims.tp_rank == 0 and dims.dp_cp_sp_rank == 0
