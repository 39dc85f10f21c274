"""Per-GPU memory estimate for a model × sequence length × layout, and the smallest GPU count
that fits a given GPU memory.

Parameters, gradients and Adam state follow what megatron_ul allocates: fp32 parameters,
fp32 gradients and two fp32 Adam moments (16 bytes per parameter); --bf16 and --fp16 run under
autocast, which also keeps a 2-byte copy of every matmul weight alive from forward to backward.
ZeRO stage 1 shards the optimizer state, stage 2 also the gradients, stage 3 also the
parameters, over the data × sequence parallel group (Ulysses ranks hold replicated weights, as
in DeepSpeed).

Activations follow Korthikanti et al. (2022), "Reducing Activation Recomputation in Large
Transformer Models", counted tensor by tensor for *this* implementation (what autograd keeps
for backward in model/transformer.py), in units of one [s, b, h] tensor:
  s = N / (SP·CP) on the Ulysses side (each rank holds N/(SP·CP) tokens between layers; CP is
  the ring degree, --context-parallel-size), with the
  norms and dropouts ÷TP again under --sequence-parallel; tensors inside the TP region
  (QKV output, attention output, MLP hidden) ÷TP. Under Megatron-SP the column-parallel
  linears (QKV, fc1, the output head) keep only their [s/TP, b, h] input shard and all-gather
  it again in backward, as Megatron-LM does. GQA's k and v are not repeated up to the query
  heads (SDPA's enable_gqa).
With a fused attention kernel (flash / SDPA) nothing of size N² is kept (ring attention keeps
only q, k, v, its fp32 output and log-sum-exp, the output counted twice); without one
(--attention-kernel math) the scores and probabilities, a/(TP·SP) heads × N² per sample, are.
Long sequences (docs/long_context.md): --tiled-loss-chunk-size keeps no logits; its working set
is one chunk's logits and their shifted copy, 2·c·TP_gathered·b·V/TP fp32. --tiled-mlp-chunk-size
keeps no MLP intermediate; one chunk's is counted. --activation-checkpoint-cpu-offload moves
the full-recompute layer inputs to host memory (reported as host_bytes); two stay on the GPU
(the one being recomputed and the one prefetched). Document masking and sliding windows add
nothing of size N² (O(N) offsets).
Pipelining with 1F1B keeps min(PP, micro-batches) micro-batches of L/PP layers alive on the
first stage. The loss's short-lived logits copy (or tiled chunk) and the gradients alive while a
layer backpropagates (8 [s, b, h] tensors) are counted as their own rows.
Not included: the CUDA context and allocator fragmentation (~1-3 GiB on a GPU), and the
backward's other short-lived gradient buffers.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import Config, ModelConfig
from ..mpu.param_init import WORKSPACE_BYTES

GiB = 2**30
RECOMPUTE_CHOICES = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    sp: int = 1
    pp: int = 1
    dp: int = 1
    sequence_parallel: bool = False   # Megatron-SP over the TP group
    micro_batch_size: int = 1
    num_micro_batches: int = 1
    cp: int = 1                       # ring-attention degree (--context-parallel-size)

    @property
    def world(self) -> int:
        return self.tp * self.sp * self.cp * self.pp * self.dp

    @property
    def sequence_ranks(self) -> int:
        """Ranks that split one sequence: Ulysses × ring."""
        return self.sp * self.cp


@dataclass(frozen=True)
class Precision:
    bf16: bool = False            # 2-byte autocast activations: --bf16 or --fp16
    dropout_mask_bytes: int = 1   # CUDA keeps a bool mask; the CPU kernel keeps a float mask
    fused_attention: bool = True  # flash / SDPA: no N×N tensors kept for backward


@dataclass
class MemoryEstimate:
    params_per_rank: int
    parameter_bytes: float
    gradient_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    host_bytes: float = 0.0        # offloaded activations, in host memory (not in total)
    loss_working_bytes: float = 0.0  # the loss's short-lived logits copy (or tiled chunk)
    backward_working_bytes: float = 0.0  # gradients alive while one layer backpropagates

    @property
    def total_bytes(self) -> float:
        return (self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes
                + self.activation_bytes + self.loss_working_bytes
                + self.backward_working_bytes)

    def rows(self) -> list[tuple[str, float]]:
        return [("parameters", self.parameter_bytes), ("gradients", self.gradient_bytes),
                ("optimizer state", self.optimizer_bytes),
                ("activations", self.activation_bytes),
                ("loss working set", self.loss_working_bytes),
                ("backward working set", self.backward_working_bytes),
                ("total", self.total_bytes)] + (
                    [("host memory (offloaded)", self.host_bytes)] if self.host_bytes else [])

    def describe(self) -> str:
        return " | ".join(f"{name} {value / GiB:.2f} GiB" for name, value in self.rows())


# ---- parameters ---------------------------------------------------------------------------------
def layer_parameters(m: ModelConfig, tp: int) -> int:
    """Parameters of one transformer layer held by one TP rank."""
    h, d, ffn = m.hidden_size, m.head_dim, m.ffn_size
    norm = h * (2 if m.normalization == "LayerNorm" else 1)
    qkv_out = (m.num_attention_heads + 2 * m.query_groups) * d
    fc1_out = ffn * (2 if m.swiglu else 1)
    weights = (h * qkv_out + m.num_attention_heads * d * h + h * fc1_out + ffn * h) // tp
    biases = 0
    if m.add_bias_linear:  # column-parallel biases are sharded, row-parallel ones replicated
        biases = (qkv_out + fc1_out) // tp + 2 * h
    return 2 * norm + weights + biases


def stage_parameters(m: ModelConfig, tp: int, pp: int) -> int:
    """Parameters on the largest pipeline stage of one TP rank (the first, or the last when the
    output layer is untied and larger)."""
    h, vocab = m.hidden_size, m.padded_vocab_size(tp)
    layers = -(-m.num_layers // pp) * layer_parameters(m, tp)
    embedding = vocab * h // tp
    position = (m.max_position_embeddings or m.seq_length) * h \
        if m.position_embedding_type == "learned_absolute" else 0
    final_norm = h * (2 if m.normalization == "LayerNorm" else 1)
    head = embedding  # tied: the last stage keeps a copy; untied: its own output layer
    if pp == 1:
        tied = not m.untie_embeddings_and_output_weights
        return embedding + position + layers + final_norm + (0 if tied else head)
    return layers + max(embedding + position, final_norm + head)


# ---- activations --------------------------------------------------------------------------------
def layer_activation_bytes(m: ModelConfig, layout: Layout, precision: Precision,
                           recompute: str = "none") -> float:
    """Bytes one transformer layer keeps for backward, per micro-batch, on one rank."""
    tp, sp, b = layout.tp, layout.sp, layout.micro_batch_size
    s = m.seq_length / layout.sequence_ranks
    sbh = s * b * m.hidden_size
    norm_region = sbh / (tp if layout.sequence_parallel else 1)   # norms, dropouts, residual
    residual_bytes = 4                       # the residual stream stays fp32 under autocast
    act = 2 if precision.bf16 else 4         # matmul inputs/outputs
    if recompute == "full":                  # only the layer's input is kept
        return norm_region * residual_bytes
    d, heads, groups = m.head_dim, m.num_attention_heads, m.query_groups
    qkv = s * b * (heads + 2 * groups) * d / tp
    attn_out = s * b * heads * d / tp
    ffn = s * b * m.ffn_size / tp
    if m.tiled_mlp_chunk_size:               # only one chunk's intermediate at a time
        local_tokens = s / (tp if layout.sequence_parallel else 1)
        ffn *= min(1.0, m.tiled_mlp_chunk_size / local_tokens)
    mlp = (4 if m.swiglu else 2) * ffn       # GELU: its input and output; SwiGLU: [gate; up],
    #                                          silu(gate) and the product
    # Column-parallel linear inputs: TP-replicated, or the local shard under Megatron-SP.
    linear_in = norm_region
    elements = (linear_in                    # QKV linear input (norm output)
                + qkv                        # q, k, v kept by the attention kernel
                + attn_out * (2 if layout.cp > 1 else 1)  # attention output kept by the
                #                                kernel (the ring keeps it in fp32)
                + attn_out                   # projection input (re-laid-out output)
                + linear_in                  # fc1 input
                + mlp)
    # The two norm inputs; PyTorch's RMSNorm also keeps its normalised input (and a per-token
    # rsqrt), which apex's fused kernel does not: counted, erring on the safe side.
    norms = 2 * norm_region * residual_bytes
    if m.normalization == "RMSNorm":
        norms *= 2
    total = norms + elements * act
    if m.hidden_dropout > 0:
        total += 2 * norm_region * precision.dropout_mask_bytes
    if not precision.fused_attention and recompute != "selective" and layout.cp == 1:
        scores = heads / (tp * sp) * b * m.seq_length ** 2
        total += 2 * scores * act + (scores * precision.dropout_mask_bytes
                                     if m.attention_dropout > 0 else 0)
    return total


def head_activation_bytes(m: ModelConfig, layout: Layout, precision: Precision) -> float:
    """Final norm, output-layer input and the fp32 softmax the vocab-parallel loss keeps."""
    s = m.seq_length / layout.sequence_ranks
    sbh = s * layout.micro_batch_size * m.hidden_size
    norm_region = sbh / (layout.tp if layout.sequence_parallel else 1)
    act = 2 if precision.bf16 else 4
    softmax = 0.0 if _loss_is_tiled(m, layout) else _logits_bytes(m, layout, s)
    return norm_region * 4 + norm_region * act + softmax  # output-layer input: see linear_in


def _loss_is_tiled(m: ModelConfig, layout: Layout) -> bool:
    gathered = layout.tp if layout.sequence_parallel else 1
    chunk = m.tiled_loss_chunk_size
    return bool(chunk) and chunk < m.seq_length / layout.sp / gathered


def _logits_bytes(m: ModelConfig, layout: Layout, rows: float) -> float:
    """fp32 logits of `rows` tokens on one TP rank."""
    return rows * layout.micro_batch_size * m.padded_vocab_size(layout.tp) / layout.tp * 4


def backward_working_bytes(m: ModelConfig, layout: Layout, precision: Precision) -> float:
    """Gradients alive at once while one layer backpropagates, in units of [s, b, h]: the
    incoming, residual and norm-input gradients in the fp32 residual stream (3), and dq, dk,
    dv, the attention output's and the MLP input's gradients in the activation dtype (5).
    On CPU (fp32) the benchmark measures about this much above the kept activations."""
    s = m.seq_length / layout.sp
    sbh = s * layout.micro_batch_size * m.hidden_size
    norm_region = sbh / (layout.tp if layout.sequence_parallel else 1)
    act = 2 if precision.bf16 else 4
    return 3 * norm_region * 4 + 5 * sbh / layout.tp * act


def loss_working_bytes(m: ModelConfig, layout: Layout) -> float:
    """The loss's short-lived buffers on the last stage: untiled, the output layer's logits
    and the shifted copy the softmax is made of coexist in forward (the copy is kept); tiled,
    one chunk's logits and shifted copy, [c·TP_gathered, b, V/TP] each."""
    if not _loss_is_tiled(m, layout):
        return _logits_bytes(m, layout, m.seq_length / layout.sp)
    gathered = layout.tp if layout.sequence_parallel else 1
    return 2 * _logits_bytes(m, layout, m.tiled_loss_chunk_size * gathered)


