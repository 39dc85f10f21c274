"""Running attention: one layer's attention on whole heads (`LayerAttention`), which builds
its call's description once and asks backends.select once per kind of micro-batch, and the
one-call entry points of tests and tools. Ulysses (ulysses.py) wraps a LayerAttention in its
all-to-alls; the ring's p2p runs inside the ring backend.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ...mpu.random import get_rng_tracker
from ...mpu.recompute import checkpoint
from . import backends
from .backends import AttentionBackend
from .block_sparse import SparseHeads
from .dispatch import AttentionCall
from .documents import DocumentMask
from .local import require_one_dtype
from .ring import Ring


def model_call(
    m,
    device: torch.device,
    dtype: torch.dtype,
    *,
    tp: int,
    sp: int,
    cp: int,
    documents: bool,
    sparse: SparseHeads | None = None,
) -> AttentionCall:
    """The call every layer of a model makes in training: per-rank head counts after the
    Ulysses exchange, the full sequence, the model's window, flash-attn request and dropout,
    and the block-sparse pattern. `m`: the model configuration (config.ModelConfig); `sparse`:
    the layer's own heads, seed and number (default: the pattern on heads from 0, which
    selects the same kernel)."""
    if sparse is None:
        sparse = SparseHeads.of(m)
    q_heads = m.num_attention_heads // (tp * sp)
    kv_heads = max(q_heads * m.query_groups // m.num_attention_heads, 1)
    return AttentionCall(
        device,
        dtype,
        m.head_dim,
        q_heads,
        kv_heads,
        documents,
        m.attention_window,
        cp > 1,
        m.use_flash_attn,
        dropout=m.attention_dropout,
        seq_length=m.seq_length,
        sparse=sparse,
    )


# ---- running a call ------------------------------------------------------------------------
def attend(
    backend: AttentionBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    call: AttentionCall,
    *,
    documents: DocumentMask | None = None,
    ring: Ring | None = None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Run the selected backend on whole heads."""
    require_one_dtype(q, k, v)
    if documents is not None and documents.seq_length != q.shape[0] * (ring.size if ring else 1):
        raise ValueError(
            f"document offsets are for sequences of {documents.seq_length} tokens, "
            f"attention got {q.shape[0]}"
        )
    if call.ring or call.sparse is not None:
        # The kernels run in the activation dtype with fp32 accumulation whatever autocast
        # says: autocast would recast the forward's inputs and not the backward's. (Neither
        # takes attention dropout: no random stream.)
        with torch.autocast(q.device.type, enabled=False):
            return backend.forward(
                q, k, v, call, documents=documents, ring=ring, softmax_scale=softmax_scale
            )
    # Dropout on attention probabilities of this rank's heads: a per-(TP, SP)-rank stream.
    with get_rng_tracker().fork():
        return backend.forward(
            q, k, v, call, documents=documents, ring=ring, softmax_scale=softmax_scale
        )


