"""The rules a configuration must satisfy, checked without changing it or reading any file.

Three kinds, each written once:

* a declared range per numeric field (RANGES below, keyed by ``section.field``; a test keeps
  every int/float field of config.py in the table): checked generically, naming the flag;
* choices: every ``Literal[...]`` field's value must be one of its type's arguments (argparse
  refuses others on the command line; configs built in code are checked here alike);
* rules between fields (divisibility of the layout, schedule order, data flags), one function
  per concern below.

``problems(cfg)`` returns every problem found, so that a user fixes them in one go; the start-up
(training/configure.py) adds the filesystem and data-file checks to the same report.
Where Megatron-LM gives an edge value a meaning, the range admits it and the run behaves as
there: --clip-grad 0 turns clipping off, --eval-interval 0 never evaluates, --eval-iters 0 skips
evaluation, --lr 0 is a constant zero rate.
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import dataclass, fields
from typing import Any, Literal

from .config import (
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    flag_names,
)
from .data.gpt_dataset import parse_data_path, parse_split
from .moe_rules import moe_problems
from .sparsity_config import sparse_attention_problems


@dataclass(frozen=True)
class Range:
    """The values a number may take: low <= x <= high (strict where open); None: unbounded."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def admits(self, x: float) -> bool:
        # written so that NaN is admitted by no range
        above = self.low is None or (x > self.low if self.low_open else x >= self.low)
        below = self.high is None or (x < self.high if self.high_open else x <= self.high)
        return bool(above and below) and math.isfinite(x)

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low}"
        return (
            f"in {'(' if self.low_open else '['}{self.low}, "
            f"{self.high}{')' if self.high_open else ']'}"
        )


def at_least(low: float) -> Range:
    return Range(low)


def above(low: float) -> Range:
    return Range(low, low_open=True)


def fraction() -> Range:
    """[0, 1): dropout probabilities, Adam betas."""
    return Range(0, 1, high_open=True)


