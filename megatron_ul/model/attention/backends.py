"""Which attention kernel runs a call: an ordered table of backends and one `select`.

A backend is one class (`AttentionBackend`): the paths it serves, why it refuses a call (None:
it takes it), what it keeps for backward, and its forward. `select(call)` asks the table's rows
that serve the call's path in order and builds the first that takes it; the run, the log line,
--dry-run and the start-up check all ask it, so what they name is what runs. A new kernel is
one class and one row in `TABLE`.

  flash-attn            flash_attn_func (causal, window_size)
  flash-attn varlen     flash_attn_varlen_func (documents, window_size)
  document tiles        documents / window on CUDA without flash-attn: query tiles of 512 on
                        torch's efficient kernel, a few calls per tile whatever the number
                        of documents (document_tiles.py)
  document blocks       documents / window on the CPU (and fp64 with attention dropout): one
                        block per document or query block (documents.py)
  sdpa cudnn            torch SDPA, its cuDNN kernel (CUDA fp16/bf16; first on sm90 and sm100)
  sdpa flash            torch SDPA, its flash kernel (CUDA fp16/bf16; GQA inside the kernel)
  sdpa efficient        torch SDPA, its memory-efficient kernel (CUDA fp32; GQA by expanding
                        k/v first, since the kernel takes equal head counts only)
  sdpa math             torch SDPA's math kernel (the N×N scores; refused for a run)
  sdpa cpu-flash        torch SDPA on CPU (its fused flash kernel, any float dtype; its math
                        kernel with attention dropout, where the log says "sdpa math")
  block-sparse <mode>: <dense>/<masked>
                        --sparse-attention: the layout's blocks on the blocked engine, on the
                        unit kernels of `UNIT_KERNELS` (block_sparse.py); "ring block-sparse"
                        across the ring, units with no block skipped (block_sparse_ring.py)
  ring: <dense>/<masked> the ring's unit kernels (lse_kernels.py) for unmasked units and for
                        units the window or documents cut through, chosen from `UNIT_KERNELS`

The log says once per path and kernel what ran, with the device and, where --use-flash-attn
was given and flash-attn does not run, why:

  attention: causal = sdpa cpu-flash (cpu)
  attention: causal = sdpa flash (cuda sm90, cuDNN 91900; dropout 0.1)
  attention: documents + window 64 = document blocks (cpu)
  attention: ring unit kernel = cpu-flash / cpu-flash (cpu; --use-flash-attn given, but ...)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from . import lse_kernels
from .block_sparse import LayerSparsity, SparseHeads, block_sparse_attention
from .block_sparse_ring import SparseRingPlan, block_sparse_ring_attention
from .blocks import Kernels
from .dispatch import (
    HALF_DTYPES,
    HEAD_DIM_FLAGS,
    MODELLED_GPUS,
    AttentionCall,
    gpu_of,
    sdpa_backend_of,
)
from .document_tiles import tiled_document_attention
from .documents import BlockwiseAttention, DocumentMask, document_blocks, flash_documents
from .flash_attn import FLASH_DTYPES, dtype_refusal, flash_attn_refusal, unit_head_dim_refusal
from .local import flash_causal, sdpa_causal
from .lse_kernels import UnitKernel
from .ring import Ring, run_ring

log = logging.getLogger(__name__)

_announced: set = set()


def announce_once(message: str) -> None:
    if message not in _announced:
        log.info("attention: %s", message)
        _announced.add(message)


class AttentionRefused(ValueError):
    """No backend of the table takes the call (the message names the flags to change)."""


def path_of(call: AttentionCall) -> str:
    """'sparse' or 'sparse ring' (block-sparse), 'ring', 'documents' (documents and/or a
    window) or 'causal'."""
    if call.sparse is not None:
        return "sparse ring" if call.ring else "sparse"
    if call.ring:
        return "ring"
    return "documents" if call.documents or call.window is not None else "causal"


# ---- the protocol --------------------------------------------------------------------------
class AttentionBackend:
    """One kernel as the selection sees it. `refusal` and `build` are asked with the call's
    description; `forward` runs q [N, b, hq, d], k, v [N, b, hk, d] -> [N, b, hq, d] on whole
    heads (after the Ulysses exchange), the documents as offsets, the ring's neighbours where
    the call is a ring call."""

    paths: ClassVar[frozenset[str]] = frozenset()
    keeps: ClassVar[tuple[str, ...]] = ("q", "k", "v")  # what it saves for backward
    uses_flash_attn: bool = False

    @classmethod
    def refusal(cls, call: AttentionCall) -> str | None:
        raise NotImplementedError

    @classmethod
    def build(cls, call: AttentionCall) -> AttentionBackend:
        return cls()

    @property
    def name(self) -> str:
        raise NotImplementedError

    @property
    def log_name(self) -> str:
        return self.name

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        call: AttentionCall,
        *,
        documents: DocumentMask | None,
        ring: Ring | None,
        softmax_scale: float | None,
    ) -> torch.Tensor:
        raise NotImplementedError


def _flash_refusal(call: AttentionCall) -> str | None:
    if not call.use_flash_attn:
        return "--use-flash-attn not given"
    return flash_attn_refusal(call.device, call.dtype, call.flash_attn_installed)


class FlashAttn(AttentionBackend):
    paths = frozenset({"causal", "documents"})
    keeps = ("q", "k", "v", "out", "lse")
    uses_flash_attn = True
    name = "flash-attn"

    @classmethod
    def refusal(cls, call):
        if call.documents:
            return "documents take the varlen kernel"
        return _flash_refusal(call)

    def forward(self, q, k, v, call, *, documents, ring, softmax_scale):
        if call.window is None:
            return flash_causal(q, k, v, dropout_p=call.dropout, softmax_scale=softmax_scale)
        return flash_documents(q, k, v, None, call.window, call.dropout, softmax_scale)


class FlashAttnVarlen(FlashAttn):
    paths = frozenset({"documents"})
    name = "flash-attn varlen"

    @classmethod
    def refusal(cls, call):
        return _flash_refusal(call) if call.documents else "no documents"

    def forward(self, q, k, v, call, *, documents, ring, softmax_scale):
        return flash_documents(q, k, v, documents, call.window, call.dropout, softmax_scale)


@dataclass(frozen=True)
class DocumentTiles(AttentionBackend):
    kernel: UnitKernel = lse_kernels.SDPA_EFFICIENT
    paths: ClassVar[frozenset[str]] = frozenset({"documents"})
    keeps: ClassVar[tuple[str, ...]] = ("q", "k", "v", "out", "lse")
    name = "document tiles"

    @classmethod
    def refusal(cls, call):
        if call.device.type != "cuda":
            return f"tensors on {call.device.type} (the tiles run on CUDA's fused kernels)"
        kernel = unit_kernel(call, masked=True)
        if isinstance(kernel, str):
            return kernel
        if call.dropout > 0 and kernel is not lse_kernels.SDPA_EFFICIENT:
            return "attention dropout (the tiles take it on torch's efficient kernel only)"
        return None

    @classmethod
    def build(cls, call):
        kernel = unit_kernel(call, masked=True)
        assert not isinstance(kernel, str)
        return cls(kernel)

    def forward(self, q, k, v, call, *, documents, ring, softmax_scale):
        return tiled_document_attention(
            q, k, v, documents, call.window, softmax_scale, self.kernel, dropout_p=call.dropout
        )


class DocumentBlocks(AttentionBackend):
    paths = frozenset({"documents"})
    name = "document blocks"

    @classmethod
    def refusal(cls, call):
        return None

    def forward(self, q, k, v, call, *, documents, ring, softmax_scale):
        n, b = q.shape[:2]
        offsets = documents.offsets if documents is not None else list(range(0, b * n + 1, n))
        blocks = document_blocks(offsets, n, call.window)
        return BlockwiseAttention.apply(q, k, v, blocks, call.window, call.dropout, softmax_scale)


@dataclass(frozen=True)
class TorchSdpa(AttentionBackend):
    """torch SDPA, causal: on CUDA pinned to the backend modelled from torch 2.11's choice
    (dispatch.sdpa_backend_of), on the CPU torch's own choice."""

    backend: str | None = None  # the pinned CUDA backend; None: torch chooses (the CPU)
    expand_kv: bool = False  # k, v repeated to q's heads first (the efficient kernel)
    label: str = "sdpa"
    paths: ClassVar[frozenset[str]] = frozenset({"causal"})

    @classmethod
    def refusal(cls, call):
        return None

    @classmethod
    def build(cls, call):
        if call.device.type == "cpu":
            # sdp_utils_cpp.cpp `use_flash_attention_cpp` runs `check_for_dropout`: with
            # attention dropout torch's CPU SDPA takes its math kernel.
            return cls(None, False, "sdpa math" if call.dropout > 0 else "sdpa cpu-flash")
        if call.device.type != "cuda":
            return cls()
        backend, expand = sdpa_backend_of(call)
        return cls(backend, expand, f"sdpa {backend}")

    @property
    def name(self) -> str:
        return self.label

    @property
    def runs_math(self) -> bool:
        """On CUDA: SDPA's math kernel (N×N scores) or no kernel at all."""
        return self.backend in ("math", "none")

    def forward(self, q, k, v, call, *, documents, ring, softmax_scale):
        return sdpa_causal(
            q,
            k,
            v,
            backend=None if self.backend == "none" else self.backend,
            expand_kv=self.expand_kv,
            dropout_p=call.dropout,
            softmax_scale=softmax_scale,
        )


