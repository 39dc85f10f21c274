"""Which attention kernel runs: one decision, made per call, reported by the log and --dry-run.

The mask travels from the data to the kernel in one form: the documents' offsets
(DocumentMask, cu_seqlens) and the window (--window-size LEFT,0). `attention_kernel` maps a
call (device, dtype, head dim, heads, documents, window, ring, --use-flash-attn) to one of

  flash-attn            flash_attn_func (causal, window_size)
  flash-attn varlen     flash_attn_varlen_func (documents, window_size)
  sdpa flash            torch SDPA, its flash kernel (CUDA fp16/bf16; GQA inside the kernel)
  sdpa efficient        torch SDPA, its memory-efficient kernel (CUDA fp32; GQA by expanding
                        k/v first, since the kernel takes equal head counts only)
  sdpa cpu-flash        torch SDPA on CPU (its fused flash kernel, any float dtype)
  document tiles        documents / window on CUDA without flash-attn: query tiles of 512 on
                        torch's efficient kernel, a few calls per tile whatever the number
                        of documents (tiled_document_attention.py)
  document blocks       documents / window on the CPU (and with attention dropout): SDPA
                        once per document or query block (document_attention.py)
  ring: <dense>/<masked> the ring's unit kernels (lse_kernels.py) for unmasked units and for
                        units the window or documents cut through

Every call site (local_attention, document_attention, ring_attention) runs what `decide`
returns, and `decide` logs it once per attention path and kernel, so the log names what ran:

  attention: causal = sdpa cpu-flash (cpu)
  attention: documents + window 64 = document blocks (cpu)
  attention: ring unit kernel = cpu-flash / cpu-flash (cpu; --use-flash-attn given, but ...)

`sdpa_cuda_backend` is a stand-in of torch's own CUDA backend selection rules (sdp_utils.cpp:
flash needs fp16/bf16, head dim <= 256 and a multiple of 8 and no explicit mask; the
memory-efficient kernel needs fp32/fp16/bf16, a head dim divisible by 8 for half types and 4
for fp32, and equal head counts), so that CPU tests can tell whether a CUDA run would fall to
the math kernel, which holds the N×N scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .attention import FLASH_DTYPES, announce_once, input_refusal, flash_attn_refusal

HALF_DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIM_FLAGS = "--kv-channels (or --hidden-size / --num-attention-heads)"


def sdpa_cuda_backend(
    dtype: torch.dtype, head_dim: int, q_heads: int, kv_heads: int, has_mask: bool
) -> str:
    """'flash', 'efficient' or 'math': what torch SDPA (2.5+, sm80+) picks on CUDA for
    contiguous-last-dim dense inputs, is_causal on square sequences or an explicit mask,
    enable_gqa when the head counts differ."""
    if dtype in HALF_DTYPES and head_dim % 8 == 0 and head_dim <= 256 and not has_mask:
        return "flash"
    alignment = 8 if dtype in HALF_DTYPES else 4
    if dtype in (torch.float32, *HALF_DTYPES) and head_dim % alignment == 0 and q_heads == kv_heads:
        return "efficient"
    return "math"


def sdpa_expands_kv(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    q_heads: int,
    kv_heads: int,
    has_mask: bool = False,
) -> bool:
    """True where SDPA would fall to its math kernel because of GQA alone (fp32 on CUDA):
    the caller repeats k/v to the query heads, so that the efficient kernel takes the call."""
    if device.type != "cuda" or q_heads == kv_heads:
        return False
    return (
        sdpa_cuda_backend(dtype, head_dim, q_heads, kv_heads, has_mask) == "math"
        and sdpa_cuda_backend(dtype, head_dim, q_heads, q_heads, has_mask) != "math"
    )


def _flash_attn_unit_ok(device, dtype, head_dim) -> bool:
    """flash-attn's private forward/backward (no padding of the head dim, unlike its public
    functions) run here on this dtype and head dim."""
    return flash_attn_refusal(device, dtype) is None and head_dim % 8 == 0 and head_dim <= 256


def ring_unit_kernels(
    device: torch.device, dtype: torch.dtype, head_dim: int, use_flash_attn: bool
) -> tuple[str, str]:
    """(kernel for unmasked units, kernel for units with a bias) of the ring, by name in
    lse_kernels.KERNELS. Raises ValueError where no fused kernel takes the head dim."""
    if device.type == "cpu":
        dense = (
            "flash-attn"
            if use_flash_attn and _flash_attn_unit_ok(device, dtype, head_dim)
            else "cpu-flash"
        )
        return dense, "cpu-flash"
    if device.type != "cuda" or dtype == torch.float64:
        return "reference", "reference"
    alignment = 8 if dtype in HALF_DTYPES else 4
    if dtype not in (torch.float32, *HALF_DTYPES) or head_dim % alignment:
        raise ValueError(
            f"ring attention on CUDA needs fp32/fp16/bf16 activations and a head "
            f"dim divisible by {alignment} (got {head_dim} in "
            f"{str(dtype).replace('torch.', '')}): change {HEAD_DIM_FLAGS}"
        )
    if use_flash_attn and _flash_attn_unit_ok(device, dtype, head_dim):
        return "flash-attn", "sdpa-efficient"
    return "sdpa-efficient", "sdpa-efficient"


@dataclass(frozen=True)
class AttentionCall:
    """What decides the kernel of one attention call."""

    device: torch.device
    dtype: torch.dtype
    head_dim: int
    q_heads: int
    kv_heads: int
    documents: bool = False
    window: Optional[int] = None
    ring: bool = False
    use_flash_attn: bool = False
    dropout: bool = False  # attention dropout: the document tiles run without it
    dense_mask: bool = False  # a dense [b, 1, N, N] mask (tests only): SDPA with a mask


def attention_kernel(call: AttentionCall) -> str:
    """The kernel that runs `call` (the names in this module's docstring)."""
    if call.ring:
        dense, masked = ring_unit_kernels(
            call.device, call.dtype, call.head_dim, call.use_flash_attn
        )
        return f"ring: {dense}" + (
            f" / {masked}" if call.documents or call.window is not None else ""
        )
    flash = (
        call.use_flash_attn
        and not call.dense_mask
        and flash_attn_refusal(call.device, call.dtype) is None
    )
    if call.documents or call.window is not None:
        if flash:
            return "flash-attn varlen" if call.documents else "flash-attn"
        tiles = call.device.type == "cuda" and not call.dropout
        return "document tiles" if tiles else "document blocks"
    if flash:
        return "flash-attn"
    if call.device.type != "cuda":
        return "sdpa cpu-flash" if call.device.type == "cpu" else "sdpa"
    heads = (
        call.q_heads
        if sdpa_expands_kv(
            call.device, call.dtype, call.head_dim, call.q_heads, call.kv_heads, call.dense_mask
        )
        else call.kv_heads
    )
    return "sdpa " + sdpa_cuda_backend(
        call.dtype, call.head_dim, call.q_heads, heads, call.dense_mask
    )


def kernel_refusal(call: AttentionCall) -> Optional[str]:
    """Why `call` has no fused kernel (a message naming the flags to change), or None: on
    CUDA a head dim that SDPA's flash and efficient kernels both refuse would run its math
    kernel (the N×N scores), and the ring's unit kernels refuse it outright."""
    try:
        kernel = attention_kernel(call)
    except ValueError as refused:
        return str(refused)
    if "math" not in kernel:
        return None
    alignment = 8 if call.dtype in HALF_DTYPES else 4
    return (
        f"no fused attention kernel on CUDA takes head dim {call.head_dim} in "
        f"{str(call.dtype).replace('torch.', '')}: torch SDPA would run its math kernel "
        f"(N×N scores); change {HEAD_DIM_FLAGS} so that the head dim is a multiple of "
        f"{alignment}"
    )


def attention_path(call: AttentionCall) -> str:
    """The path a call belongs to, for the log: causal, documents, window W, ring unit kernel."""
    if call.ring:
        return "ring unit kernel"
    parts = (["documents"] if call.documents else []) + (
        [f"window {call.window}"] if call.window is not None else []
    )
    return " + ".join(parts) or "causal"


def decide(call: AttentionCall) -> str:
    """attention_kernel(call), logged once per path and kernel with the device and, where
    --use-flash-attn was given and flash-attn does not run, why."""
    kernel = attention_kernel(call)
    where = call.device.type
    if call.use_flash_attn and "flash-attn" not in kernel:
        why = (
            flash_attn_refusal(call.device, call.dtype, call.dense_mask)
            or "flash-attn refuses this head dim"
        )
        where += f"; --use-flash-attn given, but {why}"
    announce_once(f"{attention_path(call)} = {kernel.removeprefix('ring: ')} ({where})")
    return kernel


def planned_kernel(
    use_flash_attn: bool,
    dtype: torch.dtype,
    head_dim: int,
    q_heads: int,
    kv_heads: int,
    documents: bool,
    window: Optional[int],
    ring: bool,
) -> str:
    """What --dry-run reports: the kernel on a CUDA GPU, with and without flash-attn."""
    cuda = torch.device("cuda")
    without = AttentionCall(
        cuda, dtype, head_dim, q_heads, kv_heads, documents, window, ring, False
    )
    kernel_without = attention_kernel(without)
    if not use_flash_attn:
        return kernel_without
    if dtype not in FLASH_DTYPES:
        return f"{kernel_without} (--use-flash-attn given, but {input_refusal(dtype, False)})"
    with_flash = _kernel_if_flash_attn_installed(without)
    if with_flash == kernel_without:
        return kernel_without
    return f"{with_flash} where flash-attn is installed, else {kernel_without}"


def _kernel_if_flash_attn_installed(call: AttentionCall) -> str:
    """attention_kernel's answer on a CUDA machine with flash-attn importable."""
    if call.ring:
        dense = (
            "flash-attn" if call.head_dim % 8 == 0 and call.head_dim <= 256 else "sdpa-efficient"
        )
        return f"ring: {dense}" + (
            " / sdpa-efficient" if call.documents or call.window is not None else ""
        )
    if call.documents:
        return "flash-attn varlen"
    return "flash-attn"