RANGES: dict[str, Range] = {
    # model
    "model.num_layers": at_least(1),
    "model.hidden_size": at_least(1),
    "model.num_attention_heads": at_least(1),
    "model.ffn_hidden_size": at_least(1),
    "model.num_query_groups": at_least(1),
    "model.kv_channels": at_least(1),
    "model.seq_length": at_least(1),
    "model.max_position_embeddings": at_least(1),
    "model.vocab_size": at_least(0),  # 0: not given (the tokenizer's)
    "model.make_vocab_size_divisible_by": at_least(1),
    "model.rotary_base": above(0),
    "model.norm_epsilon": above(0),
    "model.attention_dropout": fraction(),
    "model.hidden_dropout": fraction(),
    "model.init_method_std": above(0),
    "model.recompute_num_layers": at_least(1),
    "model.tiled_loss_chunk_size": at_least(1),
    "model.tiled_mlp_chunk_size": at_least(1),
    "model.attention_block_tiles": at_least(1),
    "model.num_experts": at_least(1),
    "model.moe_ffn_hidden_size": at_least(1),
    "model.moe_router_topk": at_least(1),
    "model.moe_layer_freq": at_least(1),
    "model.moe_aux_loss_coeff": at_least(0),
    "model.moe_z_loss_coeff": at_least(0),
    "model.moe_expert_capacity_factor": above(0),
    "model.moe_shared_expert_intermediate_size": at_least(1),
    "model.sparse_block_size": at_least(1),
    "model.sparse_num_local_blocks": at_least(1),
    "model.sparse_num_global_blocks": at_least(1),
    "model.sparse_num_different_global_patterns": at_least(1),
    "model.sparse_num_random_blocks": at_least(0),
    "model.sparse_num_sliding_window_blocks": at_least(1),
    # parallel
    "parallel.tensor_model_parallel_size": at_least(1),
    "parallel.ds_sequence_parallel_size": at_least(1),
    "parallel.context_parallel_size": at_least(1),
    "parallel.pipeline_model_parallel_size": at_least(1),
    "parallel.expert_model_parallel_size": at_least(1),
    "parallel.expert_tensor_parallel_size": at_least(1),
    "parallel.num_layers_per_virtual_pipeline_stage": at_least(1),
    "parallel.distributed_timeout_minutes": above(0),
    "parallel.ddp_bucket_size": at_least(1),
    "parallel.world_size": at_least(1),
    # train
    "train.micro_batch_size": at_least(1),
    "train.global_batch_size": at_least(1),
    "train.train_iters": at_least(1),
    "train.lr": at_least(0),
    "train.min_lr": at_least(0),
    "train.lr_warmup_iters": at_least(0),
    "train.lr_decay_iters": at_least(1),
    "train.weight_decay": at_least(0),
    "train.adam_beta1": fraction(),
    "train.adam_beta2": fraction(),
    "train.adam_eps": at_least(0),
    "train.clip_grad": at_least(0),  # 0: no clipping (Megatron-LM)
    "train.seed": Range(0, 2**32 - 1),  # numpy's RandomState orders the data with it
    "train.loss_scale": above(0),
    "train.initial_loss_scale": above(0),
    "train.min_loss_scale": above(0),
    "train.loss_scale_window": at_least(1),
    "train.hysteresis": at_least(1),
    "train.optimizer_offload_fraction": Range(0, 1),
    "train.gpu_memory_gb": above(0),
    "train.eval_interval": at_least(0),  # 0: never evaluate
    "train.eval_iters": at_least(0),  # 0: skip evaluation (Megatron-LM)
    # checkpoint
    "checkpoint.save_interval": at_least(1),
    "checkpoint.exit_interval": at_least(1),
    "checkpoint.exit_duration_in_mins": above(0),
    "checkpoint.keep_last_n_checkpoints": at_least(1),
    # logging
    "logging.log_interval": at_least(1),
    "logging.peak_tflops": above(0),
}
# Numeric fields that a rule below judges instead of a range (_long_context_errors, _zero_errors).
JUDGED_BY_RULES = {
    "model.window_size",
    "parallel.zero_stage",
    # the block-sparse pattern's index lists (sparsity_config.sparse_attention_problems)
    "model.sparse_local_window_blocks",
    "model.sparse_global_block_indices",
    "model.sparse_global_block_end_indices",
}
# The layout rules divide by these: while one is out of range, those rules would only add noise.
DIVISORS = {
    "parallel.tensor_model_parallel_size",
    "parallel.ds_sequence_parallel_size",
    "parallel.context_parallel_size",
    "parallel.pipeline_model_parallel_size",
    "parallel.num_layers_per_virtual_pipeline_stage",
    "parallel.world_size",
    "model.num_layers",
    "model.hidden_size",
    "model.num_attention_heads",
    "model.num_query_groups",
    "model.kv_channels",
    "model.ffn_hidden_size",
    "model.seq_length",
    "model.attention_block_tiles",
    "model.num_experts",
    "model.moe_router_topk",
    "model.moe_ffn_hidden_size",
    "model.moe_shared_expert_intermediate_size",
    "parallel.expert_model_parallel_size",
    "parallel.expert_tensor_parallel_size",
    "train.micro_batch_size",
    "train.global_batch_size",
}


def validate(cfg: Config) -> Config:
    """Check a resolved configuration without changing it; return it for chaining.

    Raises ConfigError listing every problem found.
    """
    found = problems(cfg)
    if found:
        raise config_error(found)
    return cfg


def config_error(found: list[str]) -> ConfigError:
    """The one report of a configuration's problems."""
    return ConfigError("invalid configuration:\n  " + "\n  ".join(found))


def problems(cfg: Config, given: Config | None = None) -> list[str]:
    """Every problem of a resolved configuration, each naming its flag(s) and a fix.

    given: the configuration before resolve(), whose fields are then judged instead of the
    derived ones (a --seq-length 0 is one problem, not also --max-position-embeddings').
    """
    bad_fields, found = field_problems(given or cfg)
    m, p, t = cfg.model, cfg.parallel, cfg.train
    found += _schedule_errors(t)
    found += _data_errors(cfg.data, m)
    found += _recompute_errors(m)
    found += _long_context_errors(cfg)
    found += sparse_attention_problems(cfg)
    found += _zero_errors(p)
    found += _overlap_errors(p, t)
    found += _loss_scale_errors(t)
    found += _checkpoint_errors(cfg.checkpoint)
    found += _precision_errors(t, p)
    if not bad_fields & DIVISORS:
        found += _layout_errors(cfg)
        found += moe_problems(cfg)
    return found