# ---- the ring's unit kernels: an ordered table of their own -------------------------------
def _flash_unit_refusal(call: AttentionCall, masked: bool) -> str | None:
    if masked:
        return "flash-attn's unit kernel takes no bias"
    return _flash_refusal(call) or unit_head_dim_refusal(call.head_dim)


def _cpu_flash_refusal(call: AttentionCall, masked: bool) -> str | None:
    return None if call.device.type == "cpu" else f"tensors on {call.device.type}"


def _efficient_refusal(call: AttentionCall, masked: bool) -> str | None:
    if call.device.type != "cuda":
        return f"tensors on {call.device.type}"
    if call.dtype == torch.float64:
        return "fp64 (the softmax written out takes it)"
    alignment = 8 if call.dtype in HALF_DTYPES else 4
    if call.dtype not in (torch.float32, *HALF_DTYPES) or call.head_dim % alignment:
        return (
            f"ring attention on CUDA needs fp32/fp16/bf16 activations and a head "
            f"dim divisible by {alignment} (got {call.head_dim} in "
            f"{str(call.dtype).replace('torch.', '')}): change {HEAD_DIM_FLAGS}"
        )
    return None


def _reference_refusal(call: AttentionCall, masked: bool) -> str | None:
    if call.device.type == "cuda" and call.dtype != torch.float64:
        return "the softmax written out keeps a unit's scores (fp64 only on CUDA)"
    return None


