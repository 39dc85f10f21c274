"""What a resume does with each setting that differs from the checkpoint's: the one table
(SETTINGS) the loader applies and docs/checkpointing.md lists.

Two rules, after Megatron-LM's OptimizerParamScheduler (which also schedules weight decay):
- SCHEDULE: the learning-rate schedule and weight decay. A difference is refused, naming the
  flag and both values, unless --override-opt_param-scheduler (this run's flags win) or
  --use-checkpoint-opt_param-scheduler (the checkpoint's values win) says which; each
  difference then gets one log line saying whose value is used.
- RUN: this run's value is used, with one log line naming the flag, the checkpoint's value and
  what the change does.
Settings that decide parameter shapes are refused by io.check_model_matches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .files import CheckpointError

log = logging.getLogger("megatron_ul")

SCHEDULE = "schedule"
RUN = "run"


@dataclass(frozen=True)
class Setting:
    flag: str
    saved: str  # "scheduler.<key>" (the LR schedule's state) or "<config section>.<field>"
    rule: str
    effect: str  # what using this run's value does


SETTINGS = (
    Setting("--lr", "scheduler.max_lr", SCHEDULE, "the peak learning rate changes"),
    Setting("--min-lr", "scheduler.min_lr", SCHEDULE, "the final learning rate changes"),
    Setting("--lr-warmup-iters", "scheduler.warmup_steps", SCHEDULE, "warm-up length changes"),
    Setting(
        "--lr-decay-iters (default --train-iters)",
        "scheduler.decay_steps",
        SCHEDULE,
        "decay length changes",
    ),
    Setting("--lr-decay-style", "scheduler.decay_style", SCHEDULE, "decay shape changes"),
    Setting(
        "--weight-decay",
        "train.weight_decay",
        SCHEDULE,
        "AdamW decays the weights by the new factor from the next step",
    ),
    Setting("--adam-beta1", "train.adam_beta1", RUN, "Adam's moments continue with the new β1"),
    Setting("--adam-beta2", "train.adam_beta2", RUN, "Adam's moments continue with the new β2"),
    Setting("--adam-eps", "train.adam_eps", RUN, "Adam's updates use the new ε"),
    Setting("--clip-grad", "train.clip_grad", RUN, "gradients are clipped to the new norm"),
    Setting("--train-iters", "train.train_iters", RUN, "training stops at the new count"),
    Setting(
        "--seed",
        "train.seed",
        RUN,
        "the data order from here differs from the original run's (dropout continues the "
        "saved RNG streams)",
    ),
    Setting(
        "--global-batch-size",
        "train.global_batch_size",
        RUN,
        "iterations take the new batch; the data position continues from the samples consumed",
    ),
    Setting(
        "--micro-batch-size",
        "train.micro_batch_size",
        RUN,
        "gradient accumulation changes; the batch's gradient is the same",
    ),
    Setting(
        "--seq-length",
        "model.seq_length",
        RUN,
        "sequences of the new length are drawn from the data position on",
    ),
)

# Held in the optimizer's groups: without its state loaded they are this run's anyway.
OPTIMIZER_FLAGS = frozenset({"--adam-beta1", "--adam-beta2", "--adam-eps", "--weight-decay"})


def _value(where: str, args: dict | None, schedule: dict):
    section, key = where.split(".", 1)
    if section == "scheduler":
        return schedule.get(key)
    return (args or {}).get(section, {}).get(key)


def differences(
    saved_args: dict | None,
    saved_schedule: dict,
    our_args: dict,
    our_schedule: dict,
    optimizer_loaded: bool,
) -> list[tuple[Setting, object, object]]:
    """(setting, checkpoint's value, this run's value) for every setting that differs; a
    setting the checkpoint does not record (imported checkpoints hold no arguments) is not
    compared."""
    out = []
    for s in SETTINGS:
        if s.flag in OPTIMIZER_FLAGS and not optimizer_loaded:
            continue
        saved = _value(s.saved, saved_args, saved_schedule)
        ours = _value(s.saved, our_args, our_schedule)
        if saved is not None and saved != ours:
            out.append((s, saved, ours))
    return out


def decide(diffs: list, override: bool, use_checkpoint: bool, source: str) -> bool:
    """Refuse or announce each difference (module docstring). Returns whether the checkpoint's
    schedule and weight decay win (--use-checkpoint-opt_param-scheduler)."""
    schedule = [(s, a, b) for s, a, b in diffs if s.rule == SCHEDULE]
    if schedule and not (override or use_checkpoint):
        raise CheckpointError(
            f"{source}: the checkpoint's learning-rate schedule differs from this run's "
            f"flags:\n  "
            + "\n  ".join(f"{s.flag}: checkpoint {a!r}, this run {b!r}" for s, a, b in schedule)
            + "\npass --override-opt_param-scheduler to use this run's flags, or "
            "--use-checkpoint-opt_param-scheduler to continue the checkpoint's schedule"
        )
    for s, saved, ours in diffs:
        if s.rule == SCHEDULE and use_checkpoint:
            log.info(
                "resume: %s: the checkpoint's %r wins over this run's %r "
                "(--use-checkpoint-opt_param-scheduler)",
                s.flag,
                saved,
                ours,
            )
        else:
            why = " (--override-opt_param-scheduler)" if s.rule == SCHEDULE else ""
            log.info(
                "resume: %s: this run's %r wins over the checkpoint's %r%s: %s",
                s.flag,
                ours,
                saved,
                why,
                s.effect,
            )
    return use_checkpoint


def apply_to_optimizer(inner, train, keep_checkpoint_weight_decay: bool) -> None:
    """Loading the optimizer restored the checkpoint's β, ε and weight decay into its groups;
    put this run's back (the weight decay only if this run's wins). Group 0 is the decayed
    one (optim.build_optimizer)."""
    for group in inner.param_groups:
        group["betas"] = (train.adam_beta1, train.adam_beta2)
        group["eps"] = train.adam_eps
    if not keep_checkpoint_weight_decay:
        inner.param_groups[0]["weight_decay"] = train.weight_decay
