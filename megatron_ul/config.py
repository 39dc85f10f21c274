"""Configuration as data: one dataclass per concern, the single source of the command line.

Every field is a flag of pretrain_gpt.py: its Megatron-LM spelling (``--`` + the field name with
dashes, unless ``flag(names=...)`` says otherwise), its type (``Literal[...]`` for choices), its
default and its help text are written here once; ``arguments.py`` generates the parser from them.
Adding a flag is adding a field (see docs/design.md).

Three separate steps turn parsed flags into a usable config:
``resolve()`` (here) returns a ResolvedConfig, with the defaults that depend on other fields
filled (global batch, decay iterations, position embeddings, ZeRO stage, the model's
vocabulary) and typed as always set; ``config_rules.validate()`` checks, without
changing anything or reading files, each field's declared range and choices and the rules
between fields; ``config_files.path_problems()`` checks the paths the flags name. The start-up
(training/configure.py) gathers all three, and the data files' checks, into one ConfigError
naming every bad flag and a fix, before any model is built.
"""

from __future__ import annotations

import copy
import math
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the flags and a fix."""


def flag(
    default: Any = MISSING,
    *,
    help: str,
    names: tuple[str, ...] = (),
    default_factory: Any = MISSING,
    enabled_by: str | None = None,
) -> Any:
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


def flag_names(f: Field) -> tuple[str, ...]:
    """A field's command-line spellings: ``flag(names=...)``, else ``--field-name``."""
    return f.metadata.get("names") or ("--" + f.name.replace("_", "-"),)


