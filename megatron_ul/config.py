"""Configuration as data: one dataclass per concern and one `validate()` that fails fast.

Every error names the flag(s) involved and a fix, and is raised before any model is built.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Optional


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the flags and a fix."""


@dataclass
class ModelConfig:
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: Optional[int] = None          # default 4h (8h/3 rounded to 64 with SwiGLU)
    num_query_groups: Optional[int] = None         # GQA; None means MHA (= num_attention_heads)
    kv_channels: Optional[int] = None              # per-head dim; default hidden / heads
    seq_length: int = 128
    max_position_embeddings: Optional[int] = None
    vocab_size: int = 1024                         # the tokenizer's real vocabulary
    make_vocab_size_divisible_by: int = 128
    position_embedding_type: str = "learned_absolute"  # or "rope"
    rotary_base: float = 10000.0
    normalization: str = "LayerNorm"               # or "RMSNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    add_bias_linear: bool = True
    untie_embeddings_and_output_weights: bool = False
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    init_method_std: float = 0.02
    use_flash_attn: bool = False
    gelu_approximate: str = "none"                 # "tanh" = GPT-2's gelu_new
    recompute_granularity: Optional[str] = None    # None | "full" | "selective"
    recompute_method: Optional[str] = None         # "uniform" | "block" (with full)
    recompute_num_layers: int = 1
    fused_layers: bool = False                     # torch.compile each transformer layer
    fused_layers_backend: str = "inductor"         # or "aot_eager" (traced, not fused)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.swiglu:  # Megatron: keep the MLP's parameter count close to the 4h GELU MLP
            return int(math.ceil(4 * self.hidden_size * 2 / 3 / 64) * 64)
        return 4 * self.hidden_size

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    ds_sequence_parallel_size: int = 1             # the Ulysses degree (Megatron-DeepSpeed's name)
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False                # Megatron-SP over the TP group
    distributed_backend: Optional[str] = None      # nccl on GPU, gloo on CPU
    world_size: int = 1
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    use_distributed_optimizer: bool = False
    zero_stage: int = 0
    distributed_timeout_minutes: float = 10.0      # every collective fails after this long
    overlap_grad_reduce: bool = False              # reduce gradient buckets during backward
    overlap_param_gather: bool = False             # ZeRO-1: all-gather during the next forward
    ddp_bucket_size: Optional[int] = None          # elements; default max(40M, 1M · dp_sp)

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_model_parallel_size * self.ds_sequence_parallel_size
                                   * self.pipeline_model_parallel_size)


@dataclass
class TrainConfig:
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None        # default micro * DP
    train_iters: int = 10
    lr: float = 1e-3
    min_lr: float = 0.0
    lr_decay_style: str = "cosine"                 # constant | linear | cosine
    lr_warmup_iters: int = 0
    lr_decay_iters: Optional[int] = None           # default train_iters
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    bf16: bool = False
    fp16: bool = False
    loss_scale: Optional[float] = None             # fp16: constant scale; None = dynamic
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    eval_interval: int = 0                         # 0 = no evaluation
    eval_iters: int = 10
    dry_run: bool = False                          # print layout + memory estimate, then exit


@dataclass
class DataConfig:
    mock_data: bool = False
    data_path: list = field(default_factory=list)
    split: str = "969,30,1"
    data_cache_path: Optional[str] = None
    tokenizer_type: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False


@dataclass
class CheckpointConfig:
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_save_optim: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False                         # load weights only; iteration restarts at 0
    exit_interval: Optional[int] = None            # save (with --save) and exit at this iteration
    exit_duration_in_mins: Optional[float] = None  # save and exit after this wall time
    exit_signal_handler: bool = False              # SIGTERM: save at the end of the iteration, exit 0


@dataclass
class LoggingConfig:
    log_interval: int = 1
    tensorboard_dir: Optional[str] = None
    timing_log_level: int = 0                      # 0 iteration time, 1 + phases, 2 + per op
    peak_tflops: Optional[float] = None            # per-GPU peak for MFU; default by GPU name


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def num_micro_batches(self) -> int:
        t, dp = self.train, self.parallel.data_parallel_size
        return t.global_batch_size // (t.micro_batch_size * dp)


