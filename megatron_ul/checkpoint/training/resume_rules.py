"""What a resume does with each setting that differs from the checkpoint's: the one table
(SETTINGS) the loader applies and docs/checkpointing.md lists.

Two rules, after Megatron-LM's OptimizerParamScheduler (which also schedules weight decay):
- SCHEDULE: the learning-rate schedule and weight decay. A difference is refused, naming the
  flag and both values, unless --override-opt_param-scheduler (this run's flags win) or
  --use-checkpoint-opt_param-scheduler (the checkpoint's values win) says which; each
  difference then gets one log line saying whose value is used.
- RUN: this run's value is used, with one log line naming the flag, the checkpoint's value and
  what the change does.
Settings that decide parameter shapes or the function the weights compute are refused by
load.check_model_matches (load.MODEL_FIELDS). Every other setting is in NEUTRAL, with why a
resume needs no rule for it: tests/checkpoint/test_resume_rules.py fails on a config field in
none of the three.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..files import CheckpointError

log = logging.getLogger("megatron_ul")

SCHEDULE = "schedule"
RUN = "run"


@dataclass(frozen=True)
class Setting:
    flag: str
    saved: str  # "scheduler.<key>" (the LR schedule's state) or "<config section>.<field>"
    rule: str
    effect: str  # what using this run's value does


SETTINGS: tuple[Setting, ...] = (
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

SETTINGS += (
    Setting(
        "--hidden-dropout",
        "model.hidden_dropout",
        RUN,
        "dropout after attention and MLP changes: the losses differ from the original run's",
    ),
    Setting(
        "--attention-dropout",
        "model.attention_dropout",
        RUN,
        "dropout on attention probabilities changes: the losses differ from the original run's",
    ),
    Setting(
        "--window-size",
        "model.window_size",
        RUN,
        "attention sees another window of keys: the losses differ from the original run's",
    ),
    Setting(
        "--make-vocab-size-divisible-by",
        "model.make_vocab_size_divisible_by",
        RUN,
        "the padded vocabulary changes (torch_dist fills new padding rows with zeros; the torch "
        "format refuses other shapes)",
    ),
    Setting(
        "--bf16",
        "train.bf16",
        RUN,
        "forward and backward run in the new precision (the fp32 main weights and Adam state "
        "continue): the losses differ from the original run's",
    ),
    Setting(
        "--fp16",
        "train.fp16",
        RUN,
        "forward and backward run in the new precision, with or without loss scaling: the "
        "losses differ from the original run's",
    ),
    Setting(
        "--fp32-residual-connection",
        "train.fp32_residual_connection",
        RUN,
        "the residual stream's precision changes",
    ),
    Setting("--loss-scale", "train.loss_scale", RUN, "fp16 loss scaling changes"),
    Setting(
        "--initial-loss-scale",
        "train.initial_loss_scale",
        RUN,
        "fp16: used only when the checkpoint holds no loss-scaler state",
    ),
    Setting("--min-loss-scale", "train.min_loss_scale", RUN, "fp16 loss scaling changes"),
    Setting("--loss-scale-window", "train.loss_scale_window", RUN, "fp16 loss scaling changes"),
    Setting("--hysteresis", "train.hysteresis", RUN, "fp16 loss scaling changes"),
    Setting(
        "--reset-position-ids",
        "data.reset_position_ids",
        RUN,
        "position ids of the batches change: the losses differ from the original run's",
    ),
    Setting(
        "--reset-attention-mask",
        "data.reset_attention_mask",
        RUN,
        "attention across documents changes: the losses differ from the original run's",
    ),
    Setting(
        "--eod-mask-loss",
        "data.eod_mask_loss",
        RUN,
        "the loss on end-of-document tokens changes",
    ),
    Setting("--mock-data", "data.mock_data", RUN, "the training data changes from here"),
    Setting("--data-path", "data.data_path", RUN, "the training data changes from here"),
    Setting("--split", "data.split", RUN, "the training data changes from here"),
    Setting("--tokenizer-type", "data.tokenizer_type", RUN, "the tokens change from here"),
    Setting("--vocab-file", "data.vocab_file", RUN, "the tokens may change from here"),
    Setting("--merge-file", "data.merge_file", RUN, "the tokens may change from here"),
    Setting("--tokenizer-model", "data.tokenizer_model", RUN, "the tokens may change from here"),
    Setting(
        "--ckpt-format",
        "checkpoint.ckpt_format",
        RUN,
        "the next saves use the new format (this load read the checkpoint's)",
    ),
)

_SPARSE_EFFECT = (
    "attention sees another block-sparse pattern of keys: the losses differ from the original run's"
)
SETTINGS += tuple(
    Setting("--" + field.replace("_", "-"), f"model.{field}", RUN, _SPARSE_EFFECT)
    for field in (
        "sparse_attention",
        "sparse_block_size",
        "sparse_attention_direction",
        "sparse_different_layout_per_head",
        "sparse_num_local_blocks",
        "sparse_num_global_blocks",
        "sparse_horizontal_global_attention",
        "sparse_num_different_global_patterns",
        "sparse_num_random_blocks",
        "sparse_num_sliding_window_blocks",
        "sparse_local_window_blocks",
        "sparse_global_block_indices",
        "sparse_global_block_end_indices",
    )
)
# MoE settings that leave the weights' shapes and the router's choice alone (the expert count,
# sizes, top-k and softmax order are refused by load.check_model_matches).
SETTINGS += (
    Setting(
        "--moe-expert-capacity-factor",
        "model.moe_expert_capacity_factor",
        RUN,
        "another share of the routed tokens is dropped: the losses differ from the original run's",
    ),
    Setting(
        "--moe-token-drop-policy",
        "model.moe_token_drop_policy",
        RUN,
        "other tokens are dropped at capacity: the losses differ from the original run's",
    ),
    Setting(
        "--moe-pad-expert-input-to-capacity",
        "model.moe_pad_expert_input_to_capacity",
        RUN,
        "expert inputs are padded (or not) to their capacity",
    ),
    Setting(
        "--moe-router-load-balancing-type",
        "model.moe_router_load_balancing_type",
        RUN,
        "the load-balancing loss changes: the router's gradients differ from the original run's",
    ),
    Setting(
        "--moe-aux-loss-coeff",
        "model.moe_aux_loss_coeff",
        RUN,
        "the load-balancing loss is weighted anew: the router's gradients change",
    ),
    Setting(
        "--moe-z-loss-coeff",
        "model.moe_z_loss_coeff",
        RUN,
        "the router z-loss is weighted anew: the router's gradients change",
    ),
)

# The config field behind each row compared on the LR schedule's state.
SCHEDULER_FIELDS = {
    "scheduler.max_lr": "train.lr",
    "scheduler.min_lr": "train.min_lr",
    "scheduler.warmup_steps": "train.lr_warmup_iters",
    "scheduler.decay_steps": "train.lr_decay_iters",
    "scheduler.decay_style": "train.lr_decay_style",
}

_SAME_FUNCTION = "memory and speed only: the same function, up to rounding"
_LAYOUT = (
    "the parallel layout: the load reshards; RNG streams start from --seed on another "
    "layout (logged)"
)
_IO = "where, when and what is saved, loaded or logged"
# Config fields a resume needs no rule for: "<section>.<field>": why.
NEUTRAL = {
    **{
        f"model.{f}": _SAME_FUNCTION
        for f in (
            "use_flash_attn",
            "recompute_granularity",
            "recompute_method",
            "recompute_num_layers",
            "fused_layers",
            "fused_layers_backend",
            "tiled_loss_chunk_size",
            "tiled_mlp_chunk_size",
            "attention_block_tiles",
            "activation_checkpoint_cpu_offload",
            "moe_grouped_gemm",
            "moe_token_dispatcher_type",
        )
    },
    "model.init_method_std": "the initialisation only, which a resume replaces by the weights",
    "model.max_position_embeddings": "refused with learned positions (load.check_model_matches); "
    "unused with RoPE",
    **{
        f"parallel.{f}": _LAYOUT
        for f in (
            "tensor_model_parallel_size",
            "ds_sequence_parallel_size",
            "context_parallel_size",
            "pipeline_model_parallel_size",
            "num_layers_per_virtual_pipeline_stage",
            "sequence_parallel",
            "world_size",
            "use_distributed_optimizer",
            "zero_stage",
            "expert_model_parallel_size",
            "expert_tensor_parallel_size",
        )
    },
    "parallel.distributed_backend": "communication only",
    "parallel.distributed_timeout_minutes": "communication only",
    "parallel.overlap_grad_reduce": _SAME_FUNCTION,
    "parallel.overlap_param_gather": _SAME_FUNCTION,
    "parallel.ddp_bucket_size": _SAME_FUNCTION,
    "train.optimizer_cpu_offload": _SAME_FUNCTION,
    "train.optimizer_offload_fraction": _SAME_FUNCTION,
    "train.eval_interval": "validation only (its data position continues from the samples "
    "consumed)",
    "train.eval_iters": "validation only",
    "train.dry_run": "no training",
    "train.gpu_memory_gb": "--dry-run only",
    "data.data_cache_path": "where index files are cached; their names carry their inputs",
    "data.given_vocab_size": "--vocab-size as given; model.vocab_size is refused",
    **{
        f"checkpoint.{f}": _IO
        for f in (
            "save",
            "load",
            "save_interval",
            "async_save",
            "no_save_optim",
            "no_load_optim",
            "no_load_rng",
            "finetune",
            "exit_interval",
            "exit_duration_in_mins",
            "exit_signal_handler",
            "keep_last_n_checkpoints",
            "remove_unfinished_checkpoints",
            "override_opt_param_scheduler",
            "use_checkpoint_opt_param_scheduler",
            "overwrite_checkpoints",
        )
    },
    **{
        f"logging.{f}": _IO
        for f in (
            "log_interval",
            "tensorboard_dir",
            "timing_log_level",
            "timing_device_sync",
            "peak_tflops",
            "wandb_project",
            "wandb_exp_name",
            "wandb_save_dir",
        )
    },
}

# Held in the optimizer's groups: without its state loaded they are this run's anyway.
OPTIMIZER_FLAGS = frozenset({"--adam-beta1", "--adam-beta2", "--adam-eps", "--weight-decay"})


_ABSENT = object()  # not recorded (imported checkpoints hold no arguments)


def _value(where: str, args: dict | None, schedule: dict):
    section, key = where.split(".", 1)
    if section == "scheduler":
        return schedule.get(key, _ABSENT)
    return ((args or {}).get(section) or {}).get(key, _ABSENT)


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
        if saved is not _ABSENT and ours is not _ABSENT and saved != ours:
            out.append((s, saved, ours))
    return out


def say_run_differences(saved_args: dict | None, our_args: dict) -> None:
    """A resume that does not load the optimizer and schedule (--no-load-optim): the RUN
    rows, said as apply_rules says them (the schedule and optimizer rows start from this run's
    flags anyway)."""
    diffs = [
        d
        for d in differences(saved_args, {}, our_args, {}, optimizer_loaded=False)
        if d[0].rule == RUN
    ]
    apply_rules(diffs, False, False, "")


def apply_rules(diffs: list, override: bool, use_checkpoint: bool, source: str) -> bool:
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