@dataclass
class ModelConfig:
    num_layers: int = flag(2, help="transformer layers")
    hidden_size: int = flag(64, help="model width h")
    num_attention_heads: int = flag(4, help="query heads")
    ffn_hidden_size: int | None = flag(
        None,
        help="MLP width; default 4h (8h/3 rounded down to a multiple of 64 with --swiglu, "
        "as Megatron-LM); must be divisible by TP",
    )
    num_query_groups: int | None = flag(
        None,
        enabled_by="--group-query-attention",
        help="kv heads for grouped-query attention; default: one per query head (MHA)",
    )
    kv_channels: int | None = flag(None, help="per-head dimension; default hidden / heads")
    seq_length: int = flag(128, help="tokens per sequence")
    max_position_embeddings: int | None = flag(
        None, help="learned position table size; default --seq-length"
    )
    # As given here; resolved, the model's vocabulary (data.given_vocab_size keeps the input).
    vocab_size: int = flag(
        0,
        help="vocabulary size for --mock-data / NullTokenizer; otherwise "
        "the tokenizer's (0 = not given)",
    )
    make_vocab_size_divisible_by: int = flag(
        128, help="pad the vocabulary to a multiple of this × TP (padding rows never score)"
    )
    position_embedding_type: Literal["learned_absolute", "rope"] = flag(
        "learned_absolute", help="learned absolute positions (GPT-2) or rotary (Llama)"
    )
    rotary_base: float = flag(10000.0, help="RoPE base θ")
    normalization: Literal["LayerNorm", "RMSNorm"] = flag("LayerNorm", help="norm layer type")
    norm_epsilon: float = flag(1e-5, help="epsilon of every norm")
    swiglu: bool = flag(False, help="SwiGLU MLP (Llama) instead of GELU")
    add_bias_linear: bool = flag(
        True, names=("--disable-bias-linear",), help="no biases in the linear layers (Llama)"
    )
    untie_embeddings_and_output_weights: bool = flag(
        False, help="separate output head instead of the transposed input embedding"
    )
    attention_dropout: float = flag(0.1, help="dropout on attention probabilities")
    hidden_dropout: float = flag(0.1, help="dropout after attention and MLP")
    init_method_std: float = flag(0.02, help="std of the normal weight initialisation")
    use_flash_attn: bool = flag(
        False,
        help="FlashAttention-2 where it can run (CUDA, --bf16/--fp16, "
        "flash-attn installed; documents via its varlen kernel), "
        "else torch SDPA; the log and --dry-run say which runs",
    )
    gelu_approximate: Literal["none", "tanh"] = flag(
        "none", help="tanh = GPT-2's gelu_new (for Hugging Face GPT-2 weights)"
    )
    recompute_granularity: Literal["full", "selective"] | None = flag(
        None, help="full: recompute whole layers in backward; selective: core attention"
    )
    recompute_method: Literal["uniform", "block"] | None = flag(
        None,
        help="uniform: checkpoint chunks of --recompute-num-layers layers; block: "
        "checkpoint the first --recompute-num-layers layers of each stage",
    )
    recompute_num_layers: int = flag(1, help="layers per recomputed chunk (see --recompute-method)")
    fused_layers: bool = flag(
        False,
        help="torch.compile each transformer layer (fuses the elementwise work around "
        "the matmuls); off by default: it costs compile time at every start-up",
    )
    fused_layers_backend: Literal["inductor", "aot_eager"] = flag(
        "inductor", help="torch.compile backend for --fused-layers (aot_eager: traced, not fused)"
    )
    # Long sequences (docs/long_context.md); chunk sizes count tokens of this rank's sequence.
    tiled_loss_chunk_size: int | None = flag(
        None,
        help="compute the output layer and loss over chunks of this many tokens, never "
        "holding the full logits; backward recomputes one chunk at a time",
    )
    tiled_mlp_chunk_size: int | None = flag(
        None,
        help="run the MLP over chunks of this many tokens, each recomputed in backward "
        "(ALST's tiled MLP)",
    )
    attention_block_tiles: int = flag(
        1,
        help="run the attention block's token-wise work (input norm, QKV projection, RoPE, "
        "output projection) over this many tiles of the sequence, each recomputed in "
        "backward, so that only q, k, v and the attention output exist at full length "
        "(ALST's sequence tiling; 1 = off)",
    )
    activation_checkpoint_cpu_offload: bool = flag(
        False,
        help="with --recompute-granularity full: keep each checkpointed layer input in "
        "host memory until backward (ALST's name)",
    )
    window_size: list[int] | None = flag(
        None,
        help="sliding-window attention LEFT RIGHT: token i sees tokens i-LEFT..i of its "
        "document (RIGHT must be 0; -1 = unlimited; Megatron-core's window_size)",
    )
    # Block-sparse attention: DeepSpeed's sparsity configs and parameter names (0.18.9, its
    # last release with them): sparsity_config.py, model/attention/block_sparse*.py. Unset
    # counts: the pattern's DeepSpeed default.
    sparse_attention: Literal["fixed", "bigbird", "bslongformer", "variable"] | None = flag(
        None,
        help="block-sparse attention pattern (DeepSpeed's Fixed, BigBird, BSLongformer, "
        "Variable); causal on top of it; combines with documents and --window-size",
    )
    sparse_block_size: int = flag(16, help="block-sparse attention: tokens per block side")
    sparse_attention_direction: Literal["unidirectional", "bidirectional"] = flag(
        "unidirectional",
        help="DeepSpeed's `attention`: which layout is built (bidirectional adds global "
        "rows and draws random blocks from the whole row); tokens stay causal either way",
    )
    sparse_different_layout_per_head: bool = flag(
        False, help="block-sparse attention: a layout per head (random draws, global patterns)"
    )
    sparse_num_local_blocks: int | None = flag(
        None, help="fixed: blocks per local window (default 4)"
    )
    sparse_num_global_blocks: int | None = flag(
        None, help="fixed: global blocks per local window; bigbird: leading global blocks (1)"
    )
    sparse_horizontal_global_attention: bool = flag(
        False, help="fixed, variable: global blocks also attend to every block (bidirectional)"
    )
    sparse_num_different_global_patterns: int | None = flag(
        None, help="fixed: distinct global-block positions over the heads (default 1)"
    )
    sparse_num_random_blocks: int | None = flag(
        None, help="bigbird (default 1), variable (0): random blocks per block row"
    )
    sparse_num_sliding_window_blocks: int | None = flag(
        None, help="bigbird, bslongformer: blocks of the sliding window (default 3)"
    )
    sparse_local_window_blocks: list[int] | None = flag(
        None, help="variable: sizes of the first local windows, the last repeated (default 4)"
    )
    sparse_global_block_indices: list[int] | None = flag(
        None, help="bslongformer, variable: global blocks (default 0), or range starts"
    )
    sparse_global_block_end_indices: list[int] | None = flag(
        None, help="bslongformer, variable: exclusive ends of the global ranges"
    )
    # Mixture of experts (Megatron-LM's flags and defaults; model/moe/, docs/moe.md).
    num_experts: int | None = flag(None, help="MoE: experts per MoE layer (None: dense MLPs)")
    moe_ffn_hidden_size: int | None = flag(
        None, help="MoE: each expert's hidden size (default --ffn-hidden-size)"
    )
    moe_router_topk: int = flag(2, help="MoE: experts each token is routed to")
    moe_layer_freq: int = flag(
        1, help="MoE: every this many layers is an MoE layer, starting with the first"
    )
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "none"] = flag(
        "aux_loss", help="MoE: load-balancing loss (Switch per micro-batch, or per sequence)"
    )
    moe_aux_loss_coeff: float = flag(0.0, help="MoE: load-balancing loss coefficient")
    moe_z_loss_coeff: float | None = flag(None, help="MoE: router z-loss coefficient")
    moe_router_pre_softmax: bool = flag(
        False, help="MoE: softmax over all experts before top-k (default: over the k chosen)"
    )
    moe_expert_capacity_factor: float | None = flag(
        None, help="MoE: expert capacity as a multiple of an even share; drops the excess"
    )
    moe_token_drop_policy: Literal["probs", "position"] = flag(
        "probs", help="MoE: over capacity, keep the highest-probability or the first tokens"
    )
    moe_pad_expert_input_to_capacity: bool = flag(
        False, help="MoE: pad every expert's input to its capacity (static shapes)"
    )
    moe_shared_expert_intermediate_size: int | None = flag(
        None, help="MoE: hidden size of a shared expert every token goes through"
    )
    moe_grouped_gemm: bool = flag(
        False, help="MoE: torch's grouped GEMM for the local experts (CUDA, bf16)"
    )
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = flag(
        "allgather", help="MoE: how tokens reach the experts over the EP group"
    )

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def attention_window(self) -> int | None:
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

    @property
    def moe_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_size

    def is_moe_layer(self, layer_number: int) -> bool:
        """Layer `layer_number` (1-based) is MoE: every --moe-layer-freq-th from the first."""
        return self.num_experts is not None and (layer_number - 1) % self.moe_layer_freq == 0

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = flag(1, help="tensor-parallel degree TP")
    ds_sequence_parallel_size: int = flag(
        1, help="DeepSpeed-Ulysses sequence-parallel degree SP (Megatron-DeepSpeed's name)"
    )
    context_parallel_size: int = flag(
        1,
        help="ring-attention degree CP across Ulysses groups (Megatron-LM's name): the "
        "sequence is split over SP × CP ranks",
    )
    pipeline_model_parallel_size: int = flag(1, help="pipeline stages PP")
    expert_model_parallel_size: int = flag(
        1, help="MoE: expert-parallel degree EP, carved from DP × CP × SP"
    )
    expert_tensor_parallel_size: int | None = flag(
        None, help="MoE: tensor-parallel degree of each expert (default and only value: TP)"
    )
    num_layers_per_virtual_pipeline_stage: int | None = flag(
        None, help="layers per virtual stage: interleaved 1F1B with several chunks per rank"
    )
    sequence_parallel: bool = flag(
        False, help="Megatron-LM sequence parallelism over the TP group (norms, dropout)"
    )
    distributed_backend: Literal["nccl", "gloo"] | None = flag(
        None, help="default: nccl on GPU, gloo on CPU"
    )
    distributed_timeout_minutes: float = flag(
        10.0, help="every collective fails after this long instead of hanging"
    )
    use_distributed_optimizer: bool = flag(
        False, help="ZeRO-1: shard the optimizer state over DP×SP (same as --zero-stage 1)"
    )
    zero_stage: int = flag(
        0,
        help="1: ZeRO-1 (distributed optimizer); 2: ZeRO-2 (gradients sharded too); "
        "3: ZeRO-3 via FSDP2",
    )
    overlap_grad_reduce: bool = flag(
        False,
        help="reduce gradients over DP×SP in buckets while backward runs (plain data "
        "parallelism and ZeRO-1; ZeRO-3/FSDP2 always overlaps)",
    )
    overlap_param_gather: bool = flag(
        False, help="ZeRO-1: all-gather the updated parameters while the next forward runs"
    )
    ddp_bucket_size: int | None = flag(
        None, help="elements per gradient-reduction bucket (default max(40M, 1M·DP×SP))"
    )
    world_size: int = flag(
        1,
        help="planned number of processes, for --dry-run outside a "
        "launcher (otherwise the launcher's WORLD_SIZE)",
    )

    @property
    def model_parallel_size(self) -> int:
        """Ranks one model replica spans: TP × SP × CP × PP."""
        return (
            self.tensor_model_parallel_size
            * self.ds_sequence_parallel_size
            * self.context_parallel_size
            * self.pipeline_model_parallel_size
        )

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.model_parallel_size