class LayerAttention:
    """One layer's attention on whole heads. Its call's description is built once (from the
    model configuration where the layer has one); per micro-batch only what the tensors and
    the step say is filled in (length, documents or not, dropout, backward or not), and the
    backend selected for each such key is kept, so the table is asked once per key."""

    def __init__(
        self,
        call: AttentionCall | None = None,
        *,
        use_flash_attn: bool = False,
        window: int | None = None,
        ring: Ring | None = None,
        recompute: bool = False,
    ):
        self.ring = ring if ring is not None and ring.size > 1 else None
        self.template = call
        self.use_flash_attn = use_flash_attn if call is None else call.use_flash_attn
        self.window = window if call is None else call.window
        self.sparse = None if call is None else call.sparse
        self.recompute = recompute  # selective recompute: keep only q, k, v of the kernel
        self._selected: dict = {}

    def use_sparse_heads(self, sparse: SparseHeads | None) -> None:
        """Block-sparse attention on this layer's own layouts (its heads, seed and number)."""
        self.sparse = sparse
        self._selected.clear()

    def call_for(
        self, q, k, documents: bool, dropout_p: float
    ) -> tuple[AttentionCall, AttentionBackend]:
        """The call of these tensors and the backend selected for it (once per key)."""
        requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k))
        key = (q.device, q.dtype, q.shape, k.shape[2], documents, dropout_p, requires_grad)
        if key not in self._selected:
            base = self.template or AttentionCall(
                q.device, q.dtype, q.shape[-1], q.shape[2], k.shape[2]
            )
            call = replace(
                base,
                device=q.device,
                dtype=q.dtype,
                head_dim=q.shape[-1],
                q_heads=q.shape[2],
                kv_heads=k.shape[2],
                documents=documents,
                window=self.window,
                ring=self.ring is not None,
                sparse=self.sparse,
                use_flash_attn=self.use_flash_attn,
                dropout=dropout_p,
                seq_length=q.shape[0] * (self.ring.size if self.ring else 1),
                requires_grad=requires_grad,
            )
            self._selected[key] = (call, backends.decide(call))
        return self._selected[key]

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        dropout_p: float,
        documents: DocumentMask | None = None,
    ) -> torch.Tensor:
        if documents is not None and not isinstance(documents, DocumentMask):
            raise TypeError(
                "attention takes the documents as a DocumentMask (offsets), not a "
                f"dense mask (got {type(documents).__name__})"
            )
        call, backend = self.call_for(q, k, documents is not None, dropout_p)

        def run(q_, k_, v_):
            return attend(backend, q_, k_, v_, call, documents=documents, ring=self.ring)

        # The ring and block-sparse attention save only q, k, v, out and the log-sum-exp
        # already: nothing to recompute.
        if self.recompute and self.ring is None and call.sparse is None:
            return checkpoint(run, q, k, v)
        return run(q, k, v)


# ---- one-call entry points (tests, tools) --------------------------------------------------
def _one_call(q, k, use_flash_attn, dropout_p, documents, window, ring) -> AttentionCall:
    return AttentionCall(
        q.device,
        q.dtype,
        q.shape[-1],
        q.shape[2],
        k.shape[2],
        documents is not None,
        window,
        ring=ring is not None,
        use_flash_attn=use_flash_attn,
        dropout=dropout_p,
        seq_length=q.shape[0] * (ring.size if ring is not None else 1),
        requires_grad=torch.is_grad_enabled() and any(t.requires_grad for t in (q, k)),
    )


def local_attention(
    q, k, v, *, backend: str, dropout_p: float, softmax_scale: float | None = None
) -> torch.Tensor:
    """Causal attention of one call. q [N, b, hq, d]; k, v [N, b, hk, d]; backend 'flash':
    --use-flash-attn. Returns [N, b, hq, d] in q's dtype."""
    require_one_dtype(q, k, v)
    call = _one_call(q, k, backend == "flash", dropout_p, None, None, None)
    return attend(backends.decide(call), q, k, v, call, softmax_scale=softmax_scale)


def document_attention(
    q,
    k,
    v,
    *,
    backend: str,
    dropout_p: float,
    documents: DocumentMask | None = None,
    window: int | None = None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Causal attention restricted to documents and/or a window of `window` earlier keys.
    q [N, b, hq, d]; k, v [N, b, hk, d], N the full sequence. Returns [N, b, hq, d]."""
    require_one_dtype(q, k, v)
    call = _one_call(q, k, backend == "flash", dropout_p, documents, window, None)
    return attend(
        backends.decide(call), q, k, v, call, documents=documents, softmax_scale=softmax_scale
    )


def ring_attention(
    q,
    k,
    v,
    ring: Ring,
    *,
    documents: DocumentMask | None = None,
    window: int | None = None,
    softmax_scale: float | None = None,
    backend: str = "sdpa",
) -> torch.Tensor:
    """Causal attention of this ring rank's local sequence (chunks r and 2R-1-r) against the
    whole sequence. q [L, b, hq, d]; k, v [L, b, hk, d]; returns [L, b, hq, d] in q's dtype.
    documents: the full sequence's DocumentMask. window: query i sees keys i-window..i."""
    if documents is not None and not isinstance(documents, DocumentMask):
        raise TypeError(
            "ring attention takes the documents as a DocumentMask (offsets), not a "
            f"dense mask (got {type(documents).__name__})"
        )
    require_one_dtype(q, k, v)
    call = _one_call(q, k, backend == "flash", 0.0, documents, window, ring)
    return attend(
        backends.decide(call),
        q,
        k,
        v,
        call,
        documents=documents,
        ring=ring,
        softmax_scale=softmax_scale,
    )