def _precision_errors(t: TrainConfig, p: ParallelConfig) -> list[str]:
    errors = []
    if t.bf16 and t.fp16:
        errors.append("--bf16 and --fp16 are mutually exclusive; pick one")
    if t.fp32_residual_connection and not (t.bf16 or t.fp16):
        errors.append(
            "--fp32-residual-connection needs --bf16 or --fp16 (without them the "
            "residual stream is fp32 already)"
        )
    if t.optimizer_offload_fraction != 1.0 and not t.optimizer_cpu_offload:
        errors.append("--optimizer-offload-fraction needs --optimizer-cpu-offload")
    if t.optimizer_cpu_offload and p.zero_stage == 3:
        errors.append(
            "--optimizer-cpu-offload with --zero-stage 3 is not provided yet (FSDP2's "
            "CPUOffloadPolicy is not wired in); use --use-distributed-optimizer "
            "(ZeRO-1) or drop --optimizer-cpu-offload"
        )
    return errors


def field_problems(cfg: Config) -> tuple[set[str], list[str]]:
    """(the ``section.field`` keys at fault, their messages) of the per-field checks: each
    Literal field's choices and each numeric field's declared range."""
    keys, found = set(), []
    for section in fields(cfg):
        values = getattr(cfg, section.name)
        hints = typing.get_type_hints(type(values))
        for f in fields(values):
            key, value = f"{section.name}.{f.name}", getattr(values, f.name)
            problem = _choice_problem(hints[f.name], value) or _range_problem(
                RANGES.get(key), value
            )
            if problem:
                keys.add(key)
                found.append(f"{flag_names(f)[0]} {problem}")
    return keys, found


def _choice_problem(annotation: Any, value: Any) -> str | None:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # None = not given
        if value is None:
            return None
        annotation = next(a for a in args if a is not type(None))
        args = typing.get_args(annotation)
    if typing.get_origin(annotation) is not Literal or value in args:
        return None
    return f"must be one of {', '.join(map(str, args))} (got {value!r})"


def _range_problem(allowed: Range | None, value: Any) -> str | None:
    if allowed is None or value is None or isinstance(value, bool):
        return None
    if allowed.admits(value):
        return None
    return f"must be {allowed} (got {value})"


def _layout_errors(cfg: Config) -> list[str]:
    """Every rank of the TP × SP × CP × PP × DP grid needs whole, equal pieces."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tp, sp, cp = p.tensor_model_parallel_size, p.ds_sequence_parallel_size, p.context_parallel_size
    errors = []
    if p.world_size % p.model_parallel_size != 0:
        errors.append(
            f"world size {p.world_size} is not divisible by "
            f"--tensor-model-parallel-size × --ds-sequence-parallel-size × "
            f"--context-parallel-size × --pipeline-model-parallel-size = {tp}×{sp}×"
            f"{cp}×{p.pipeline_model_parallel_size} = {p.model_parallel_size}; "
            f"launch a multiple of {p.model_parallel_size} processes or change the "
            f"parallel sizes"
        )
    dp = max(p.data_parallel_size, 1)
    errors += _attention_errors(m, tp, sp)
    errors += _mlp_errors(m, tp)
    errors += _sequence_errors(m, p, tp, sp)
    errors += _ring_errors(m, p, tp, sp, cp)
    errors += _attention_tile_errors(m, p, tp, sp, cp)
    errors += _batch_errors(t, dp)
    errors += _pipeline_errors(cfg, dp)
    return errors


def _schedule_errors(t: TrainConfig) -> list[str]:
    """Megatron-LM's OptimizerParamScheduler asserts these; here they name the flags."""
    errors = []
    if 0 <= t.lr < t.min_lr:  # a negative --lr is its own problem
        errors.append(
            f"--min-lr {t.min_lr} is above --lr {t.lr}: the decay ends at --min-lr; "
            f"use a --min-lr of at most {t.lr}"
        )
    decay = t.lr_decay_iters if t.lr_decay_iters is not None else t.train_iters
    if t.lr_warmup_iters >= decay >= 1:
        errors.append(
            f"--lr-warmup-iters {t.lr_warmup_iters} must be below --lr-decay-iters "
            f"{decay}{' (default: --train-iters)' if t.lr_decay_iters is None else ''}"
            f": warm-up is part of the decay iterations"
        )
    return errors