@dataclass
class TrainConfig:
    micro_batch_size: int = flag(1, help="sequences per micro-batch per DP rank")
    global_batch_size: int | None = flag(
        None, help="sequences per iteration over all DP ranks; default micro × DP"
    )
    train_iters: int = flag(10, help="iterations to train")
    lr: float = flag(1e-3, help="peak learning rate")
    min_lr: float = flag(0.0, help="learning rate at the end of the decay")
    lr_decay_style: Literal["constant", "linear", "cosine"] = flag(
        "cosine", help="shape of the decay after warm-up"
    )
    lr_warmup_iters: int = flag(0, help="linear warm-up iterations")
    lr_decay_iters: int | None = flag(None, help="iterations to decay over; default --train-iters")
    weight_decay: float = flag(0.01, help="AdamW weight decay (not on biases and norms)")
    adam_beta1: float = flag(0.9, help="AdamW β1")
    adam_beta2: float = flag(0.999, help="AdamW β2")
    adam_eps: float = flag(1e-8, help="AdamW ε")
    clip_grad: float = flag(1.0, help="clip the global gradient norm to this (0: no clipping)")
    seed: int = flag(1234, help="seed of initialisation, data order and dropout")
    bf16: bool = flag(
        False,
        help="bf16 parameters and activations (Megatron's Float16Module); "
        "fp32 main parameters, gradients and Adam state",
    )
    fp16: bool = flag(
        False,
        help="fp16 parameters and activations with fp32 main parameters, "
        "gradients and Adam state, and loss scaling",
    )
    fp32_residual_connection: bool = flag(
        False, help="--bf16/--fp16: keep the residual stream (and pipeline traffic) in fp32"
    )
    optimizer_cpu_offload: bool = flag(
        False,
        help="fp32 main parameters and Adam state in host memory; the step runs there; without "
        "ZeRO-1 a --bf16/--fp16 model's fp32 gradients accumulate in host memory too",
    )
    optimizer_offload_fraction: float = flag(
        1.0, help="--optimizer-cpu-offload: share of the parameters (in order) offloaded"
    )
    loss_scale: float | None = flag(
        None, help="fp16: constant loss scale; default: dynamic scaling"
    )
    initial_loss_scale: float = flag(2.0**32, help="fp16: first dynamic loss scale")
    min_loss_scale: float = flag(1.0, help="fp16: dynamic loss scale floor")
    loss_scale_window: int = flag(
        1000, help="fp16: steps without overflow before the scale doubles"
    )
    hysteresis: int = flag(2, help="fp16: overflows tolerated before the scale halves")
    eval_interval: int = flag(0, help="evaluate every this many iterations (0: never)")
    eval_iters: int = flag(10, help="validation batches per evaluation")
    dry_run: bool = flag(
        False,
        help="validate, print the resolved layout and a per-GPU memory "
        "estimate, exit (with --world-size N for the planned launch)",
    )
    gpu_memory_gb: float | None = flag(
        None,
        help="--dry-run: GPU memory per device; the plan is refused (exit 1, naming the "
        "largest term) when the estimate does not fit",
    )


