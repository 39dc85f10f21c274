"""Configuration as data: one dataclass per concern, the single source of the command line.

Every field is a flag of pretrain_gpt.py: its Megatron-LM spelling (``--`` + the field name with
dashes, unless ``flag(names=...)`` says otherwise), its type (``Literal[...]`` for choices), its
default and its help text are written here once; ``arguments.py`` generates the parser from them.
Adding a flag is adding a field (see docs/design.md).

Two separate steps turn parsed flags into a usable Config:
``resolve()`` fills the defaults that depend on other fields (global batch, decay iterations,
position embeddings, ZeRO stage) and ``validate()`` checks, without changing anything, and raises
one ConfigError naming every bad flag and a fix, before any model is built.
"""
from __future__ import annotations

import copy
import math
import os
from dataclasses import MISSING, dataclass, field
from typing import Any, Literal, Optional


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the flags and a fix."""


def flag(default: Any = MISSING, *, help: str, names: tuple[str, ...] = (),
         default_factory: Any = MISSING, enabled_by: Optional[str] = None) -> Any:
    """A config field that is also a command-line flag.

    names: the flag's spellings when they are not ``--field-name`` (Megatron's own names win).
    A bool field is a switch: default False -> the flag sets True; default True -> the flag
    (which then must be named, e.g. --disable-bias-linear) sets False.
    enabled_by: a switch that must accompany this flag and without which the field keeps its
    default (Megatron's --num-query-groups only counts with --group-query-attention).
    """
    meta = {"help": help, "names": tuple(names), "enabled_by": enabled_by}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    num_layers: int = flag(2, help="transformer layers")
    hidden_size: int = flag(64, help="model width h")
    num_attention_heads: int = flag(4, help="query heads")
    ffn_hidden_size: Optional[int] = flag(
        None, help="MLP width; default 4h (8h/3 rounded down to a multiple of 64 with --swiglu, "
                   "as Megatron-LM); must be divisible by TP")
    num_query_groups: Optional[int] = flag(
        None, enabled_by="--group-query-attention",
        help="kv heads for grouped-query attention; default: one per query head (MHA)")
    kv_channels: Optional[int] = flag(None, help="per-head dimension; default hidden / heads")
    seq_length: int = flag(128, help="tokens per sequence")
    max_position_embeddings: Optional[int] = flag(
        None, help="learned position table size; default --seq-length")
    vocab_size: int = flag(0, help="vocabulary size for --mock-data / NullTokenizer; otherwise "
                                   "the tokenizer's (0 = not given)")
    make_vocab_size_divisible_by: int = flag(
        128, help="pad the vocabulary to a multiple of this × TP (padding rows never score)")
    position_embedding_type: Literal["learned_absolute", "rope"] = flag(
        "learned_absolute", help="learned absolute positions (GPT-2) or rotary (Llama)")
    rotary_base: float = flag(10000.0, help="RoPE base θ")
    normalization: Literal["LayerNorm", "RMSNorm"] = flag("LayerNorm", help="norm layer type")
    norm_epsilon: float = flag(1e-5, help="epsilon of every norm")
    swiglu: bool = flag(False, help="SwiGLU MLP (Llama) instead of GELU")
    add_bias_linear: bool = flag(True, names=("--disable-bias-linear",),
                                 help="no biases in the linear layers (Llama)")
    untie_embeddings_and_output_weights: bool = flag(
        False, help="separate output head instead of the transposed input embedding")
    attention_dropout: float = flag(0.1, help="dropout on attention probabilities")
    hidden_dropout: float = flag(0.1, help="dropout after attention and MLP")
    init_method_std: float = flag(0.02, help="std of the normal weight initialisation")
    use_flash_attn: bool = flag(False,
                                help="FlashAttention-2 where it can run (CUDA, --bf16/--fp16, "
                                     "flash-attn installed, no --reset-attention-mask), else "
                                     "torch SDPA; the log says which ran")
    gelu_approximate: Literal["none", "tanh"] = flag(
        "none", help="tanh = GPT-2's gelu_new (for Hugging Face GPT-2 weights)")
    recompute_granularity: Optional[Literal["full", "selective"]] = flag(
        None, help="full: recompute whole layers in backward; selective: core attention")
    recompute_method: Optional[Literal["uniform", "block"]] = flag(
        None, help="uniform: checkpoint chunks of --recompute-num-layers layers; block: "
                   "checkpoint the first --recompute-num-layers layers of each stage")
    recompute_num_layers: int = flag(1, help="layers per recomputed chunk (see "
                                             "--recompute-method)")
    fused_layers: bool = flag(
        False, help="torch.compile each transformer layer (fuses the elementwise work around "
                    "the matmuls); off by default: it costs compile time at every start-up")
    fused_layers_backend: Literal["inductor", "aot_eager"] = flag(
        "inductor", help="torch.compile backend for --fused-layers (aot_eager: traced, not "
                         "fused)")
    # Long sequences (docs/long_context.md); chunk sizes count tokens of this rank's sequence.
    tiled_loss_chunk_size: Optional[int] = flag(
        None, help="compute the output layer and loss over chunks of this many tokens, never "
                   "holding the full logits; backward recomputes one chunk at a time")
    tiled_mlp_chunk_size: Optional[int] = flag(
        None, help="run the MLP over chunks of this many tokens, each recomputed in backward "
                   "(ALST's tiled MLP)")
    activation_checkpoint_cpu_offload: bool = flag(
        False, help="with --recompute-granularity full: keep each checkpointed layer input in "
                    "host memory until backward (ALST's name)")
    window_size: Optional[list[int]] = flag(
        None, help="sliding-window attention LEFT RIGHT: token i sees tokens i-LEFT..i of its "
                   "document (RIGHT must be 0; -1 = unlimited; Megatron-core's window_size)")

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def attention_window(self) -> Optional[int]:
        """Keys a query sees before itself under --window-size (None: unlimited)."""
        if self.window_size is None or self.window_size[0] < 0:
            return None
        return self.window_size[0]

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:  # Megatron-LM's rule: about the 4h GELU MLP's parameter count,
            # rounded DOWN to a multiple of 64 (hidden 4096 -> 10880)
            return int(4 * self.hidden_size * 2 / 3 / 64) * 64
        return 4 * self.hidden_size

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = flag(1, help="tensor-parallel degree TP")
    ds_sequence_parallel_size: int = flag(
        1, help="DeepSpeed-Ulysses sequence-parallel degree SP (Megatron-DeepSpeed's name)")
    context_parallel_size: int = flag(
        1, help="ring-attention degree CP across Ulysses groups (Megatron-LM's name): the "
                "sequence is split over SP × CP ranks")
    pipeline_model_parallel_size: int = flag(1, help="pipeline stages PP")
    num_layers_per_virtual_pipeline_stage: Optional[int] = flag(
        None, help="layers per virtual stage: interleaved 1F1B with several chunks per rank")
    sequence_parallel: bool = flag(
        False, help="Megatron-LM sequence parallelism over the TP group (norms, dropout)")
    distributed_backend: Optional[Literal["nccl", "gloo"]] = flag(
        None, help="default: nccl on GPU, gloo on CPU")
    distributed_timeout_minutes: float = flag(
        10.0, help="every collective fails after this long instead of hanging")
    use_distributed_optimizer: bool = flag(
        False, help="ZeRO-1: shard the optimizer state over DP×SP (same as --zero-stage 1)")
    zero_stage: int = flag(0, help="1: ZeRO-1 (distributed optimizer); 3: ZeRO-3 via FSDP2")
    overlap_grad_reduce: bool = flag(
        False, help="reduce gradients over DP×SP in buckets while backward runs (plain data "
                    "parallelism and ZeRO-1; ZeRO-3/FSDP2 always overlaps)")
    overlap_param_gather: bool = flag(
        False, help="ZeRO-1: all-gather the updated parameters while the next forward runs")
    ddp_bucket_size: Optional[int] = flag(
        None, help="elements per gradient-reduction bucket (default max(40M, 1M·DP×SP))")
    world_size: int = flag(1, help="planned number of processes, for --dry-run outside a "
                                   "launcher (otherwise the launcher's WORLD_SIZE)")

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_model_parallel_size * self.ds_sequence_parallel_size
                                   * self.context_parallel_size
                                   * self.pipeline_model_parallel_size)


@dataclass
class TrainConfig:
    micro_batch_size: int = flag(1, help="sequences per micro-batch per DP rank")
    global_batch_size: Optional[int] = flag(
        None, help="sequences per iteration over all DP ranks; default micro × DP")
    train_iters: int = flag(10, help="iterations to train")
    lr: float = flag(1e-3, help="peak learning rate")
    min_lr: float = flag(0.0, help="learning rate at the end of the decay")
    lr_decay_style: Literal["constant", "linear", "cosine"] = flag(
        "cosine", help="shape of the decay after warm-up")
    lr_warmup_iters: int = flag(0, help="linear warm-up iterations")
    lr_decay_iters: Optional[int] = flag(None, help="iterations to decay over; default "
                                                    "--train-iters")
    weight_decay: float = flag(0.01, help="AdamW weight decay (not on biases and norms)")
    adam_beta1: float = flag(0.9, help="AdamW β1")
    adam_beta2: float = flag(0.999, help="AdamW β2")
    adam_eps: float = flag(1e-8, help="AdamW ε")
    clip_grad: float = flag(1.0, help="clip the global gradient norm to this (0: no clipping)")
    seed: int = flag(1234, help="seed of initialisation, data order and dropout")
    bf16: bool = flag(False, help="bf16 compute with fp32 master weights")
    fp16: bool = flag(False,
                      help="fp16 compute (autocast) with fp32 master weights and loss scaling")
    loss_scale: Optional[float] = flag(None,
                                       help="fp16: constant loss scale; default: dynamic scaling")
    initial_loss_scale: float = flag(2.0 ** 32, help="fp16: first dynamic loss scale")
    min_loss_scale: float = flag(1.0, help="fp16: dynamic loss scale floor")
    loss_scale_window: int = flag(1000, help="fp16: steps without overflow before the scale "
                                             "doubles")
    hysteresis: int = flag(2, help="fp16: overflows tolerated before the scale halves")
    eval_interval: int = flag(0, help="evaluate every this many iterations (0: never)")
    eval_iters: int = flag(10, help="validation batches per evaluation")
    dry_run: bool = flag(False, help="validate, print the resolved layout and a per-GPU memory "
                                     "estimate, exit (with --world-size N for the planned launch)")


@dataclass
class DataConfig:
    mock_data: bool = flag(False, help="random documents ending with EOD (id vocab-size - 1); "
                                       "needs --vocab-size")
    data_path: list[str] = flag(default_factory=list,
                                help="dataset prefixes, or 'weight prefix' pairs to blend")
    split: str = flag("969,30,1", help="train,valid,test weights of each dataset")
    data_cache_path: Optional[str] = flag(
        None, help="where the sample index files are cached (default: index_cache/ beside the "
                   "first --data-path)")
    # The names of megatron_ul/data/tokenizers.py's TOKENIZER_TYPES (a test keeps them equal).
    tokenizer_type: Optional[Literal[
        "GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
        "Llama2Tokenizer", "HuggingFaceTokenizer", "NullTokenizer"]] = flag(
        None, help="tokenizer of the data (docs/data.md)")
    vocab_file: Optional[str] = flag(None, help="GPT2BPETokenizer: vocab.json")
    merge_file: Optional[str] = flag(None, help="GPT2BPETokenizer: merges.txt")
    tokenizer_model: Optional[str] = flag(
        None, help="SentencePiece .model file, or HuggingFaceTokenizer's local tokenizer folder")
    reset_position_ids: bool = flag(False, help="restart position ids after each end-of-document")
    reset_attention_mask: bool = flag(False, help="no attention across end-of-document tokens")
    eod_mask_loss: bool = flag(False, help="no loss on end-of-document tokens")


@dataclass
class CheckpointConfig:
    save: Optional[str] = flag(None, help="directory to save checkpoints in")
    load: Optional[str] = flag(None, help="directory to resume from (may equal --save)")
    save_interval: Optional[int] = flag(None, help="save every this many iterations")
    ckpt_format: Literal["torch", "torch_dist"] = flag(
        "torch", help="torch: one file per (TP, PP) rank, ZeRO state gathered into it; "
                      "torch_dist: torch.distributed.checkpoint, every rank writes and reads "
                      "only its own pieces (any layout loads either)")
    async_save: bool = flag(
        False, help="write torch_dist checkpoints in the background while training continues "
                    "(the tracker moves once every rank has finished)")
    no_save_optim: bool = flag(False, help="do not save optimizer state")
    no_load_optim: bool = flag(False, help="do not load optimizer and LR-scheduler state")
    no_load_rng: bool = flag(False, help="do not load RNG states")
    finetune: bool = flag(False, help="load model weights only and start at iteration 0")
    exit_interval: Optional[int] = flag(
        None, help="exit (saving first with --save) when the iteration is a multiple of this")
    exit_duration_in_mins: Optional[float] = flag(
        None, help="exit (saving first with --save) this many minutes after the program started")
    exit_signal_handler: bool = flag(
        False, help="on SIGTERM or SIGUSR1 (Slurm's --signal time-limit warning), save at the "
                    "end of the current iteration and exit 0")
    keep_last_n_checkpoints: Optional[int] = flag(
        None, help="after each save, delete all but the newest N complete iterations "
                   "(default: keep all)")
    remove_unfinished_checkpoints: bool = flag(
        False, help="after each save, delete what interrupted saves and cleanups left "
                    "(iter_*.tmp-*, .old-*, .del-*); the job holds the directory's lock")
    override_opt_param_scheduler: bool = flag(
        False, names=("--override-opt_param-scheduler", "--override-opt-param-scheduler"),
        help="on resume, use this run's --lr/--min-lr/warmup/decay flags instead of the "
             "checkpoint's LR schedule")
    use_checkpoint_opt_param_scheduler: bool = flag(
        False, names=("--use-checkpoint-opt_param-scheduler",
                      "--use-checkpoint-opt-param-scheduler"),
        help="on resume, continue the checkpoint's LR schedule whatever this run's "
             "--lr/--min-lr/warmup/decay flags say")
    overwrite_checkpoints: bool = flag(
        False, help="let this run save over complete checkpoints already in --save (one of the "
                    "same iteration, or any after the iteration it starts from); without it "
                    "such a run stops at start-up")


@dataclass
class LoggingConfig:
    log_interval: int = flag(1, help="report every this many iterations")
    tensorboard_dir: Optional[str] = flag(None, help="write TensorBoard scalars here")
    timing_log_level: Literal[0, 1, 2] = flag(
        0, help="0: iteration time; 1: + forward, backward, all-to-all, gradient reduction, "
                "optimizer; 2: + per-layer-call all-to-all counts")
    peak_tflops: Optional[float] = flag(
        None, help="per-GPU peak TFLOP/s for MFU (default: known GPU names, e.g. A100 312, "
                   "H100/H200 989 bf16 dense)")


def _section(cls, title: str):
    return field(default_factory=cls, metadata={"title": title})


@dataclass
class Config:
    """The whole run; each section is one group of flags in --help."""
    model: ModelConfig = _section(ModelConfig, "model")
    parallel: ParallelConfig = _section(ParallelConfig, "parallelism")
    train: TrainConfig = _section(TrainConfig, "training")
    data: DataConfig = _section(DataConfig, "data")
    checkpoint: CheckpointConfig = _section(CheckpointConfig, "checkpointing")
    logging: LoggingConfig = _section(LoggingConfig, "logging")

    @property
    def num_micro_batches(self) -> int:
        t, dp = self.train, self.parallel.data_parallel_size
        assert t.global_batch_size is not None, "resolve() the config first"
        return t.global_batch_size // (t.micro_batch_size * dp)


def resolve(cfg: Config) -> Config:
    """A copy of cfg with the defaults that depend on other fields filled in.

    Never raises: validate() judges the result (a size below 1 leaves DP at 1 here).
    """
    cfg = copy.deepcopy(cfg)
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * max(p.data_parallel_size, 1) \
            if _model_parallel_size(p) > 0 else t.micro_batch_size
    if t.lr_decay_iters is None:
        t.lr_decay_iters = t.train_iters
    # --use-distributed-optimizer is ZeRO-1 and --zero-stage 1 is the distributed optimizer
    if p.use_distributed_optimizer and p.zero_stage == 0:
        p.zero_stage = 1
    if p.zero_stage == 1:
        p.use_distributed_optimizer = True
    return cfg


def _model_parallel_size(p: ParallelConfig) -> int:
    return p.tensor_model_parallel_size * p.ds_sequence_parallel_size * \
        p.context_parallel_size * p.pipeline_model_parallel_size


def validate(cfg: Config) -> Config:
    """Check a resolved configuration without changing it; return it for chaining.

    Raises ConfigError listing every problem found, so a user fixes them in one go.
    """
    errors = _size_errors(cfg)
    if errors:  # the checks below divide by these sizes
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    m, p, t, d = cfg.model, cfg.parallel, cfg.train, cfg.data
    tp, sp, cp = p.tensor_model_parallel_size, p.ds_sequence_parallel_size, p.context_parallel_size
    if p.world_size % _model_parallel_size(p) != 0:
        errors.append(f"world size {p.world_size} is not divisible by "
                      f"--tensor-model-parallel-size × --ds-sequence-parallel-size × "
                      f"--context-parallel-size × --pipeline-model-parallel-size = {tp}×{sp}×"
                      f"{cp}×{p.pipeline_model_parallel_size} = {_model_parallel_size(p)}; "
                      f"launch a multiple of {_model_parallel_size(p)} processes or change the "
                      f"parallel sizes")
    dp = max(p.data_parallel_size, 1)

    errors += _attention_errors(m, tp, sp)
    errors += _mlp_errors(m, tp)
    errors += _sequence_errors(m, p, tp, sp)
    errors += _ring_errors(m, p, tp, sp, cp)
    errors += _recompute_errors(m)
    errors += _long_context_errors(cfg)
    errors += _zero_errors(p)
    errors += _overlap_errors(p, t)
    errors += _loss_scale_errors(t)
    errors += _batch_errors(t, dp)
    errors += _logging_errors(cfg.logging)
    errors += _pipeline_errors(cfg, dp)
    errors += _checkpoint_errors(cfg)
    errors += _data_errors(d)
    if t.bf16 and t.fp16:
        errors.append("--bf16 and --fp16 are mutually exclusive; pick one")

    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    return cfg


def _size_errors(cfg: Config) -> list[str]:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    sizes = [("--tensor-model-parallel-size", p.tensor_model_parallel_size),
             ("--ds-sequence-parallel-size", p.ds_sequence_parallel_size),
             ("--context-parallel-size", p.context_parallel_size),
             ("--pipeline-model-parallel-size", p.pipeline_model_parallel_size),
             ("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size),
             ("--num-attention-heads", m.num_attention_heads), ("--seq-length", m.seq_length),
             ("--micro-batch-size", t.micro_batch_size), ("--train-iters", t.train_iters),
             ("--vocab-size", m.vocab_size)]
    return [f"{name} must be >= 1 (got {value})" for name, value in sizes if value < 1]


def _batch_errors(t: TrainConfig, dp: int) -> list[str]:
    errors = []
    if t.global_batch_size is not None and t.global_batch_size % (t.micro_batch_size * dp) != 0:
        errors.append(f"--global-batch-size {t.global_batch_size} is not divisible by "
                      f"--micro-batch-size × data-parallel size = {t.micro_batch_size}×{dp}; "
                      f"use a global batch that is a multiple of {t.micro_batch_size * dp}")
    if t.lr_decay_style not in ("constant", "linear", "cosine"):
        errors.append(f"--lr-decay-style must be constant, linear or cosine "
                      f"(got {t.lr_decay_style!r})")
    return errors


def _logging_errors(log: LoggingConfig) -> list[str]:
    errors = []
    if log.timing_log_level not in (0, 1, 2):
        errors.append(f"--timing-log-level must be 0, 1 or 2 (got {log.timing_log_level})")
    if log.peak_tflops is not None and log.peak_tflops <= 0:
        errors.append(f"--peak-tflops must be > 0 (got {log.peak_tflops})")
    return errors


def _data_errors(d: DataConfig) -> list[str]:
    errors = []
    if not d.mock_data and not d.data_path:
        errors.append("no training data: pass --data-path PREFIX (with --tokenizer-type ...) "
                      "or --mock-data")
    if d.mock_data and d.data_path:
        errors.append("--mock-data and --data-path are mutually exclusive")
    return errors


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


def _mlp_errors(m: ModelConfig, tp: int) -> list[str]:
    """The MLP's hidden width is split over TP: every rank needs an equal, non-empty slice."""
    if m.ffn_hidden_size is not None:
        flag = f"--ffn-hidden-size {m.ffn_hidden_size}"
        fix = f"use a multiple of {tp}"
    else:
        flag = (f"the default FFN width {m.ffn_size} (from --hidden-size {m.hidden_size}"
                f"{' with --swiglu' if m.swiglu else ''})")
        fix = "set --ffn-hidden-size"
    if m.ffn_size < 1:
        return [f"{flag} must be >= 1; {fix}"]
    if m.ffn_size % tp != 0:
        return [f"{flag} is not divisible by --tensor-model-parallel-size {tp}: each TP rank "
                f"holds an equal slice of the MLP; {fix}"]
    return []


def _sequence_errors(m: ModelConfig, p: ParallelConfig, tp: int, sp: int) -> list[str]:
    """Every SP rank (and TP rank under Megatron-SP) holds an equal slice of each sequence."""
    errors = []
    seq_divisor = sp * (tp if p.sequence_parallel else 1)
    if m.seq_length % seq_divisor != 0:
        flags = ("--ds-sequence-parallel-size × --tensor-model-parallel-size (with "
                 "--sequence-parallel)" if p.sequence_parallel else "--ds-sequence-parallel-size")
        errors.append(f"--seq-length {m.seq_length} is not divisible by {flags} = {seq_divisor}; "
                      f"use a sequence length that is a multiple of {seq_divisor}")
    if (m.position_embedding_type == "learned_absolute" and m.max_position_embeddings is not None
            and m.max_position_embeddings < m.seq_length):
        errors.append(f"--max-position-embeddings {m.max_position_embeddings} is smaller than "
                      f"--seq-length {m.seq_length}")
    if m.position_embedding_type not in ("learned_absolute", "rope"):
        errors.append(f"--position-embedding-type must be learned_absolute or rope "
                      f"(got {m.position_embedding_type!r})")
    if m.normalization not in ("LayerNorm", "RMSNorm"):
        errors.append(f"--normalization must be LayerNorm or RMSNorm (got {m.normalization!r})")
    if m.gelu_approximate not in ("none", "tanh"):
        errors.append(f"--gelu-approximate must be none or tanh (got {m.gelu_approximate!r})")
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
        errors.append(f"--seq-length {m.seq_length} is not divisible by {flags} = {divisor}: "
                      f"each ring rank holds two equal chunks of 2·{cp} that its {sp} Ulysses "
                      f"ranks split evenly; use a sequence length that is a multiple of {divisor}")
    if m.attention_dropout > 0:
        errors.append(f"--attention-dropout {m.attention_dropout} is not supported with "
                      f"--context-parallel-size {cp} (ring attention has no dropout); pass "
                      f"--attention-dropout 0")
    return errors


def _checkpoint_errors(cfg: Config) -> list[str]:
    c, errors = cfg.checkpoint, []
    for name, value in [("--save-interval", c.save_interval), ("--exit-interval", c.exit_interval),
                        ("--exit-duration-in-mins", c.exit_duration_in_mins),
                        ("--keep-last-n-checkpoints", c.keep_last_n_checkpoints)]:
        if value is not None and value <= 0:
            errors.append(f"{name} must be > 0 (got {value})")
    if c.save_interval is not None and c.save is None:
        errors.append("--save-interval needs --save DIR (where to write checkpoints)")
    # --load DIR --save DIR (a requeued Slurm job) may name a directory the first run creates
    if c.load is not None and not os.path.isdir(c.load) and c.load != c.save:
        errors.append(f"--load {c.load}: no such directory; pass the --save directory of an "
                      f"earlier run")
    if c.override_opt_param_scheduler and c.use_checkpoint_opt_param_scheduler:
        errors.append("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
                      "conflict: pass the one that says whose LR schedule wins")
    if c.async_save and c.ckpt_format != "torch_dist":
        errors.append("--async-save needs --ckpt-format torch_dist (the torch format gathers "
                      "and writes in one step)")
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


def _long_context_errors(cfg: Config) -> list[str]:
    """Tiled loss/MLP chunk sizes, activation offload and the sliding window."""
    m, errors = cfg.model, []
    for name, value in [("--tiled-loss-chunk-size", m.tiled_loss_chunk_size),
                        ("--tiled-mlp-chunk-size", m.tiled_mlp_chunk_size)]:
        if value is not None and value < 1:
            errors.append(f"{name} must be >= 1 token (got {value}); omit it to run untiled")
    if m.activation_checkpoint_cpu_offload:
        if m.recompute_granularity != "full":
            errors.append("--activation-checkpoint-cpu-offload moves the inputs that full "
                          "recompute keeps to host memory: it needs --recompute-granularity full")
    if m.window_size is not None:
        if len(m.window_size) != 2:
            errors.append(f"--window-size takes two numbers, LEFT RIGHT, e.g. 4096 0 (got "
                          f"{' '.join(map(str, m.window_size))})")
        elif m.window_size[1] != 0:
            errors.append(f"--window-size {m.window_size[0]} {m.window_size[1]}: a causal GPT "
                          f"sees no later tokens, RIGHT must be 0")
        elif m.window_size[0] < -1:
            errors.append(f"--window-size {m.window_size[0]} 0: LEFT must be >= 0, or -1 for "
                          f"an unlimited window")
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
    return errors


def _overlap_errors(p: ParallelConfig, t: TrainConfig) -> list[str]:
    """Megatron's rules for --overlap-grad-reduce, --overlap-param-gather, --ddp-bucket-size."""
    errors = []
    if p.ddp_bucket_size is not None and p.ddp_bucket_size < 1:
        errors.append(f"--ddp-bucket-size must be >= 1 element (got {p.ddp_bucket_size})")
    if p.overlap_param_gather and not p.use_distributed_optimizer:
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