def _data_errors(d: DataConfig, m: ModelConfig) -> list[str]:
    errors = []
    if not d.mock_data and not d.data_path:
        errors.append(
            "no training data: pass --data-path PREFIX (with --tokenizer-type ...) or --mock-data"
        )
    if d.mock_data and d.data_path:
        errors.append("--mock-data and --data-path are mutually exclusive")
    if d.mock_data and m.vocab_size < 2:
        errors.append(
            "--mock-data needs --vocab-size N (N >= 2: id N-1 is the end-of-document token)"
        )
    if d.data_path and d.tokenizer_type is None:
        errors.append(
            "--data-path needs --tokenizer-type (and its --tokenizer-model or "
            "--vocab-file/--merge-file)"
        )
    if d.data_path:
        try:
            parse_data_path(d.data_path)
        except ValueError as e:
            errors.append(str(e))
    try:
        parse_split(d.split)
    except ValueError as e:
        errors.append(str(e))
    return errors


def _checkpoint_errors(c: CheckpointConfig) -> list[str]:
    errors = []
    if c.save_interval is not None and c.save is None:
        errors.append("--save-interval needs --save DIR (where to write checkpoints)")
    if c.override_opt_param_scheduler and c.use_checkpoint_opt_param_scheduler:
        errors.append(
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
            "conflict: pass the one that says whose LR schedule wins"
        )
    if c.async_save and c.ckpt_format != "torch_dist":
        errors.append(
            "--async-save needs --ckpt-format torch_dist (the torch format gathers "
            "and writes in one step)"
        )
    return errors


def _batch_errors(t: TrainConfig, dp: int) -> list[str]:
    if t.global_batch_size is not None and t.global_batch_size % (t.micro_batch_size * dp) != 0:
        return [
            f"--global-batch-size {t.global_batch_size} is not divisible by "
            f"--micro-batch-size × data-parallel size = {t.micro_batch_size}×{dp}; "
            f"use a global batch that is a multiple of {t.micro_batch_size * dp}"
        ]
    return []


def _recompute_errors(m: ModelConfig) -> list[str]:
    """Megatron's rules for --recompute-granularity, --recompute-method."""
    errors = []
    if m.recompute_granularity == "full" and m.recompute_method is None:
        errors.append("--recompute-granularity full needs --recompute-method uniform or block")
    if m.recompute_granularity != "full" and m.recompute_method is not None:
        errors.append(
            "--recompute-method is only used with --recompute-granularity full; "
            "drop it or use full granularity"
        )
    return errors


def _long_context_errors(cfg: Config) -> list[str]:
    """Activation offload and the sliding window."""
    m, errors = cfg.model, []
    if m.activation_checkpoint_cpu_offload and m.recompute_granularity != "full":
        errors.append(
            "--activation-checkpoint-cpu-offload moves the inputs that full "
            "recompute keeps to host memory: it needs --recompute-granularity full"
        )
    if m.window_size is not None:
        if len(m.window_size) != 2:
            errors.append(
                f"--window-size takes two numbers, LEFT RIGHT, e.g. 4096 0 (got "
                f"{' '.join(map(str, m.window_size))})"
            )
        elif m.window_size[1] != 0:
            errors.append(
                f"--window-size {m.window_size[0]} {m.window_size[1]}: a causal GPT "
                f"sees no later tokens, RIGHT must be 0"
            )
        elif m.window_size[0] < -1:
            errors.append(
                f"--window-size {m.window_size[0]} 0: LEFT must be >= 0, or -1 for "
                f"an unlimited window"
            )
    return errors


def _overlap_errors(p: ParallelConfig, t: TrainConfig) -> list[str]:
    """Megatron's rules for --overlap-grad-reduce, --overlap-param-gather."""
    errors = []
    if p.overlap_param_gather and p.zero_stage not in (1, 2):
        errors.append(
            "--overlap-param-gather needs --use-distributed-optimizer (ZeRO-1) or "
            "--zero-stage 2; "
            "ZeRO-3 (FSDP2) prefetches its all-gathers by itself"
        )
    if p.overlap_param_gather and not p.overlap_grad_reduce:
        errors.append("--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM)")
    if p.overlap_grad_reduce and t.fp16:
        errors.append(
            "--overlap-grad-reduce with --fp16 is not supported (the loss scaler "
            "unscales gradients before they are reduced); use --bf16 or drop "
            "--overlap-grad-reduce"
        )
    return errors