@dataclass
class DataConfig:
    mock_data: bool = flag(
        False, help="random documents ending with EOD (id vocab-size - 1); needs --vocab-size"
    )
    data_path: list[str] = flag(
        default_factory=list, help="dataset prefixes, or 'weight prefix' pairs to blend"
    )
    split: str = flag("969,30,1", help="train,valid,test weights of each dataset")
    data_cache_path: str | None = flag(
        None,
        help="where the sample index files are cached (default: index_cache/ beside the "
        "first --data-path)",
    )
    # The names of megatron_ul/data/tokenizers.py's TOKENIZER_TYPES (a test keeps them equal).
    tokenizer_type: (
        Literal[
            "GPT2BPETokenizer",
            "SentencePieceTokenizer",
            "GPTSentencePieceTokenizer",
            "Llama2Tokenizer",
            "HuggingFaceTokenizer",
            "NullTokenizer",
        ]
        | None
    ) = flag(None, help="tokenizer of the data (docs/data.md)")
    vocab_file: str | None = flag(None, help="GPT2BPETokenizer: vocab.json")
    merge_file: str | None = flag(None, help="GPT2BPETokenizer: merges.txt")
    tokenizer_model: str | None = flag(
        None, help="SentencePiece .model file, or HuggingFaceTokenizer's local tokenizer folder"
    )
    reset_position_ids: bool = flag(False, help="restart position ids after each end-of-document")
    reset_attention_mask: bool = flag(False, help="no attention across end-of-document tokens")
    eod_mask_loss: bool = flag(False, help="no loss on end-of-document tokens")