def activation_bytes(m: ModelConfig, layout: Layout, precision: Precision,
                     recompute: str = "none") -> float:
    """Peak activation bytes on the busiest rank (the first pipeline stage)."""
    layers = -(-m.num_layers // layout.pp)
    in_flight = min(layout.pp, layout.num_micro_batches)
    per_layer = layer_activation_bytes(m, layout, precision, recompute)
    total = layers * in_flight * per_layer
    if recompute == "full" and m.activation_checkpoint_cpu_offload:
        total = min(total, 2 * per_layer)    # the rest waits in host memory
    if recompute == "full":  # during backward one layer is rebuilt with all its activations
        total += layer_activation_bytes(m, layout, precision, "none")
    if layout.pp == 1:
        total += head_activation_bytes(m, layout, precision)
    return total


# ---- totals -------------------------------------------------------------------------------------
def estimate(m: ModelConfig, layout: Layout, *, zero_stage: int = 0, recompute: str = "none",
             precision: Precision = Precision()) -> MemoryEstimate:
    if recompute not in RECOMPUTE_CHOICES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_CHOICES} (got {recompute!r})")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero stage must be 0, 1, 2 or 3 (got {zero_stage})")
    params = stage_parameters(m, layout.tp, layout.pp)
    # ZeRO partitions over the data × ring × Ulysses group (all replicas of the parameters)
    shards = layout.dp * layout.sp * layout.cp
    param_bytes = 4 * params / (shards if zero_stage >= 3 else 1)
    if precision.bf16:  # autocast's bf16 weight copies, kept for backward (under ZeRO-3 only
        # the gathered layers' copies live at once: counted as a shard, a lower bound)
        param_bytes += 2 * params / (shards if zero_stage >= 3 else 1)
    grad_bytes = 4 * params / (shards if zero_stage >= 2 else 1)
    optimizer_bytes = 8 * params / (shards if zero_stage >= 1 else 1)
    host = 0.0
    if recompute == "full" and m.activation_checkpoint_cpu_offload:
        host = (-(-m.num_layers // layout.pp) * min(layout.pp, layout.num_micro_batches)
                * layer_activation_bytes(m, layout, precision, "full"))
    return MemoryEstimate(params, param_bytes, grad_bytes, optimizer_bytes,
                          activation_bytes(m, layout, precision, recompute), host,
                          loss_working_bytes(m, layout),
                          backward_working_bytes(m, layout, precision))


def init_peak_bytes(m: ModelConfig, layout: Layout, zero_stage: int = 0) -> float:
    """Peak during initialisation: a rank allocates only the fp32 parameters it holds (its TP
    slice and pipeline stage; under ZeRO-3 its dp_sp shard, the model being built on the meta
    device first) and computes them in place, plus the generator's bounded workspace
    (mpu/param_init.py). Nothing is drawn in full, on the host or on the GPU."""
    params = stage_parameters(m, layout.tp, layout.pp)
    shards = layout.dp * layout.sp if zero_stage >= 3 else 1
    return 4 * params / shards + WORKSPACE_BYTES


def layout_from_config(cfg: Config) -> Layout:
    p, t = cfg.parallel, cfg.train
    return Layout(tp=p.tensor_model_parallel_size, sp=p.ds_sequence_parallel_size,
                  pp=p.pipeline_model_parallel_size, dp=max(p.data_parallel_size, 1),
                  sequence_parallel=p.sequence_parallel, micro_batch_size=t.micro_batch_size,
                  num_micro_batches=max(cfg.num_micro_batches, 1),
                  cp=getattr(p, "context_parallel_size", 1))


def estimate_config(cfg: Config) -> MemoryEstimate:
    """The estimate for a validated Config (reads ZeRO and recompute settings when present)."""
    zero = getattr(cfg.parallel, "zero_stage", 0) or (
        1 if getattr(cfg.parallel, "use_distributed_optimizer", False) else 0)
    return estimate(cfg.model, layout_from_config(cfg), zero_stage=zero,
                    recompute=recompute_of(cfg),
                    precision=Precision(bf16=cfg.train.bf16 or cfg.train.fp16))


def recompute_of(cfg: Config) -> str:
    """--recompute-granularity wherever the Config keeps it ('none' when absent)."""
    for section in (cfg.model, cfg.train, cfg.parallel):
        granularity = getattr(section, "recompute_granularity", None)
        if granularity:
            return granularity
    return "none"


def smallest_fitting_layout(m: ModelConfig, layout: Layout, gpu_memory_gb: float, *,
                            zero_stage: int = 0, recompute: str = "none",
                            precision: Precision = Precision(), max_world: int = 65536,
                            reserve_gb: float = 2.0):
    """The fewest GPUs (keeping TP, PP and the micro-batch size) whose per-GPU estimate fits
    in gpu_memory_gb − reserve_gb: raise the Ulysses degree over the divisors of heads/TP that
    divide N, and the data-parallel degree (which helps only under ZeRO), in powers of two.
    Returns (layout, estimate) or None."""
    budget = (gpu_memory_gb - reserve_gb) * GiB
    heads_per_tp = m.num_attention_heads // layout.tp
    sps = [s for s in range(1, heads_per_tp + 1)
           if heads_per_tp % s == 0 and m.seq_length % s == 0]
    best = None
    for sp in sps:
        dp = 1
        while layout.tp * sp * layout.pp * dp <= max_world:
            candidate = replace(layout, sp=sp, dp=dp)
            est = estimate(m, candidate, zero_stage=zero_stage, recompute=recompute,
                           precision=precision)
            if est.total_bytes <= budget:
                if best is None or candidate.world < best[0].world:
                    best = (candidate, est)
                break
            if zero_stage == 0:
                break  # more data parallelism does not shrink anything without ZeRO
            dp *= 2
    return best