def _loss_scale_errors(t: TrainConfig) -> list[str]:
    if t.loss_scale is not None and not t.fp16:
        return ["--loss-scale only applies to --fp16; drop it (bf16 and fp32 need no loss scaling)"]
    return []


def _pipeline_errors(cfg: Config, dp: int) -> list[str]:
    """Layers must split evenly into (virtual) pipeline stages: never drop layers silently."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    pp, per_virtual = p.pipeline_model_parallel_size, p.num_layers_per_virtual_pipeline_stage
    errors = []
    if m.num_layers % pp != 0:
        errors.append(
            f"--num-layers {m.num_layers} is not divisible by "
            f"--pipeline-model-parallel-size {pp}: every stage needs the same number "
            f"of layers; use a multiple of {pp} layers or another pipeline size"
        )
    if per_virtual is None:
        return errors
    if pp == 1:
        errors.append(
            "--num-layers-per-virtual-pipeline-stage needs "
            "--pipeline-model-parallel-size > 1; remove it or add pipeline stages"
        )
    elif per_virtual < 1 or m.num_layers % (pp * per_virtual) != 0:
        errors.append(
            f"--num-layers {m.num_layers} is not divisible by "
            f"--pipeline-model-parallel-size × --num-layers-per-virtual-pipeline-stage"
            f" = {pp}×{per_virtual}; choose layers per virtual stage so that "
            f"{pp}·n divides {m.num_layers}"
        )
    elif (
        t.global_batch_size is not None
        and t.micro_batch_size * dp > 0
        and (t.global_batch_size // (t.micro_batch_size * dp)) % pp != 0
    ):
        errors.append(
            f"the interleaved schedule needs the number of micro-batches "
            f"(--global-batch-size / (--micro-batch-size × data-parallel size) = "
            f"{t.global_batch_size // (t.micro_batch_size * dp)}) to be a multiple "
            f"of --pipeline-model-parallel-size {pp}; change --global-batch-size"
        )
    return errors


def _attention_errors(m: ModelConfig, tp: int, sp: int) -> list[str]:
    """TP splits the heads and Ulysses splits them again: every rank needs whole heads."""
    errors = []
    heads, groups = m.num_attention_heads, m.query_groups
    if m.num_query_groups is not None and heads % groups != 0:
        errors.append(
            f"--num-attention-heads {heads} is not divisible by --num-query-groups "
            f"{groups}; choose a number of query groups that divides the heads"
        )
    if heads % (tp * sp) != 0:
        errors.append(
            f"--num-attention-heads {heads} is not divisible by "
            f"--tensor-model-parallel-size × --ds-sequence-parallel-size = {tp}×{sp}: "
            f"Ulysses gives each rank whole heads; pick TP·SP that divides {heads}"
        )
    if groups % tp != 0:
        errors.append(
            f"--num-query-groups {groups} is not divisible by "
            f"--tensor-model-parallel-size {tp}: each TP rank needs whole kv groups; "
            f"use a TP size that divides {groups}"
        )
    if m.kv_channels is None and m.hidden_size % heads != 0:
        errors.append(
            f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads "
            f"{heads}; change one of them or set --kv-channels"
        )
    if m.position_embedding_type == "rope" and m.head_dim % 2 != 0:
        errors.append(f"rope needs an even head dimension (got {m.head_dim})")
    return errors


def _mlp_errors(m: ModelConfig, tp: int) -> list[str]:
    """The MLP's hidden width is split over TP: every rank needs an equal, non-empty slice."""
    if m.ffn_hidden_size is not None:
        flag = f"--ffn-hidden-size {m.ffn_hidden_size}"
        fix = f"use a multiple of {tp}"
    else:
        flag = (
            f"the default FFN width {m.ffn_size} (from --hidden-size {m.hidden_size}"
            f"{' with --swiglu' if m.swiglu else ''})"
        )
        fix = "set --ffn-hidden-size"
    if m.ffn_size < 1:
        return [f"{flag} must be >= 1; {fix}"]
    if m.ffn_size % tp != 0:
        return [
            f"{flag} is not divisible by --tensor-model-parallel-size {tp}: each TP rank "
            f"holds an equal slice of the MLP; {fix}"
        ]
    return []