@dataclass
class CheckpointConfig:
    save: str | None = flag(None, help="directory to save checkpoints in")
    load: str | None = flag(None, help="directory to resume from (may equal --save)")
    save_interval: int | None = flag(None, help="save every this many iterations")
    ckpt_format: Literal["torch", "torch_dist"] = flag(
        "torch",
        help="torch: one file per (TP, PP) rank, ZeRO state gathered into it; "
        "torch_dist: torch.distributed.checkpoint, every rank writes and reads "
        "only its own pieces (any layout loads either)",
    )
    async_save: bool = flag(
        False,
        help="write torch_dist checkpoints in the background while training continues "
        "(the tracker moves once every rank has finished)",
    )
    no_save_optim: bool = flag(False, help="do not save optimizer state")
    no_load_optim: bool = flag(False, help="do not load optimizer and LR-scheduler state")
    no_load_rng: bool = flag(False, help="do not load RNG states")
    finetune: bool = flag(False, help="load model weights only and start at iteration 0")
    exit_interval: int | None = flag(
        None, help="exit (saving first with --save) when the iteration is a multiple of this"
    )
    exit_duration_in_mins: float | None = flag(
        None, help="exit (saving first with --save) this many minutes after the program started"
    )
    exit_signal_handler: bool = flag(
        False,
        help="on SIGTERM or SIGUSR1 (Slurm's --signal time-limit warning), save at the "
        "end of the current iteration and exit 0",
    )
    keep_last_n_checkpoints: int | None = flag(
        None,
        help="after each save, delete all but the newest N complete iterations (default: keep all)",
    )
    remove_unfinished_checkpoints: bool = flag(
        False,
        help="after each save, delete what interrupted saves and cleanups left "
        "(iter_*.tmp-*, .old-*, .del-*); the job holds the directory's lock",
    )
    override_opt_param_scheduler: bool = flag(
        False,
        names=("--override-opt_param-scheduler", "--override-opt-param-scheduler"),
        help="on resume, use this run's --lr/--min-lr/warmup/decay flags instead of the "
        "checkpoint's LR schedule",
    )
    use_checkpoint_opt_param_scheduler: bool = flag(
        False,
        names=("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"),
        help="on resume, continue the checkpoint's LR schedule whatever this run's "
        "--lr/--min-lr/warmup/decay flags say",
    )
    overwrite_checkpoints: bool = flag(
        False,
        help="let this run save over complete checkpoints already in --save (one of the "
        "same iteration, or any after the iteration it starts from); without it "
        "such a run stops at start-up",
    )