UNIT_KERNELS: tuple[tuple[UnitKernel, Callable[[AttentionCall, bool], str | None]], ...] = (
    (lse_kernels.FLASH_ATTN, _flash_unit_refusal),
    (lse_kernels.CPU_FLASH, _cpu_flash_refusal),
    (lse_kernels.SDPA_EFFICIENT, _efficient_refusal),
    (lse_kernels.REFERENCE, _reference_refusal),
)


def unit_kernel(call: AttentionCall, masked: bool) -> UnitKernel | str:
    """The first unit kernel that takes the call's blocks (masked: with a bias), or why none
    does (the torch kernel's refusal, which names the flags)."""
    reasons = []
    for kernel, refusal in UNIT_KERNELS:
        why = refusal(call, masked)
        if why is None:
            return kernel
        reasons.append(why)
    # where none does, the torch kernel's reason names the flags to change
    return next((why for why in reasons if HEAD_DIM_FLAGS in why), reasons[-1])


@dataclass(frozen=True)
class RingUnits(AttentionBackend):
    dense: UnitKernel = lse_kernels.CPU_FLASH
    masked: UnitKernel = lse_kernels.CPU_FLASH
    cut: bool = False  # the documents or the window cut through some units
    paths: ClassVar[frozenset[str]] = frozenset({"ring"})
    keeps: ClassVar[tuple[str, ...]] = ("q", "k", "v", "out", "lse")

    @classmethod
    def refusal(cls, call):
        for masked in (False, True):
            kernel = unit_kernel(call, masked)
            if isinstance(kernel, str):
                return kernel
        return None

    @classmethod
    def build(cls, call):
        dense, masked = unit_kernel(call, False), unit_kernel(call, True)
        assert not isinstance(dense, str) and not isinstance(masked, str)
        return cls(dense, masked, call.documents or call.window is not None)

    @property
    def uses_flash_attn(self) -> bool:  # type: ignore[override]
        return self.dense is lse_kernels.FLASH_ATTN

    @property
    def log_name(self) -> str:
        return self.dense.name + (f" / {self.masked.name}" if self.cut else "")

    @property
    def name(self) -> str:
        return "ring: " + self.log_name

    def forward(self, q, k, v, call, *, documents, ring, softmax_scale):
        assert ring is not None, "a ring call needs the ring"
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        return run_ring(
            q,
            k,
            v,
            ring,
            self.dense,
            self.masked,
            window=call.window,
            documents=documents,
            scale=scale,
        )


