"""Per-GPU memory estimate for a model × sequence length × layout, and the smallest GPU count
that fits a given GPU memory.

Parameters, gradients and Adam state follow what megatron_ul allocates: fp32 parameters,
fp32 gradients and two fp32 Adam moments (16 bytes per parameter). --bf16 and --fp16 build a
half-precision model (Precision.half_model, Megatron's meaning): 2-byte parameters and
activations, fp32 main parameters and gradients next to Adam (18 bytes per parameter).
ZeRO stage 1 shards the optimizer state, stage 2 also the gradients, stage 3 also the
parameters, over the DP × CP × SP group (Ulysses and ring ranks hold replicated weights, as
in DeepSpeed).

A layer's parameters, and what its norms and MLP keep for backward, are the layer spec's modules'
own description (model/layer_spec.py: counted on the layer built on the meta device), so a new
norm or MLP variant needs no edit here.
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
(Precision.fused_attention False: SDPA's math kernel) the scores and probabilities,
a/(TP·SP) heads × N² per sample, are.
Long sequences (docs/long_context.md): --tiled-loss-chunk-size keeps no logits; its working set
is one chunk's logits and, in backward, their gradient, c·TP_gathered·b·V/TP each in the
activation dtype, beside one fp32 block of rows of the softmax (mpu/cross_entropy.py).
RoPE's fp32 cos and sin tables, [s, b, 1, d/2] each, live from the forward to the last layer's
backward. --tiled-mlp-chunk-size
keeps no MLP intermediate; one chunk's is counted. --attention-block-tiles T keeps neither the
input norm's output (one tile's, 1/T, while recomputed) nor the projection's re-laid-out copy of
the attention output. --activation-checkpoint-cpu-offload moves
the full-recompute layer inputs to host memory (reported as host_bytes); two stay on the GPU
(the one being recomputed and the one prefetched). Document masking and sliding windows add
nothing of size N² (O(N) offsets).
Pipelining with 1F1B keeps min(PP, micro-batches) micro-batches of L/PP layers alive on the
first stage.
The peak is the largest of the phases, which never coexist (MemoryEstimate.phases): forward
(a layer's own forward or the head with its loss chunk), the loss's backward (one chunk's
logits and their gradient, the output weight's gradient summed over the chunks), a layer's
backward (the rebuilt layer at its larger stage, MLP or attention, with the ring's or the
document kernel's working set) and the optimizer step (foreach AdamW's temporaries; the
gradient norm holds one fp32 number per gradient). The model state (parameters, optimizer state) is
under every phase; gradients are under the backward and step phases, and under every phase
for a half-precision model (its fp32 main_grad buffers live from setup on) or several
micro-batches.
Checked against the live-tensor tracker (tools/bench/live_tensors.py) in
tests/training/test_memory_estimator_measured.py, not against these formulas.
Not included: the CUDA context and allocator fragmentation (~1-3 GiB on a GPU: a fit keeps
RESERVE_GIB free for them), kernels' internal workspaces (they show in peak RSS on CPU, not in
live tensors).
Every front door (`--dry-run`, `python -m tools.memory_estimator`, the benchmarks' target
tables) asks through estimate_config and smallest_fitting_layout with a ResolvedConfig, so the
flags mean what they mean in training; estimate() with explicit Precision and Kernels is for
tests and measurements that model one kernel (a CPU run's float dropout masks, say).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

from ..config import ModelConfig, ResolvedConfig
from ..config_rules import problems
from ..model.activation_shape import ActivationShape
from ..model.layer_spec import (
    described_layer,
    described_norm,
    held_elements,
    held_parameters,
    norms_of,
)
from ..mpu.cross_entropy import ROW_BLOCK_ELEMENTS
from ..mpu.param_init import WORKSPACE_BYTES
from ..optim.grad_buckets import bucket_elements

GiB = 2**30
RECOMPUTE_CHOICES = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    sp: int = 1
    pp: int = 1
    dp: int = 1
    sequence_parallel: bool = False  # Megatron-SP over the TP group
    micro_batch_size: int = 1
    num_micro_batches: int = 1
    cp: int = 1  # ring-attention degree (--context-parallel-size)
    ep: int = 1  # expert-parallel degree (--expert-model-parallel-size), within DP × CP × SP

    @property
    def world(self) -> int:
        return self.tp * self.sp * self.cp * self.pp * self.dp

    @property
    def sequence_ranks(self) -> int:
        """Ranks that split one sequence: Ulysses × ring."""
        return self.sp * self.cp


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of tensor.

    half_model: Megatron-LM's --bf16/--fp16: the model (parameters, activations, residual
    stream) in half precision, fp32 main parameters and fp32 main gradients (accumulated in
    fp32) next to Adam's two fp32 moments. fp32_residual: --fp32-residual-connection."""

    dropout_mask_bytes: int = 1  # CUDA keeps a bool mask; the CPU kernel keeps a float mask
    fused_attention: bool = True  # flash / SDPA: no N×N tensors kept for backward
    half_model: bool = False
    fp32_residual: bool = False

    @property
    def act(self) -> int:
        """Bytes of a matmul input/output."""
        return 2 if self.half_model else 4

    @property
    def residual(self) -> int:
        """Bytes of the residual stream (layer inputs, norm inputs, their gradients)."""
        return 2 if self.half_model and not self.fp32_residual else 4

    @property
    def param(self) -> int:
        """Bytes per parameter on the device besides the optimizer: the model's own weights."""
        return 2 if self.half_model else 4