@dataclass
class LoggingConfig:
    log_interval: int = flag(1, help="report every this many iterations")
    tensorboard_dir: str | None = flag(None, help="write TensorBoard scalars here")
    wandb_project: str | None = flag(
        None,
        help="log the TensorBoard scalars to this Weights & Biases project as well (needs the "
        "wandb package; WANDB_MODE=offline writes locally)",
    )
    wandb_exp_name: str | None = flag(None, help="the W&B run's name (with --wandb-project)")
    wandb_save_dir: str | None = flag(
        None, help="W&B's local run directory; default --save/wandb (with --wandb-project)"
    )
    timing_log_level: Literal[0, 1, 2] = flag(
        0,
        help="0: iteration time; 1: + forward, backward, all-to-all, gradient reduction, "
        "optimizer; 2: + per-layer-call all-to-all counts. On a GPU the phases are "
        "timed with CUDA events, without host syncs",
    )
    timing_device_sync: bool = flag(
        False,
        help="synchronise the device around every timed phase (wall-clock split that "
        "gives each kernel to the phase that issued it; costs two host syncs per "
        "timed call, per layer for the all-to-all, and the overlap)",
    )
    peak_tflops: float | None = flag(
        None,
        help="per-GPU peak TFLOP/s for MFU (default: known GPU names, e.g. A100 312, "
        "H100/H200 989 bf16 dense)",
    )


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


# ---- after resolve() ---------------------------------------------------------------------------
# The sections whose defaults depend on other fields, with those fields' types narrowed: once
# resolved, the value is always there, and the types say so. Each narrowed field is documented
# (and its flag declared) in the section above.
@dataclass
class ResolvedModelConfig(ModelConfig):
    max_position_embeddings: int = 0  # default --seq-length


@dataclass
class ResolvedTrainConfig(TrainConfig):
    global_batch_size: int = 0  # default micro × DP
    lr_decay_iters: int = 0  # default --train-iters


@dataclass
class ResolvedDataConfig(DataConfig):
    # --vocab-size as given (0: not given), what the tokenizer is built from: NullTokenizer's
    # N, where model.vocab_size is the model's vocabulary, N + 1.
    given_vocab_size: int = 0


@dataclass
class ResolvedConfig(Config):
    """What resolve() returns, and what everything after the start-up is handed."""

    model: ResolvedModelConfig = _section(ResolvedModelConfig, "model")
    train: ResolvedTrainConfig = _section(ResolvedTrainConfig, "training")
    data: ResolvedDataConfig = _section(ResolvedDataConfig, "data")

    @property
    def num_micro_batches(self) -> int:
        t, dp = self.train, self.parallel.data_parallel_size
        return t.global_batch_size // (t.micro_batch_size * dp)


def resolve(cfg: Config, tokenizer_vocab_size: int | None = None) -> ResolvedConfig:
    """A copy of cfg (the flags as parsed) with the defaults that depend on other fields filled.

    tokenizer_vocab_size: the vocabulary of the tokenizer the data flags name, when there is
    one: the model's vocabulary then (without it, or with --mock-data, the model's vocabulary
    is --vocab-size). Never raises: validate() judges the result (a size below 1 leaves DP
    at 1 here).
    """
    cfg = copy.deepcopy(cfg)
    m, p, t, d = cfg.model, cfg.parallel, cfg.train, cfg.data
    use_tokenizer = tokenizer_vocab_size is not None and not d.mock_data
    model = ResolvedModelConfig(
        **{
            **_values(m),
            "max_position_embeddings": (
                m.seq_length if m.max_position_embeddings is None else m.max_position_embeddings
            ),
            "vocab_size": tokenizer_vocab_size if use_tokenizer else m.vocab_size,
        }
    )
    global_batch = t.global_batch_size
    if global_batch is None:
        dp = max(p.data_parallel_size, 1) if p.model_parallel_size > 0 else 1
        global_batch = t.micro_batch_size * dp
    decay = t.lr_decay_iters if t.lr_decay_iters is not None else t.train_iters
    train = ResolvedTrainConfig(
        **{**_values(t), "global_batch_size": global_batch, "lr_decay_iters": decay}
    )
    data = ResolvedDataConfig(**{**_values(d), "given_vocab_size": m.vocab_size})
    # --use-distributed-optimizer is ZeRO-1 and --zero-stage 1 is the distributed optimizer
    if p.use_distributed_optimizer and p.zero_stage == 0:
        p.zero_stage = 1
    if p.zero_stage == 1:
        p.use_distributed_optimizer = True
    return ResolvedConfig(
        model=model,
        parallel=p,
        train=train,
        data=data,
        checkpoint=cfg.checkpoint,
        logging=cfg.logging,
    )


def _values(section: Any) -> dict[str, Any]:
    return {f.name: getattr(section, f.name) for f in fields(section)}
