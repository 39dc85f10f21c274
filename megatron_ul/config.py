"""Configuration as data: one dataclass per concern and one `validate()` that fails fast.

Every error names the flag(s) involved and a fix, and is raised before any model is built.
"""
from __future__ import annotations

import math
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

    # --- attention heads: TP splits heads, Ulysses splits them again --------------------------
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

    # --- sequence ------------------------------------------------------------------------------
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

    # --- features not built yet: refuse plainly rather than ignore -------------------------------
    not_yet = [(pp > 1, "--pipeline-model-parallel-size > 1 (pipeline parallelism)"),
               (p.num_layers_per_virtual_pipeline_stage is not None,
                "--num-layers-per-virtual-pipeline-stage (interleaved pipeline)"),
               (p.use_distributed_optimizer, "--use-distributed-optimizer (ZeRO-1)"),
               (p.zero_stage != 0, "--zero-stage (ZeRO)"),
               (t.fp16, "--fp16 (use --bf16, or fp32)"),
               (cfg.checkpoint.save is not None or cfg.checkpoint.load is not None,
                "--save/--load (checkpointing)")]
    for refused, what in not_yet:
        if refused:
            errors.append(f"{what} is not implemented yet in megatron_ul; remove the flag")

    if not d.mock_data and not d.data_path:
        errors.append("no training data: pass --data-path PREFIX (with --tokenizer-type ...) "
                      "or --mock-data")
    if d.mock_data and d.data_path:
        errors.append("--mock-data and --data-path are mutually exclusive")

    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    return cfg