@dataclass(frozen=True)
class Kernels:
    """What the kernels and options chosen keep beyond the tensors every path has.

    The ring's unit kernels return the log-sum-exp, so a ring unit keeps O(C·d) (its output
    and log-sum-exp), never C×C scores. documents: --reset-attention-mask; document_kernel
    "in-place" (gradients added into the full-size accumulators tile by tile: the CPU loop in
    every precision without a window, dropout or GQA, model/attention/documents.py; flash-attn's
    varlen backward on GPUs) or "accumulate" (each document's dq, dk, dv next to the
    accumulators: the CPU loop's per-document path). optimizer_offload:
    --optimizer-offload-fraction (0 = off). host_is_device: offloaded bytes live in the same
    memory (a CPU run), so they count in the peak."""

    documents: bool = False
    document_kernel: str = "in-place"
    foreach_optimizer: bool = True
    optimizer_offload: float = 0.0
    host_is_device: bool = False


# Measured with tools/bench/bench_memory.py --peak (live tensors, CPU): while a layer
# backpropagates, the residual-stream gradients alive besides the saved tensors (the incoming
# one and the residual branch's), in [s, b, h] units of the residual dtype.
BACKWARD_RESIDUAL_UNITS = 2
FOREACH_ADAM_BYTES = 4  # _foreach_sqrt(exp_avg_sq): one fp32 list the size of the step


@dataclass
class MemoryEstimate:
    """Per-GPU bytes. The model state (parameters, gradients, optimizer) plus the largest
    phase: phases never coexist, so the peak is their maximum, not their sum."""

    params_per_rank: int
    parameter_bytes: float
    gradient_bytes: float
    optimizer_bytes: float
    activation_bytes: float  # kept from forward to backward (all layers, head)
    host_bytes: float = 0.0  # offloaded activations and optimizer state (host)
    loss_working_bytes: float = 0.0  # the loss's short-lived logits (or tiled chunk)
    backward_working_bytes: float = 0.0  # gradients alive while one layer backpropagates
    phases: dict = field(default_factory=dict)  # phase -> bytes above params + optimizer
    terms: dict = field(default_factory=dict)  # the largest phase's terms
    host_in_peak: bool = False

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.__getitem__) if self.phases else "forward"

    @property
    def total_bytes(self) -> float:
        working = (
            max(self.phases.values())
            if self.phases
            else (
                self.gradient_bytes
                + self.activation_bytes
                + self.loss_working_bytes
                + self.backward_working_bytes
            )
        )
        return self.parameter_bytes + self.optimizer_bytes + working

    def largest_term(self) -> tuple[str, float]:
        """The biggest contribution to the peak (model state or a term of the peak phase)."""
        every = {
            "parameters": self.parameter_bytes,
            "optimizer state": self.optimizer_bytes,
            **self.terms,
        }
        name = max(every, key=every.__getitem__)
        return name, every[name]

    def rows(self) -> list[tuple[str, float]]:
        rows = [
            ("parameters", self.parameter_bytes),
            ("gradients", self.gradient_bytes),
            ("optimizer state", self.optimizer_bytes),
            ("activations kept", self.activation_bytes),
            ("loss working set", self.loss_working_bytes),
            ("backward working set", self.backward_working_bytes),
        ]
        rows += [(f"phase {name} (above params + optimizer)", v) for name, v in self.phases.items()]
        rows.append((f"total (peak: {self.peak_phase})", self.total_bytes))
        return rows + ([("host memory (offloaded)", self.host_bytes)] if self.host_bytes else [])

    def describe(self) -> str:
        return " | ".join(f"{name} {value / GiB:.2f} GiB" for name, value in self.rows())


# ---- parameters ---------------------------------------------------------------------------------
def layer_parameters(m: ModelConfig, tp: int, ep: int = 1) -> int:
    """Parameters of one transformer layer held by one TP rank (counted on the layer the spec
    builds: an MoE layer when --num-experts is set, holding E/EP experts under EP)."""
    layer = described_layer(m)
    experts = sum(
        held_elements(p, tp) for n, p in layer.named_parameters() if ".local_experts." in n
    )
    return held_parameters(layer, tp) - experts + experts // ep