class BlockSparse(AttentionBackend):
    """Block-sparse attention on whole heads: the layout's blocks on the blocked engine
    (block_sparse.py), on the unit kernels the table chooses for the blocks (`masked`: those
    the documents or the window cut through). Keeps one plan per sequence length."""

    paths: ClassVar[frozenset[str]] = frozenset({"sparse"})
    keeps: ClassVar[tuple[str, ...]] = ("q", "k", "v", "out", "lse")

    def __init__(self, sparse: SparseHeads, kernels: Kernels, cut: bool):
        self.sparse, self.kernels, self.cut = sparse, kernels, cut
        self.layouts = LayerSparsity(sparse.pattern, sparse.num_heads, sparse.seed, sparse.layer)
        self._ring_plans: dict = {}

    @classmethod
    def refusal(cls, call):
        if call.dropout > 0:
            return "block-sparse attention takes no attention dropout: set --attention-dropout 0"
        return RingUnits.refusal(call)

    @classmethod
    def build(cls, call):
        dense, masked = unit_kernel(call, False), unit_kernel(call, True)
        assert not isinstance(dense, str) and not isinstance(masked, str)
        assert call.sparse is not None
        return cls(call.sparse, Kernels(dense, masked), call.documents or call.window is not None)

    @property
    def uses_flash_attn(self) -> bool:  # type: ignore[override]
        return self.kernels.full is lse_kernels.FLASH_ATTN

    @property
    def log_name(self) -> str:
        return self.kernels.full.name + (f" / {self.kernels.masked.name}" if self.cut else "")

    @property
    def name(self) -> str:
        return f"block-sparse {self.sparse.pattern.mode}: {self.log_name}"

    def heads(self, q: torch.Tensor) -> range:
        return range(self.sparse.first, self.sparse.first + q.shape[2])

    def forward(self, q, k, v, call, *, documents, ring, softmax_scale):
        plan = self.layouts.plan(q.shape[0], self.heads(q), k.shape[2])
        return block_sparse_attention(
            q, k, v, plan, kernels=self.kernels, documents=documents, window=call.window,
            softmax_scale=softmax_scale,
        )  # fmt: skip


class BlockSparseRing(BlockSparse):
    """Block-sparse attention across the ring: the ring's steps with each unit's piece of the
    layout as blocks (block_sparse_ring.py); units with no block are skipped."""

    paths: ClassVar[frozenset[str]] = frozenset({"sparse ring"})

    @property
    def name(self) -> str:
        return f"ring block-sparse {self.sparse.pattern.mode}: {self.log_name}"

    def forward(self, q, k, v, call, *, documents, ring, softmax_scale):
        assert ring is not None, "a ring call needs the ring"
        key = (q.shape[0], k.shape[2])
        if key not in self._ring_plans:
            s, n = self.sparse, q.shape[0] * ring.size
            self._ring_plans[key] = SparseRingPlan(
                s.pattern, s.num_heads, self.heads(q), k.shape[2], n, ring, s.seed, s.layer
            )
        return block_sparse_ring_attention(
            q, k, v, ring, self._ring_plans[key], self.kernels, documents=documents,
            window=call.window, softmax_scale=softmax_scale,
        )  # fmt: skip


# The order is the preference: the first row serving the call's path that takes it runs.
TABLE: tuple[type[AttentionBackend], ...] = (
    BlockSparseRing,
    BlockSparse,
    RingUnits,
    FlashAttnVarlen,
    FlashAttn,
    DocumentTiles,
    DocumentBlocks,
    TorchSdpa,
)


def select(call: AttentionCall) -> AttentionBackend:
    """The backend that runs `call`: the first row of TABLE serving its path that takes it.
    Raises AttentionRefused with the rows' reasons where none does."""
    path = path_of(call)
    reasons = []
    for row in TABLE:
        if path not in row.paths:
            continue
        why = row.refusal(call)
        if why is None:
            return row.build(call)
        reasons.append(why)
    raise AttentionRefused(reasons[-1] if reasons else f"no attention backend serves {path}")


def attention_kernel(call: AttentionCall) -> str:
    """The name of the kernel that runs `call` (the names in this module's docstring)."""
    return select(call).name