def _sequence_errors(m: ModelConfig, p: ParallelConfig, tp: int, sp: int) -> list[str]:
    """Every SP rank (and TP rank under Megatron-SP) holds an equal slice of each sequence."""
    errors = []
    seq_divisor = sp * (tp if p.sequence_parallel else 1)
    if m.seq_length % seq_divisor != 0:
        flags = (
            "--ds-sequence-parallel-size × --tensor-model-parallel-size (with --sequence-parallel)"
            if p.sequence_parallel
            else "--ds-sequence-parallel-size"
        )
        errors.append(
            f"--seq-length {m.seq_length} is not divisible by {flags} = {seq_divisor}; "
            f"use a sequence length that is a multiple of {seq_divisor}"
        )
    if (
        m.position_embedding_type == "learned_absolute"
        and m.max_position_embeddings is not None
        and m.max_position_embeddings < m.seq_length
    ):
        errors.append(
            f"--max-position-embeddings {m.max_position_embeddings} is smaller than "
            f"--seq-length {m.seq_length}"
        )
    return errors


def _ring_errors(m: ModelConfig, p: ParallelConfig, tp: int, sp: int, cp: int) -> list[str]:
    """Ring attention (--context-parallel-size R): each ring rank holds two of 2R chunks,
    which its U Ulysses ranks split evenly (and TP again under Megatron-SP)."""
    if cp == 1:
        return []
    errors = []
    divisor = math.lcm(2 * sp * cp, sp * cp * (tp if p.sequence_parallel else 1))
    if m.seq_length % divisor != 0:
        flags = "2 × --ds-sequence-parallel-size × --context-parallel-size"
        if p.sequence_parallel and tp > 1:
            flags += " (and × --tensor-model-parallel-size with --sequence-parallel)"
        errors.append(
            f"--seq-length {m.seq_length} is not divisible by {flags} = {divisor}: "
            f"each ring rank holds two equal chunks of 2·{cp} that its {sp} Ulysses "
            f"ranks split evenly; use a sequence length that is a multiple of {divisor}"
        )
    if m.attention_dropout > 0:
        errors.append(
            f"--attention-dropout {m.attention_dropout} is not supported with "
            f"--context-parallel-size {cp} (ring attention has no dropout); pass "
            f"--attention-dropout 0"
        )
    return errors


def _attention_tile_errors(
    m: ModelConfig, p: ParallelConfig, tp: int, sp: int, cp: int
) -> list[str]:
    """--attention-block-tiles cuts the rank's layer input into equal tiles: under Megatron-SP
    each TP rank cuts its own shard, and tile k of every rank is gathered into one QKV call."""
    tiles = m.attention_block_tiles
    if tiles == 1:
        return []
    errors = []
    shard = sp * cp * (tp if p.sequence_parallel else 1)
    if m.seq_length % shard == 0 and (m.seq_length // shard) % tiles != 0:
        errors.append(
            f"--attention-block-tiles {tiles} does not divide the {m.seq_length // shard} "
            f"tokens of each rank's layer input (--seq-length {m.seq_length} over {shard} "
            f"sequence ranks); pick a number of tiles that divides {m.seq_length // shard}"
        )
    if m.fused_layers:
        errors.append(
            "--attention-block-tiles with --fused-layers is not supported (the tiles' "
            "checkpoints run eagerly); drop one of the two"
        )
    return errors


def _zero_errors(p: ParallelConfig) -> list[str]:
    """--use-distributed-optimizer is ZeRO-1; --zero-stage picks 1, 2 or 3 (FSDP2)."""
    errors = []
    if p.zero_stage not in (0, 1, 2, 3):
        errors.append(
            f"--zero-stage {p.zero_stage} is not available: use 1 (same as "
            f"--use-distributed-optimizer), 2 (gradients sharded too) or 3 (FSDP2)"
        )
    if p.use_distributed_optimizer and p.zero_stage in (2, 3):
        errors.append(
            f"--use-distributed-optimizer (ZeRO-1) and --zero-stage {p.zero_stage} conflict; "
            "pass only one of them"
        )
    return errors