def _stage_layer_parameters(m: ModelConfig, tp: int, pp: int, ep: int) -> int:
    """The layers' parameters on the stage holding the most: with --moe-layer-freq > 1 the
    stages hold different mixes of MoE and dense layers."""
    per_stage = -(-m.num_layers // pp)
    if m.num_experts is None:
        return per_stage * layer_parameters(m, tp)
    moe, dense = layer_parameters(m, tp, ep), layer_parameters(replace(m, num_experts=None), tp)
    return max(
        sum(
            moe if m.is_moe_layer(i + 1) else dense
            for i in range(s, min(s + per_stage, m.num_layers))
        )
        for s in range(0, m.num_layers, per_stage)
    )


def _embedding_parameters(m: ModelConfig, tp: int) -> int:
    return m.padded_vocab_size(tp) * m.hidden_size // tp


def stage_parameters(m: ModelConfig, tp: int, pp: int, ep: int = 1) -> int:
    """Parameters on the largest pipeline stage of one TP rank (the first, or the last when the
    output layer is untied and larger)."""
    h = m.hidden_size
    layers = _stage_layer_parameters(m, tp, pp, ep)
    embedding = _embedding_parameters(m, tp)
    position = (
        (m.max_position_embeddings or m.seq_length) * h
        if m.position_embedding_type == "learned_absolute"
        else 0
    )
    final_norm = held_parameters(described_norm(m), tp)
    head = embedding  # tied: the last stage keeps a copy; untied: its own output layer
    if pp == 1:
        tied = not m.untie_embeddings_and_output_weights
        return embedding + position + layers + final_norm + (0 if tied else head)
    return layers + max(embedding + position, final_norm + head)


def _largest_parameter(m: ModelConfig, tp: int) -> int:
    layer = max(held_elements(p, tp) for p in described_layer(m).parameters())
    return max(_embedding_parameters(m, tp), layer)


# ---- activations --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Sizes:
    """Element counts of one rank's tensors for one micro-batch."""

    s: float  # tokens per rank between layers: N / (SP·CP)
    norm: float  # [s, b, h] (÷TP under Megatron-SP): norms, residual, layer inputs
    hidden: float  # [s, b, h]: a TP rank's linear inputs are replicated (or gathered)
    qkv: float  # q, k and v of this TP rank's heads
    attn: float  # the attention output of this TP rank's heads


def activation_shape(m: ModelConfig, layout: Layout, precision: Precision) -> ActivationShape:
    """What the layer's modules are told when they say what they keep (model/layer_spec.py)."""
    return ActivationShape(
        seq=m.seq_length / layout.sequence_ranks,
        batch=layout.micro_batch_size,
        tp=layout.tp,
        sequence_parallel=layout.sequence_parallel,
        act_bytes=precision.act,
        residual_bytes=precision.residual,
    )


def _sizes(m: ModelConfig, layout: Layout) -> _Sizes:
    shape = activation_shape(m, layout, Precision())
    tokens, tp, d = shape.tokens, layout.tp, m.head_dim
    return _Sizes(
        s=shape.seq,
        norm=shape.norm_tokens * m.hidden_size,
        hidden=tokens * m.hidden_size,
        qkv=tokens * (m.num_attention_heads + 2 * m.query_groups) * d / tp,
        attn=tokens * m.num_attention_heads * d / tp,
    )


def layer_terms(
    m: ModelConfig, layout: Layout, precision: Precision, kernels: Kernels = Kernels()
) -> dict[str, float]:
    """Bytes one transformer layer keeps for backward (no recompute), per micro-batch, per
    rank, by term (model/transformer.py tensor by tensor; the norms' and the MLP's as those
    modules say)."""
    z, act = _sizes(m, layout), precision.act
    layer, shape = described_layer(m), activation_shape(m, layout, precision)
    ring = layout.cp > 1
    sparse = m.sparse_attention is not None
    # The document and block-sparse kernels write the output the projection reads (no copy).
    documents_view = (kernels.documents or sparse) and layout.sp == 1 and not ring
    # Tiled, the attention block keeps no norm output and re-lays out its output per tile.
    tiled = m.attention_block_tiles > 1
    terms = {
        "layer input + post-attention residual (norm inputs)": sum(
            norm.saved_bytes(shape) for norm in norms_of(layer)
        ),
        "norm outputs (QKV and fc1 inputs)": (1 if tiled else 2) * z.norm * act,
        "q, k, v": z.qkv * act,
        # The ring keeps its output in fp32; SDPA's output is permuted, so the projection
        # keeps a re-laid-out copy (the document path writes it in place: no copy).
        "attention output": z.attn * (4 if ring else act) * (1 if documents_view or tiled else 2),
    }
    mlp = layer.mlp.saved_bytes(shape)
    if m.tiled_mlp_chunk_size:
        terms["tiled MLP chunk (while recomputed)"] = mlp
    else:
        terms["MLP intermediate"] = mlp
    if m.num_experts is not None:
        # the router's top-k choice (int64 index, fp32 probability per pair of each token) and
        # the dispatch's sort (two int64 permutations and an fp32 weight per routed pair)
        pairs = m.moe_router_topk * shape.tokens
        terms["MoE routing (indices, probabilities)"] = pairs * (8 + 4) + pairs * (8 + 8 + 4)
    if m.hidden_dropout > 0:
        terms["dropout masks"] = 2 * z.norm * precision.dropout_mask_bytes
    if sparse and not ring:  # the blocked engine keeps its fp32 log-sum-exp for backward
        terms["block-sparse log-sum-exp"] = z.attn / m.head_dim * 4
    if not precision.fused_attention and not ring and not kernels.documents and not sparse:
        scores = (
            m.num_attention_heads
            / (layout.tp * layout.sp)
            * layout.micro_batch_size
            * m.seq_length**2
        )
        terms["attention scores (unfused kernel)"] = 2 * scores * act + (
            scores * precision.dropout_mask_bytes if m.attention_dropout > 0 else 0
        )
    return terms


def layer_activation_bytes(
    m: ModelConfig,
    layout: Layout,
    precision: Precision,
    recompute: str = "none",
    kernels: Kernels = Kernels(),
) -> float:
    """Bytes one transformer layer keeps for backward, per micro-batch, on one rank."""
    if recompute == "full":  # only the layer's input is kept
        return _sizes(m, layout).norm * precision.residual
    terms = layer_terms(m, layout, precision, kernels)
    if recompute == "selective":  # the attention core is recomputed: q, k, v stay
        terms.pop("attention scores (unfused kernel)", None)
    return sum(terms.values())


def ring_working_bytes(m: ModelConfig, layout: Layout) -> float:
    """One ring unit's working set, C = N/(2·CP) queries against C keys for this rank's
    heads/(TP·SP) heads: the unit's fp32 output and log-sum-exp, and its dq, dk, dv."""
    if layout.cp == 1:
        return 0.0
    heads = m.num_attention_heads / (layout.tp * layout.sp) * layout.micro_batch_size
    chunk = m.seq_length / (2 * layout.cp)
    return 4 * heads * chunk * m.head_dim * 4


def document_working_bytes(
    m: ModelConfig, layout: Layout, precision: Precision, kernels: Kernels
) -> float:
    """Document attention's backward beyond dq/dk/dv. "in-place" (gradients added into the
    accumulators tile by tile): the longest document's recomputed output, in the activation
    dtype, and its fp32 log-sum-exp (one number per query and head); one tile pair's gradients
    besides are O(tile), not counted. "accumulate": each document's dq, dk, dv next to the
    accumulators (one document as long as the sequence in the worst case)."""
    if not kernels.documents or layout.cp > 1:
        return 0.0
    z = _sizes(m, layout)
    if kernels.document_kernel == "in-place":
        return z.attn * precision.act + z.attn / m.head_dim * 4
    return z.qkv * precision.act


def residual_gradient_units(m: ModelConfig, recompute: str = "none") -> int:
    """Residual-stream gradients alive while a layer backpropagates, in [s, b, h] units. The
    offloaded checkpoint hands the layer output's gradient to the inner backward as its only
    reference, so it is freed once summed into the residual gradient (mpu/offload.py): one
    unit fewer than autograd's incoming gradient beside the residual branch's."""
    offloaded = recompute == "full" and m.activation_checkpoint_cpu_offload
    return BACKWARD_RESIDUAL_UNITS - (1 if offloaded else 0)


def backward_working_bytes(
    m: ModelConfig, layout: Layout, precision: Precision, recompute: str = "none"
) -> float:
    """Gradients alive at once at the attention's backward (the layer's backward peak): the
    residual-stream gradients, the attention output's gradient and dq, dk, dv; under Ulysses
    also the backward all-to-all's send copy and receive buffer, one tensor at a time (the
    largest: dq)."""
    z = _sizes(m, layout)
    dq_share = m.num_attention_heads / (m.num_attention_heads + 2 * m.query_groups)
    exchange = 2 * z.qkv * dq_share * precision.act if layout.sp > 1 else 0.0
    return (
        residual_gradient_units(m, recompute) * z.norm * precision.residual
        + z.attn * precision.act
        + z.qkv * precision.act
        + exchange
    )


def layer_backward_terms(
    m: ModelConfig, layout: Layout, precision: Precision, kernels: Kernels
) -> dict[str, float]:
    """One layer's backward at its larger stage: the MLP's (every saved tensor, the
    residual gradients and the MLP's own gradients) or the attention's (what the attention
    half saved, its gradients, and the ring's or the document kernel's working set)."""
    saved = layer_terms(m, layout, precision, kernels)
    z, res, act = _sizes(m, layout), precision.residual, precision.act
    # The MLP half still holds the incoming gradient beside its input's, filled chunk by
    # chunk; the released output gradient shows in the attention half.
    residual_grads = BACKWARD_RESIDUAL_UNITS * z.norm * res
    # fc2's input, the MLP's last saved block, is freed once fc2's backward has run, before
    # the activation's backward (the MLP's peak).
    mlp = described_layer(m).mlp
    for name in ("MLP intermediate", "tiled MLP chunk (while recomputed)"):
        if name in saved:
            saved[name] *= 1 - 1 / mlp.saved_blocks
    mlp_stage = {
        **saved,
        "residual-stream gradients": residual_grads,
        "MLP gradients": mlp.gradient_bytes(activation_shape(m, layout, precision)),
    }
    attention_stage = {
        "layer input (norm input)": z.norm * res,
        "norm output (QKV input)": z.norm * act / m.attention_block_tiles,
        "q, k, v": saved["q, k, v"],
        "backward working set (residual grads, d out, dq, dk, dv)": backward_working_bytes(
            m, layout, precision, "full"
        ),
        "ring unit working set": ring_working_bytes(m, layout),
        "document attention backward": document_working_bytes(m, layout, precision, kernels),
    }
    if layout.cp > 1:  # the ring's own backward, in place of dq, dk, dv and the document loop
        attention_stage.update(ring_backward_terms(m, layout, precision))
    elif m.sparse_attention is not None:  # the blocked engine's output, lse, fp32 dq, dk, dv
        attention_stage["block-sparse output and log-sum-exp"] = (
            z.attn * act + z.attn / m.head_dim * 4
        )
        attention_stage["block-sparse gradient accumulators (fp32)"] = z.qkv * 4
    if sum(mlp_stage.values()) > sum(attention_stage.values()):
        return mlp_stage
    return attention_stage


def ring_backward_terms(m: ModelConfig, layout: Layout, precision: Precision) -> dict[str, float]:
    """The ring attention's backward (model/attention/ring.py, _RingAttention.backward): its
    fp32 output kept for backward; dq and the travelling dk, dv accumulated in fp32, dk and dv
    twice (the block being added to and the one arriving), beside k and v packed for the ring
    and their spare. These replace the other paths' dq, dk, dv in the activation dtype;
    documents are masked inside the ring's units (no document loop)."""
    z = _sizes(m, layout)
    kv = z.qkv * 2 * m.query_groups / (m.num_attention_heads + 2 * m.query_groups)
    working = backward_working_bytes(m, layout, precision, "full") - z.qkv * precision.act
    return {
        "attention output (ring, fp32)": z.attn * 4,
        "backward working set (residual grads, d out, dq, dk, dv)": working,
        "ring backward (fp32 dq, dk and dv twice; k and v packed and their spare)": (
            (z.qkv + kv) * 4 + 2 * kv * precision.act
        ),
        "document attention backward": 0.0,
    }


def head_activation_bytes(m: ModelConfig, layout: Layout, precision: Precision) -> float:
    """Final norm's input and output (the output layer's input), and the logits the untiled
    vocab-parallel loss keeps for backward (in their own dtype, mpu/cross_entropy.py)."""
    z = _sizes(m, layout)
    logits = 0.0 if _loss_chunk(m, layout) else _logits_bytes(m, layout, z.s, precision.act)
    return z.norm * precision.residual + z.norm * precision.act + logits


def _loss_chunk(m: ModelConfig, layout: Layout) -> int | None:
    """--tiled-loss-chunk-size where it splits this rank's tokens, else None (not tiled)."""
    gathered = layout.tp if layout.sequence_parallel else 1
    chunk = m.tiled_loss_chunk_size
    return chunk if chunk and chunk < m.seq_length / layout.sequence_ranks / gathered else None


def _logits_bytes(m: ModelConfig, layout: Layout, rows: float, element: float = 4) -> float:
    """Logits of `rows` tokens on one TP rank (fp32 unless `element` says otherwise)."""
    return rows * layout.micro_batch_size * m.padded_vocab_size(layout.tp) / layout.tp * element


def _loss_rows(m: ModelConfig, layout: Layout) -> float:
    """Rows of logits the loss computes at once: a tiled chunk (all-gathered under
    Megatron-SP) or this rank's tokens."""
    chunk = _loss_chunk(m, layout)
    gathered = layout.tp if layout.sequence_parallel else 1
    return m.seq_length / layout.sequence_ranks if chunk is None else chunk * gathered


def _softmax_block_bytes(m: ModelConfig, layout: Layout, rows: float) -> float:
    """One fp32 block of rows of the softmax: the cross entropy computes exp(logits − max)
    block by block, forward and backward, never over the whole chunk (mpu/cross_entropy.py)."""
    local_vocab = m.padded_vocab_size(layout.tp) // layout.tp
    block_rows = max(1, ROW_BLOCK_ELEMENTS // local_vocab)
    return min(rows * layout.micro_batch_size, block_rows) * local_vocab * 4


def loss_working_bytes(
    m: ModelConfig, layout: Layout, precision: Precision = Precision(), backward: bool = True
) -> float:
    """The loss's short-lived buffers on the last stage, [rows, b, V/TP] in the activation
    dtype: tiled, one chunk's logits (recomputed in backward) and, in backward, their gradient;
    untiled, only the gradient (the logits are kept, head_activation_bytes). Besides them one
    fp32 block of the softmax's rows."""
    chunk, rows = _loss_chunk(m, layout), _loss_rows(m, layout)
    logits = _logits_bytes(m, layout, rows, precision.act)
    held = (0.0 if chunk is None else logits) + (logits if backward else 0.0)
    return held + _softmax_block_bytes(m, layout, rows)


def layer_forward_working_bytes(m: ModelConfig, layout: Layout, precision: Precision) -> float:
    """A layer's own forward beside its input (which is kept), at the larger of its attention
    projection (the input norm's output, the fused QKV output, q and k split out of it and
    their RoPE rotations, model/transformer.py's project; under --attention-block-tiles T one
    tile's of each, beside the assembled q, k, v) and its MLP (the post-attention residual,
    its norm's output and what the MLP, or one tiled chunk of it, makes)."""
    z, act = _sizes(m, layout), precision.act
    qk = (
        z.qkv
        * (m.num_attention_heads + m.query_groups)
        / (m.num_attention_heads + 2 * m.query_groups)
    )
    rotated = 2 * qk if m.position_embedding_type == "rope" else qk
    working = (z.norm + z.qkv + rotated) * act
    tiles = m.attention_block_tiles
    attention = working if tiles <= 1 else z.qkv * act + working / tiles
    shape = activation_shape(m, layout, precision)
    mlp = z.norm * (precision.residual + act) + described_layer(m).mlp.saved_bytes(shape)
    return max(attention, mlp)


def rope_table_bytes(m: ModelConfig, layout: Layout) -> float:
    """RoPE's fp32 cos and sin, [s, b, 1, d/2] each for this rank's s tokens (model/rotary.py:
    one angle per rotated pair), built once per forward and held by every layer's recompute
    until the last layer's backward; the rotation's fp32 temporaries are row blocks."""
    if m.position_embedding_type != "rope":
        return 0.0
    z = _sizes(m, layout)
    return 2 * z.s * layout.micro_batch_size * (m.head_dim // 2) * 4


def output_layer_gradient_bytes(m: ModelConfig, layout: Layout, precision: Precision) -> float:
    """One gradient of the output layer's weight in the model's dtype (a half-precision model
    adds it into its fp32 main_grad, counted with the gradients, and drops it,
    optim/mixed_precision.py; an fp32 model keeps it as .grad). Full-size under every ZeRO
    stage: backward makes it whole before any reduction."""
    return (2 if precision.half_model else 4) * _embedding_parameters(m, layout.tp)


def loss_backward_terms(
    m: ModelConfig, layout: Layout, precision: Precision, staging: float = 0.0
) -> tuple[float, float]:
    """(the loss's working set or the output layer's gradients, whichever is larger; the
    final hidden states' gradient) while the loss backpropagates. A chunk's cross entropy
    backward (logits, their gradient, one fp32 block), then its output layer's backward (the
    logits gone, their gradient not); autograd sums the output weight's gradients of all
    chunks in one buffer before accumulating it once (then `staging`, its host-held fp32 sum),
    and the final hidden states' gradient fills chunk by chunk."""
    output_grad = output_layer_gradient_bytes(m, layout, precision)
    chunk_grad = _logits_bytes(m, layout, _loss_rows(m, layout), precision.act)
    summed = output_grad if _loss_chunk(m, layout) else 0.0
    loss = loss_working_bytes(m, layout, precision)
    stage = max(loss + summed, chunk_grad + summed + output_grad, output_grad + staging)
    return stage, _sizes(m, layout).norm * precision.act


def kept_activation_bytes(
    m: ModelConfig,
    layout: Layout,
    precision: Precision,
    recompute: str,
    kernels: Kernels = Kernels(),
) -> tuple[float, float]:
    """(on the device, in host memory): what all layers of the busiest stage keep from
    forward to backward."""
    layers = -(-m.num_layers // layout.pp)
    in_flight = min(layout.pp, layout.num_micro_batches)
    per_layer = layer_activation_bytes(m, layout, precision, recompute, kernels)
    total = layers * in_flight * per_layer
    if recompute == "full" and m.activation_checkpoint_cpu_offload:
        device = min(total, 2 * per_layer)  # the one recomputed and the one prefetched
        return device, total
    return total, 0.0


def activation_bytes(
    m: ModelConfig,
    layout: Layout,
    precision: Precision,
    recompute: str = "none",
    kernels: Kernels = Kernels(),
) -> float:
    """Peak activation bytes on the busiest rank (the first pipeline stage): everything kept,
    the one layer rebuilt during a full-recompute backward, the head."""
    device, _ = kept_activation_bytes(m, layout, precision, recompute, kernels)
    if recompute == "full":
        device += layer_activation_bytes(m, layout, precision, "none", kernels)
    if layout.pp == 1:
        device += head_activation_bytes(m, layout, precision)
    return device


# ---- model state --------------------------------------------------------------------------------
def _model_state(
    params: int, layout: Layout, zero_stage: int, precision: Precision, kernels: Kernels
) -> tuple[float, float, float, float]:
    """(parameters, gradients on the device, optimizer state on the device, host bytes).
    ZeRO shards over dp × CP × SP (every replica of the weights). The optimizer's fp32 main
    parameters (half model) and Adam moments move to host memory for the offloaded fraction,
    and so do its fp32 gradients: a copy for the host step (ZeRO-1, an fp32 model), or, for a
    half-precision model under ZeRO-0, the accumulated main_grad itself (optim/host_grads.py)."""
    shards = layout.dp * layout.sp * layout.cp
    param_bytes = precision.param * params / (shards if zero_stage >= 3 else 1)
    grad_bytes = 4 * params / (shards if zero_stage >= 2 else 1)
    main = 4 if precision.half_model else 0  # fp32 main parameters
    stepped = params / (shards if zero_stage >= 1 else 1)
    optimizer = (8 + main) * stepped
    held = _host_held_gradient_fraction(zero_stage, precision, kernels)
    copied = 0.0 if zero_stage == 0 and precision.half_model else kernels.optimizer_offload
    host = kernels.optimizer_offload * optimizer + 4 * stepped * copied + held * grad_bytes
    device_optimizer = optimizer * (1 - kernels.optimizer_offload)
    return param_bytes, grad_bytes * (1 - held), device_optimizer, host


def _host_held_gradient_fraction(zero_stage: int, precision: Precision, kernels: Kernels) -> float:
    """The share of the fp32 gradients a GPU run keeps in host memory: a half-precision model's
    offloaded parameters under ZeRO-0 (ZeRO-1 reduce-scatters a device buffer; on a CPU run
    the host is the device)."""
    if zero_stage == 0 and precision.half_model and not kernels.host_is_device:
        return kernels.optimizer_offload
    return 0.0


def _host_gradient_staging_bytes(
    m: ModelConfig, layout: Layout, zero_stage: int, precision: Precision, kernels: Kernels
) -> tuple[float, float]:
    """Device bytes of host-held gradients in transit: (accumulation: the largest parameter's
    fp32 sum, staged once per micro-batch; reduction: one fp32 bucket, when dp_cp_sp > 1)."""
    if not _host_held_gradient_fraction(zero_stage, precision, kernels):
        return 0.0, 0.0
    largest = _largest_parameter(m, layout.tp)
    group = layout.dp * layout.sp * layout.cp
    bucket = min(bucket_elements(None, group), stage_parameters(m, layout.tp, layout.pp, layout.ep))
    return 4.0 * largest, 4.0 * bucket if group > 1 else 0.0


def _optimizer_working_bytes(
    m: ModelConfig, layout: Layout, stepped: float, kernels: Kernels
) -> float:
    """Temporaries of the step on the device: foreach AdamW's sqrt(exp_avg_sq) list (one
    per parameter under the per-tensor loop). The gradient norm holds one fp32 number per
    gradient (optim/grads.py: torch._foreach_norm), nothing that counts here."""
    largest = _largest_parameter(m, layout.tp)
    adam = stepped if kernels.foreach_optimizer else min(stepped, largest)
    adam *= FOREACH_ADAM_BYTES * (1 - kernels.optimizer_offload)
    return adam


# ---- totals -------------------------------------------------------------------------------------
def estimate(
    m: ModelConfig,
    layout: Layout,
    *,
    zero_stage: int = 0,
    recompute: str = "none",
    precision: Precision = Precision(),
    kernels: Kernels = Kernels(),
) -> MemoryEstimate:
    if recompute not in RECOMPUTE_CHOICES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_CHOICES} (got {recompute!r})")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero stage must be 0, 1, 2 or 3 (got {zero_stage})")
    params = stage_parameters(m, layout.tp, layout.pp, layout.ep)
    param_bytes, grad_bytes, optimizer_bytes, host_optimizer = _model_state(
        params, layout, zero_stage, precision, kernels
    )
    kept, host_kept = kept_activation_bytes(m, layout, precision, recompute, kernels)
    if kernels.host_is_device:  # a CPU run: the "host" copies are the tensors themselves
        kept = max(kept, host_kept)
        optimizer_bytes += host_optimizer
    per_layer_kept = layer_activation_bytes(m, layout, precision, recompute, kernels)
    head = head_activation_bytes(m, layout, precision) if layout.pp == 1 else 0.0
    last = layout.pp == 1
    loss = loss_working_bytes(m, layout, precision) if last else 0.0
    loss_forward = loss_working_bytes(m, layout, precision, backward=False) if last else 0.0
    rope = rope_table_bytes(m, layout)
    backward = backward_working_bytes(m, layout, precision, recompute)
    ring = ring_working_bytes(m, layout)
    documents = document_working_bytes(m, layout, precision, kernels)
    # A half-precision model's fp32 main_grad buffers exist from setup on (ZeRO-0/1:
    # optim/mixed_precision.py, distributed_optimizer.py), and so does ZeRO-2's fp32 gradient
    # shard (optim/zero2.py); an fp32 model's gradients appear in the first backward (the
    # embedding's last) and stay alive only across micro-batches.
    persistent_grads = (precision.half_model and zero_stage < 3) or zero_stage == 2
    # ZeRO-2 reduce-scatters a bucket as soon as backward completes it: its gradients in the
    # model's dtype and their fp32 flat copy live until the collective is done (one bucket;
    # --overlap-grad-reduce keeps up to zero2.IN_FLIGHT more in flight).
    group = layout.dp * layout.sp * layout.cp
    bucket = min(bucket_elements(None, group), params)
    zero2_bucket = (precision.param + 4) * bucket if zero_stage == 2 else 0.0
    grads_in_forward = grad_bytes if layout.num_micro_batches > 1 or persistent_grads else 0.0
    embedding_grad = (
        4
        * _embedding_parameters(m, layout.tp)
        / (layout.dp * layout.sp * layout.cp if zero_stage >= 2 else 1)
    )
    staging, reduction_staging = _host_gradient_staging_bytes(
        m, layout, zero_stage, precision, kernels
    )
    # A layer's parameters are staged one at a time as their gradients appear, each freed
    # once copied: measured, never alive at the layer backward's peak (its MLP's activation
    # backward or its attention's), so not counted there.
    # While a layer backpropagates: the persistent buffers left on the device (host-held
    # ones, only ever persistent ones, are the first parameters'), else every gradient but the
    # embedding's, which comes last.
    layer_grads = grad_bytes if persistent_grads else max(grad_bytes - embedding_grad, 0.0)
    stepped = params / (layout.dp * layout.sp * layout.cp if zero_stage >= 1 else 1)
    layer_phase = {
        "activations kept (other layers)": kept - (per_layer_kept if recompute == "full" else 0.0),
        **(
            layer_backward_terms(m, layout, precision, kernels)
            if recompute == "full"
            else {
                "backward working set": backward,
                "ring unit working set": ring,
                "document attention backward": documents,
            }
        ),
        "gradients (all but the embedding's)" if not persistent_grads else "gradients": layer_grads,
        "ZeRO-2 bucket being reduce-scattered": zero2_bucket,
        "RoPE tables": rope,
    }
    # A layer's forward and the head's do not coexist. Offloaded, every layer's input is in
    # host memory once its forward has run: the head and the loss run beside none of them.
    offloaded = recompute == "full" and m.activation_checkpoint_cpu_offload
    kept_at_head = 0.0 if offloaded and not kernels.host_is_device else kept
    layer_forward = layer_forward_working_bytes(m, layout, precision)
    head_forward = head + loss_forward
    # A ring unit runs inside a layer's attention, never beside the head and its loss.
    own_forward = kept + layer_forward + ring / 2 >= kept_at_head + head_forward
    forward_phase = {
        "activations kept": kept if own_forward else kept_at_head,
        "head and loss working set (or a layer's own forward)": (
            layer_forward if own_forward else head_forward
        ),
        "ring unit working set": ring / 2 if own_forward else 0.0,
        "gradients (accumulating)": grads_in_forward,
        "RoPE tables": rope,
    }
    loss_stage, hidden_grad = (
        loss_backward_terms(m, layout, precision, staging) if layout.pp == 1 else (0.0, 0.0)
    )
    loss_phase = {
        "activations kept": kept_at_head,
        "head": head,
        "loss working set (or the output layer's gradients)": loss_stage,
        "final hidden states' gradient": hidden_grad,
        "gradients (accumulating)": grads_in_forward,
        "RoPE tables": rope,
    }
    step_phase = {
        "gradients": grad_bytes,
        "optimizer step temporaries": _optimizer_working_bytes(m, layout, stepped, kernels),
    }
    reduction_phase = {
        "gradients": grad_bytes,
        "host-held gradient staging (one bucket)": (reduction_staging),
    }
    phases = {
        "forward": forward_phase,
        "loss backward": loss_phase,
        "layer backward": layer_phase,
        "optimizer": step_phase,
        **({"gradient reduction": reduction_phase} if reduction_staging else {}),
    }
    totals = {name: sum(terms.values()) for name, terms in phases.items()}
    peak = max(totals, key=totals.__getitem__)
    return MemoryEstimate(
        params,
        param_bytes,
        grad_bytes,
        optimizer_bytes,
        activation_bytes(m, layout, precision, recompute, kernels),
        host_kept + host_optimizer,
        loss,
        backward,
        phases=totals,
        terms={k: v for k, v in phases[peak].items() if v},
        host_in_peak=kernels.host_is_device,
    )


def init_peak_bytes(m: ModelConfig, layout: Layout, zero_stage: int = 0) -> float:
    """Peak during initialisation: a rank allocates only the fp32 parameters it holds (its TP
    slice and pipeline stage; under ZeRO-3 its shard over dp × CP × SP, the model being built on
    the meta device first) and computes them in place, plus the generator's bounded workspace
    (mpu/param_init.py). Nothing is drawn in full, on the host or on the GPU."""
    params = stage_parameters(m, layout.tp, layout.pp, layout.ep)
    shards = layout.dp * layout.sp * layout.cp if zero_stage >= 3 else 1
    return 4 * params / shards + WORKSPACE_BYTES


def layout_from_config(cfg: ResolvedConfig) -> Layout:
    p, t = cfg.parallel, cfg.train
    return Layout(
        tp=p.tensor_model_parallel_size,
        sp=p.ds_sequence_parallel_size,
        pp=p.pipeline_model_parallel_size,
        dp=max(p.data_parallel_size, 1),
        sequence_parallel=p.sequence_parallel,
        micro_batch_size=t.micro_batch_size,
        num_micro_batches=max(cfg.num_micro_batches, 1),
        cp=p.context_parallel_size,
        ep=p.expert_model_parallel_size,
    )


def estimate_config(cfg: ResolvedConfig) -> MemoryEstimate:
    """The estimate for a validated ResolvedConfig, the one front door: --bf16/--fp16 a
    half-precision model, --zero-stage (resolve() makes --use-distributed-optimizer stage 1),
    --recompute-granularity, --optimizer-cpu-offload, --reset-attention-mask."""
    return estimate(
        cfg.model,
        layout_from_config(cfg),
        zero_stage=cfg.parallel.zero_stage,
        recompute=recompute_of(cfg),
        precision=precision_of(cfg),
        kernels=kernels_of(cfg),
    )


# Kept free on every GPU for the CUDA context and allocator fragmentation.
RESERVE_GIB = 2.0


def memory_budget_bytes(gpu_memory_gb: float) -> float:
    """What an estimate may reach on a GPU of --gpu-memory-gb (GiB, as nvidia-smi's total:
    80 for an H100 80GB), RESERVE_GIB kept free."""
    return (gpu_memory_gb - RESERVE_GIB) * GiB


def with_layout(cfg: ResolvedConfig, sp: int, dp: int) -> ResolvedConfig:
    """cfg on SP × DP ranks (TP, CP, PP and each replica's micro-batches kept): a new
    --ds-sequence-parallel-size, --world-size and --global-batch-size."""
    planned = copy.deepcopy(cfg)
    p = planned.parallel
    p.ds_sequence_parallel_size = sp
    p.world_size = p.tensor_model_parallel_size * sp * p.context_parallel_size
    p.world_size *= p.pipeline_model_parallel_size * dp
    planned.train.global_batch_size = cfg.train.micro_batch_size * cfg.num_micro_batches * dp
    return planned


def layout_flags(cfg: ResolvedConfig) -> str:
    """The flags with_layout sets, as a command line takes them."""
    p = cfg.parallel
    return (
        f"--world-size {p.world_size} --ds-sequence-parallel-size {p.ds_sequence_parallel_size} "
        f"--global-batch-size {cfg.train.global_batch_size}"
    )


def smallest_fitting_layout(
    cfg: ResolvedConfig, gpu_memory_gb: float, *, max_world: int = 65536
) -> tuple[ResolvedConfig, MemoryEstimate] | None:
    """The fewest GPUs whose estimate fits memory_budget_bytes(gpu_memory_gb): cfg with the
    Ulysses degree raised over the values the config rules accept (it divides the heads per
    TP rank and the sequence), and the data-parallel degree, which shrinks the state only
    under ZeRO, in powers of two; TP, CP, PP and each replica's micro-batches kept. Returns
    (the config, its estimate), or None."""
    budget = memory_budget_bytes(gpu_memory_gb)
    # What the rules say of the resolved config itself (not of its flags as given) is no
    # reason to refuse a candidate.
    known = set(problems(cfg))
    heads_per_tp = cfg.model.num_attention_heads // cfg.parallel.tensor_model_parallel_size
    best: tuple[ResolvedConfig, MemoryEstimate] | None = None
    for sp in range(1, heads_per_tp + 1):
        dp = 1
        while True:
            planned = with_layout(cfg, sp, dp)
            if planned.parallel.world_size > max_world or set(problems(planned)) - known:
                break
            est = estimate_config(planned)
            if est.total_bytes <= budget:
                if best is None or planned.parallel.world_size < best[0].parallel.world_size:
                    best = (planned, est)
                break
            if cfg.parallel.zero_stage == 0:
                break  # more data parallelism does not shrink anything without ZeRO
            dp *= 2
    return best


def precision_of(cfg: ResolvedConfig) -> Precision:
    """--bf16/--fp16 put the model itself in half precision (Megatron's meaning)."""
    t = cfg.train
    return Precision(half_model=bool(t.bf16 or t.fp16), fp32_residual=t.fp32_residual_connection)


def kernels_of(cfg: ResolvedConfig) -> Kernels:
    t = cfg.train
    offload = t.optimizer_offload_fraction if t.optimizer_cpu_offload else 0.0
    return Kernels(documents=bool(cfg.data.reset_attention_mask), optimizer_offload=offload)


def recompute_of(cfg: ResolvedConfig) -> str:
    """--recompute-granularity, 'none' when not given."""
    return cfg.model.recompute_granularity or "none"