def kernel_refusal(call: AttentionCall) -> str | None:
    """Why `call` has no fused kernel (a message naming the flags to change), or None: on
    CUDA a head dim that SDPA's fused kernels all refuse would run its math kernel (the N×N
    scores), and the ring's unit kernels refuse it outright."""
    try:
        backend = select(call)
    except AttentionRefused as refused:
        return str(refused)
    if call.device.type != "cuda" or not (isinstance(backend, TorchSdpa) and backend.runs_math):
        return None
    wanted = "at most 256 or a multiple of 8" if call.dtype in HALF_DTYPES else "a multiple of 4"
    return (
        f"no fused attention kernel on CUDA takes head dim {call.head_dim} in "
        f"{str(call.dtype).replace('torch.', '')}: torch SDPA would run its math kernel "
        f"(N×N scores); change {HEAD_DIM_FLAGS} so that the head dim is {wanted}"
    )


def attention_path(call: AttentionCall) -> str:
    """The path a call belongs to, for the log: causal, documents, window W, ring unit kernel."""
    if call.sparse is not None:
        parts = [("ring " if call.ring else "") + f"block-sparse {call.sparse.pattern.mode}"]
        parts += (["documents"] if call.documents else []) + (
            [f"window {call.window}"] if call.window is not None else []
        )
        return " + ".join(parts)
    if call.ring:
        return "ring unit kernel"
    parts = (["documents"] if call.documents else []) + (
        [f"window {call.window}"] if call.window is not None else []
    )
    return " + ".join(parts) or "causal"


def decide(call: AttentionCall) -> AttentionBackend:
    """select(call), logged once per path and kernel with the device (on CUDA its capability
    and cuDNN, and the dropout) and, where --use-flash-attn was given and flash-attn does not
    run, why."""
    backend = select(call)
    where = call.device.type
    if call.device.type == "cuda":
        gpu = gpu_of(call)
        where += f" {gpu.name}, cuDNN {gpu.cudnn_version}"
        if call.dropout > 0:
            where += f"; dropout {call.dropout:g}"
    if call.use_flash_attn and not backend.uses_flash_attn:
        why = (
            flash_attn_refusal(call.device, call.dtype, call.flash_attn_installed)
            or "flash-attn refuses this head dim"
        )
        where += f"; --use-flash-attn given, but {why}"
    announce_once(f"{attention_path(call)} = {backend.log_name} ({where})")
    return backend


# ---- what --dry-run reports ----------------------------------------------------------------
def planned_kernels(call: AttentionCall) -> dict[tuple[str, bool], str]:
    """{(GPU, flash-attn installed): kernel} of `call` on each modelled GPU (MODELLED_GPUS,
    torch 2.11's bundled cuDNN) with and without flash-attn: select's answers."""
    cuda = torch.device("cuda")
    return {
        (name, installed): attention_kernel(
            replace(call, device=cuda, gpu=gpu, flash_attn_installed=installed)
        )
        for name, gpu in MODELLED_GPUS.items()
        for installed in (False, True)
    }


def _per_gpu(kernels: dict[tuple[str, bool], str], installed: bool) -> str:
    """One kernel, or 'K1 on GPU1, K2 on GPU2' where the GPUs differ."""
    by_gpu = {name: k for (name, inst), k in kernels.items() if inst == installed}
    if len(set(by_gpu.values())) == 1:
        return next(iter(by_gpu.values()))
    return ", ".join(f"{k} on {name}" for name, k in by_gpu.items())


def _planned_text(call: AttentionCall) -> str:
    kernels = planned_kernels(call)
    without = _per_gpu(kernels, False)
    if not call.use_flash_attn:
        return without
    if call.dtype not in FLASH_DTYPES:
        return f"{without} (--use-flash-attn given, but {dtype_refusal(call.dtype)})"
    with_flash = _per_gpu(kernels, True)
    if with_flash == without:
        return without
    return f"{with_flash} where flash-attn is installed, else {without}"


def planned_kernel(call: AttentionCall) -> str:
    """What --dry-run reports for the run's attention call (its own dropout; the device is
    ignored): the kernel on each modelled GPU, with and without flash-attn, and the kernel of
    evaluation (no dropout, no backward) where it differs."""
    training = _planned_text(call)
    if call.dropout == 0:
        return training
    evaluation = _planned_text(replace(call, dropout=0.0, requires_grad=False))
    if evaluation == training:
        return training
    return f"{training}; in evaluation (no dropout): {evaluation}"