def _pipeline_errors(cfg: Config, dp: int) -> list[str]:
    """Layers must split evenly into (virtual) pipeline stages: never drop layers silently."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    pp, per_virtual = p.pipeline_model_parallel_size, p.num_layers_per_virtual_pipeline_stage
    errors = []
    if m.num_layers % pp != 0:
        errors.append(f"--num-layers {m.num_layers} is not divisible by "
                      f"--pipeline-model-parallel-size {pp}: every stage needs the same number "
                      f"of layers; use a multiple of {pp} layers or another pipeline size")
    if per_virtual is None:
        return errors
    if pp == 1:
        errors.append("--num-layers-per-virtual-pipeline-stage needs "
                      "--pipeline-model-parallel-size > 1; remove it or add pipeline stages")
    elif per_virtual < 1 or m.num_layers % (pp * per_virtual) != 0:
        errors.append(f"--num-layers {m.num_layers} is not divisible by "
                      f"--pipeline-model-parallel-size × --num-layers-per-virtual-pipeline-stage"
                      f" = {pp}×{per_virtual}; choose layers per virtual stage so that "
                      f"{pp}·n divides {m.num_layers}")
    elif t.global_batch_size is not None and t.micro_batch_size * dp > 0 and (
            t.global_batch_size // (t.micro_batch_size * dp)) % pp != 0:
        errors.append(f"the interleaved schedule needs the number of micro-batches "
                      f"(--global-batch-size / (--micro-batch-size × data-parallel size) = "
                      f"{t.global_batch_size // (t.micro_batch_size * dp)}) to be a multiple "
                      f"of --pipeline-model-parallel-size {pp}; change --global-batch-size")
    return errors


def validate(cfg: Config) -> Config:
    """Check the whole configuration, fill derived defaults, and return it.

    Raises ConfigError listing every problem found, so a user fixes them in one go.
    """
    errors: list[str] = []
    m, p, t, d = cfg.model, cfg.parallel, cfg.train, cfg.data
    tp, sp, pp, world = (p.tensor_model_parallel_size, p.ds_sequence_parallel_size,
                         p.pipeline_model_parallel_size, p.world_size)

    for name, value in [("--tensor-model-parallel-size", tp), ("--ds-sequence-parallel-size", sp),
                        ("--pipeline-model-parallel-size", pp), ("--num-layers", m.num_layers),
                        ("--hidden-size", m.hidden_size), ("--num-attention-heads",
                                                           m.num_attention_heads),
                        ("--seq-length", m.seq_length), ("--micro-batch-size", t.micro_batch_size),
                        ("--train-iters", t.train_iters), ("--vocab-size", m.vocab_size)]:
        if value < 1:
            errors.append(f"{name} must be >= 1 (got {value})")
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))

    if world % (tp * sp * pp) != 0:
        errors.append(f"world size {world} is not divisible by --tensor-model-parallel-size × "
                      f"--ds-sequence-parallel-size × --pipeline-model-parallel-size = "
                      f"{tp}×{sp}×{pp} = {tp * sp * pp}; launch a multiple of {tp * sp * pp} "
                      f"processes or change the parallel sizes")
    dp = max(world // (tp * sp * pp), 1)

    errors += _attention_errors(m, tp, sp)
    errors += _sequence_errors(m, p, tp, sp)
    errors += _recompute_errors(m)
    errors += _zero_errors(p)
    errors += _overlap_errors(p, t)
    errors += _loss_scale_errors(t)

    # --- batches -----------------------------------------------------------------------------------
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * dp
    if t.global_batch_size % (t.micro_batch_size * dp) != 0:
        errors.append(f"--global-batch-size {t.global_batch_size} is not divisible by "
                      f"--micro-batch-size × data-parallel size = {t.micro_batch_size}×{dp}; "
                      f"use a global batch that is a multiple of {t.micro_batch_size * dp}")
    if t.lr_decay_style not in ("constant", "linear", "cosine"):
        errors.append(f"--lr-decay-style must be constant, linear or cosine "
                      f"(got {t.lr_decay_style!r})")
    if t.lr_decay_iters is None:
        t.lr_decay_iters = t.train_iters
    if cfg.logging.timing_log_level not in (0, 1, 2):
        errors.append(f"--timing-log-level must be 0, 1 or 2 (got {cfg.logging.timing_log_level})")
    if cfg.logging.peak_tflops is not None and cfg.logging.peak_tflops <= 0:
        errors.append(f"--peak-tflops must be > 0 (got {cfg.logging.peak_tflops})")
    if t.bf16 and t.fp16:
        errors.append("--bf16 and --fp16 are mutually exclusive; pick one")

    errors += _pipeline_errors(cfg, dp)
    errors += _checkpoint_errors(cfg)
    if m.fused_layers_backend not in ("inductor", "aot_eager"):
        errors.append(f"--fused-layers-backend must be inductor or aot_eager "
                      f"(got {m.fused_layers_backend!r})")
    if m.gelu_approximate not in ("none", "tanh"):
        errors.append(f"--gelu-approximate must be none or tanh (got {m.gelu_approximate!r})")

    if not d.mock_data and not d.data_path:
        errors.append("no training data: pass --data-path PREFIX (with --tokenizer-type ...) "
                      "or --mock-data")
    if d.mock_data and d.data_path:
        errors.append("--mock-data and --data-path are mutually exclusive")

    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    return cfg


def _attention_errors(m: ModelConfig, tp: int, sp: int) -> list[str]:
    """TP splits the heads and Ulysses splits them again: every rank needs whole heads."""
    errors = []
    heads, groups = m.num_attention_heads, m.query_groups
    if m.num_query_groups is not None and heads % groups != 0:
        errors.append(f"--num-attention-heads {heads} is not divisible by --num-query-groups "
                      f"{groups}; choose a number of query groups that divides the heads")
    if heads % (tp * sp) != 0:
        errors.append(f"--num-attention-heads {heads} is not divisible by "
                      f"--tensor-model-parallel-size × --ds-sequence-parallel-size = {tp}×{sp}: "
                      f"Ulysses gives each rank whole heads; pick TP·SP that divides {heads}")
    if groups % tp != 0:
        errors.append(f"--num-query-groups {groups} is not divisible by "
                      f"--tensor-model-parallel-size {tp}: each TP rank needs whole kv groups; "
                      f"use a TP size that divides {groups}")
    if m.kv_channels is None and m.hidden_size % heads != 0:
        errors.append(f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads "
                      f"{heads}; change one of them or set --kv-channels")
    if m.position_embedding_type == "rope" and m.head_dim % 2 != 0:
        errors.append(f"rope needs an even head dimension (got {m.head_dim})")
    return errors


def _sequence_errors(m: ModelConfig, p: ParallelConfig, tp: int, sp: int) -> list[str]:
    """Every SP rank (and TP rank under Megatron-SP) holds an equal slice of each sequence."""
    errors = []
    seq_divisor = sp * (tp if p.sequence_parallel else 1)
    if m.seq_length % seq_divisor != 0:
        flags = ("--ds-sequence-parallel-size × --tensor-model-parallel-size (with "
                 "--sequence-parallel)" if p.sequence_parallel else "--ds-sequence-parallel-size")
        errors.append(f"--seq-length {m.seq_length} is not divisible by {flags} = {seq_divisor}; "
                      f"use a sequence length that is a multiple of {seq_divisor}")
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    if m.position_embedding_type == "learned_absolute" and m.max_position_embeddings < m.seq_length:
        errors.append(f"--max-position-embeddings {m.max_position_embeddings} is smaller than "
                      f"--seq-length {m.seq_length}")
    if m.position_embedding_type not in ("learned_absolute", "rope"):
        errors.append(f"--position-embedding-type must be learned_absolute or rope "
                      f"(got {m.position_embedding_type!r})")
    if m.normalization not in ("LayerNorm", "RMSNorm"):
        errors.append(f"--normalization must be LayerNorm or RMSNorm (got {m.normalization!r})")
    return errors


def _checkpoint_errors(cfg: Config) -> list[str]:
    c, errors = cfg.checkpoint, []
    for name, value in [("--save-interval", c.save_interval), ("--exit-interval", c.exit_interval),
                        ("--exit-duration-in-mins", c.exit_duration_in_mins)]:
        if value is not None and value <= 0:
            errors.append(f"{name} must be > 0 (got {value})")
    if c.save_interval is not None and c.save is None:
        errors.append("--save-interval needs --save DIR (where to write checkpoints)")
    # --load DIR --save DIR (a requeued Slurm job) may name a directory the first run creates
    if c.load is not None and not os.path.isdir(c.load) and c.load != c.save:
        errors.append(f"--load {c.load}: no such directory; pass the --save directory of an "
                      f"earlier run")
    if c.save is not None and os.path.exists(c.save) and not os.path.isdir(c.save):
        errors.append(f"--save {c.save} exists and is not a directory; choose another path")
    return errors


def _recompute_errors(m: ModelConfig) -> list[str]:
    """Megatron's rules for --recompute-granularity, --recompute-method, --recompute-num-layers."""
    errors = []
    if m.recompute_granularity not in (None, "full", "selective"):
        errors.append(f"--recompute-granularity must be full or selective "
                      f"(got {m.recompute_granularity!r})")
    if m.recompute_method not in (None, "uniform", "block"):
        errors.append(f"--recompute-method must be uniform or block (got {m.recompute_method!r})")
    if m.recompute_granularity == "full" and m.recompute_method is None:
        errors.append("--recompute-granularity full needs --recompute-method uniform or block")
    if m.recompute_granularity != "full" and m.recompute_method is not None:
        errors.append("--recompute-method is only used with --recompute-granularity full; "
                      "drop it or use full granularity")
    if m.recompute_num_layers < 1:
        errors.append(f"--recompute-num-layers must be >= 1 (got {m.recompute_num_layers})")
    return errors


