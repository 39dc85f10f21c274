"""When to save and when to stop: --save-interval, --exit-interval, --exit-duration-in-mins and
--exit-signal-handler (SIGTERM, or SIGUSR1 from Slurm's --signal time-limit warning: save at the
end of the current iteration, exit 0)."""

from __future__ import annotations

import logging
import signal
import time

import torch
import torch.distributed as dist

from ..checkpoint.training.record import Resume
from ..checkpoint.training.save import save_checkpoint
from ..config import ResolvedConfig
from ..exit_signals import catch_exit_signals, forget_signal, signal_received

log = logging.getLogger("megatron_ul")

# As in Megatron, --exit-duration-in-mins counts from the program's start (this import), so that
# a duration derived from a Slurm job's time left covers start-up and checkpoint loading too.
PROGRAM_START = time.monotonic()


class RunControl:
    """Called after every iteration; saves checkpoints and decides whether to stop."""

    def __init__(
        self,
        cfg: ResolvedConfig,
        model,
        optimizer,
        scheduler,
        start_iteration: int = 0,
        grad_scaler=None,
        position: Resume | None = None,
    ):
        self.cfg, self.model, self.optimizer, self.scheduler = cfg, model, optimizer, scheduler
        self.grad_scaler = grad_scaler
        self.device = next(model.parameters()).device  # where collectives' tensors must live
        self.iteration = self.last_saved = start_iteration
        # The data position: samples really consumed, whatever global batch earlier runs used.
        self.position = position or Resume(start_iteration)
        self.pending = None  # an --async-save still being written
        self.started = PROGRAM_START
        self._previous_handlers = catch_exit_signals() if cfg.checkpoint.exit_signal_handler else {}

    def _stop_flags(self) -> tuple[bool, bool]:
        """(signal, time limit), agreed over all ranks so that every rank stops together."""
        c = self.cfg.checkpoint
        if not c.exit_signal_handler and c.exit_duration_in_mins is None:
            return False, False
        over_time = (
            c.exit_duration_in_mins is not None
            and time.monotonic() - self.started > c.exit_duration_in_mins * 60
        )
        # On the training device: with NCCL the default group cannot reduce CPU tensors.
        flags = torch.tensor(
            [float(signal_received() is not None), float(over_time)], device=self.device
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0]), bool(flags[1])

    def after_iteration(self, iteration: int) -> bool:
        """Save if due; True when training must stop now."""
        self._advance(iteration)
        if self.pending is not None and self.pending.written_everywhere(self.device):
            self._complete_pending()
        c = self.cfg.checkpoint
        by_signal, by_time = self._stop_flags()
        by_interval = bool(c.exit_interval and iteration % c.exit_interval == 0)
        stop = by_signal or by_time or by_interval
        if c.save and (stop or (c.save_interval and iteration % c.save_interval == 0)):
            self.save()
        if stop:
            reason = (
                (signal_received() or "signal on another rank")
                if by_signal
                else "--exit-duration-in-mins"
                if by_time
                else "--exit-interval"
            )
            log.info("exiting at iteration %d (%s)", iteration, reason)
        return stop

    def _advance(self, iteration: int) -> None:
        t = self.cfg.train
        for done in range(self.iteration + 1, iteration + 1):
            self.position.consumed_samples += t.global_batch_size
            if t.eval_interval and done % t.eval_interval == 0:
                self.position.consumed_valid_samples += t.eval_iters * t.global_batch_size
        self.iteration = self.position.iteration = iteration

    def save(self) -> None:
        """With --async-save the files are written in the background while training goes on;
        the save is completed (metadata, tracker) once every rank's writer has finished, at the
        latest before the next save or at the end of training."""
        self._complete_pending()
        if self.optimizer is not None:  # --overlap-param-gather: the parameters must be complete
            self.optimizer.finish_param_sync()
        saved = save_checkpoint(
            self.cfg,
            self.model,
            self.optimizer,
            self.scheduler,
            self.iteration,
            grad_scaler=self.grad_scaler,
            position=self.position,
            background=self.cfg.checkpoint.async_save,
        )
        self.pending = None if isinstance(saved, str) else saved
        self.last_saved = self.iteration

    def _complete_pending(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.complete()

    def finish(self) -> None:
        """End of training (or exit): save the last iteration unless it was just saved, and
        wait for a background save to complete."""
        if self.cfg.checkpoint.save and self.iteration != self.last_saved:
            self.save()
        self._complete_pending()
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        forget_signal()