def _zero_errors(p: ParallelConfig) -> list[str]:
    """--use-distributed-optimizer is ZeRO-1; --zero-stage picks 1 or 3 (FSDP2)."""
    errors = []
    if p.zero_stage not in (0, 1, 3):
        errors.append(f"--zero-stage {p.zero_stage} is not available: use 1 (same as "
                      f"--use-distributed-optimizer) or 3 (FSDP2); stage 2 is not provided")
    if p.use_distributed_optimizer and p.zero_stage == 3:
        errors.append("--use-distributed-optimizer (ZeRO-1) and --zero-stage 3 conflict; "
                      "pass only one of them")
    if p.use_distributed_optimizer and p.zero_stage == 0:
        p.zero_stage = 1
    if p.zero_stage == 1:
        p.use_distributed_optimizer = True
    return errors


def _overlap_errors(p: ParallelConfig, t: TrainConfig) -> list[str]:
    """Megatron's rules for --overlap-grad-reduce, --overlap-param-gather, --ddp-bucket-size."""
    errors = []
    if p.ddp_bucket_size is not None and p.ddp_bucket_size < 1:
        errors.append(f"--ddp-bucket-size must be >= 1 element (got {p.ddp_bucket_size})")
    if p.overlap_param_gather and not (p.use_distributed_optimizer or p.zero_stage == 1):
        errors.append("--overlap-param-gather needs --use-distributed-optimizer (ZeRO-1); "
                      "ZeRO-3 (FSDP2) prefetches its all-gathers by itself")
    if p.overlap_param_gather and not p.overlap_grad_reduce:
        errors.append("--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM)")
    if p.overlap_grad_reduce and t.fp16:
        errors.append("--overlap-grad-reduce with --fp16 is not supported (the loss scaler "
                      "unscales gradients before they are reduced); use --bf16 or drop "
                      "--overlap-grad-reduce")
    return errors


def _loss_scale_errors(t: TrainConfig) -> list[str]:
    errors = []
    for flag, value in [("--loss-scale", t.loss_scale), ("--initial-loss-scale",
                                                          t.initial_loss_scale),
                        ("--min-loss-scale", t.min_loss_scale)]:
        if value is not None and value <= 0:
            errors.append(f"{flag} must be > 0 (got {value})")
    if t.loss_scale_window < 1 or t.hysteresis < 1:
        errors.append(f"--loss-scale-window and --hysteresis must be >= 1 "
                      f"(got {t.loss_scale_window}, {t.hysteresis})")
    if t.loss_scale is not None and not t.fp16:
        errors.append("--loss-scale only applies to --fp16; drop it (bf16 and fp32 need no "
                      "loss scaling)")
    return errors
