"""Local attention on the full sequence for a slice of heads: FlashAttention-2 where it can
run, else torch SDPA. No communication happens here.

The rule (one source of truth: `flash_attn_refusal`): FlashAttention-2 runs only when it is
asked for (--use-flash-attn), `flash_attn` 2.5 to 2.8 is importable, and the tensors are on a
CUDA device and in fp16/bf16. Documents (--reset-attention-mask) and windows never reach this
module: they travel as offsets to document_attention.py (flash-attn's varlen kernel) or the
ring. Every other request falls back to SDPA, and the log says once which path ran and why;
it never names flash-attn for a call that SDPA computed. attention_dispatch.decide is the whole
decision (what the log and --dry-run print). Requests are not refused by validation, so that
one launch script serves a GPU run and an fp32 CPU run.

Test hook: with the environment variable MEGATRON_UL_TEST_FLASH_ATTN_ON_CPU=1 the CPU counts as
a device where flash-attn can run. Tests set it together with the strict CPU stand-in of
`flash_attn` (tests/stand_ins/flash_attn, fixture `flash_attn_stand_in`), so the flash path,
with the real API's dtype, layout and shape checks, runs in CPU tests. Never set it otherwise:
the real kernel rejects CPU tensors.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
from typing import Optional

import torch
import torch.nn.functional as F

from ...mpu.random import get_rng_tracker

log = logging.getLogger(__name__)

FLASH_ON_CPU_ENV = "MEGATRON_UL_TEST_FLASH_ATTN_ON_CPU"
FLASH_DTYPES = (torch.float16, torch.bfloat16)

_announced: set = set()


def announce_once(message: str) -> None:
    if message not in _announced:
        log.info("attention: %s", message)
        _announced.add(message)


def flash_attn_module():
    """The `flash_attn` package, or None. Looked up on every use (a dict lookup once it is
    imported), so tests can put the stand-in on sys.path after this module was imported."""
    try:
        return importlib.import_module("flash_attn")
    except Exception:  # noqa: BLE001 - any import failure (no package, broken CUDA build)
        return None


# The releases whose private functions lse_kernels knows how to call (the ring's unit kernel):
# 2.5 plain functions with window_size, 2.6 adds softcap, 2.7 and 2.8 torch custom ops with
# window_size_left/right. Other releases are refused (SDPA runs, and the log says why).
FLASH_ATTN_RELEASES = ((2, 5), (2, 8))


def flash_attn_release(module) -> Optional[tuple[int, int]]:
    """(major, minor) of the package's __version__ ("2.7.4.post1" -> (2, 7)), or None."""
    match = re.match(r"(\d+)\.(\d+)", str(getattr(module, "__version__", "")))
    return (int(match.group(1)), int(match.group(2))) if match else None


def flash_attn_api(module) -> str:
    """The calling convention of the package's private functions: '2.5', '2.6' or '2.7'."""
    release = flash_attn_release(module)
    assert release is not None and FLASH_ATTN_RELEASES[0] <= release <= FLASH_ATTN_RELEASES[1]
    return "2.5" if release == (2, 5) else "2.6" if release == (2, 6) else "2.7"


def flash_attn_version_refusal(module) -> Optional[str]:
    """Why this flash_attn release cannot run (None: a supported one)."""
    release = flash_attn_release(module)
    low, high = FLASH_ATTN_RELEASES
    if release is not None and low <= release <= high:
        return None
    version = getattr(module, "__version__", "of unknown version")
    return (
        f"flash-attn {version} is installed; megatron_ul runs flash-attn "
        f"{low[0]}.{low[1]} to {high[0]}.{high[1]}"
    )


def _device_runs_flash(device: torch.device) -> bool:
    return device.type == "cuda" or (
        device.type == "cpu" and os.environ.get(FLASH_ON_CPU_ENV) == "1"
    )


def flash_attn_refusal(
    device: torch.device, dtype: Optional[torch.dtype] = None, has_mask: bool = False
) -> Optional[str]:
    """Why FlashAttention-2 cannot run here (for the log), or None when it can.
    dtype None: not known yet (checked again per call)."""
    module = flash_attn_module()
    if module is None:
        return "flash-attn is not installed"
    unsupported = flash_attn_version_refusal(module)
    if unsupported is not None:
        return unsupported
    if not _device_runs_flash(device):
        return f"tensors on {device.type}, FlashAttention-2 needs a CUDA device"
    return input_refusal(dtype, has_mask)


def input_refusal(dtype: Optional[torch.dtype], has_mask: bool) -> Optional[str]:
    """The part of the rule that the configuration alone decides (also used by --dry-run)."""
    if dtype is not None and dtype not in FLASH_DTYPES:
        return (
            f"{str(dtype).replace('torch.', '')} activations, FlashAttention-2 takes only "
            f"fp16/bf16 (add --bf16 or --fp16)"
        )
    if has_mask:
        return "a dense attention mask (tests only: documents travel as offsets)"
    return None


def select_backend(use_flash_attn: bool, device: torch.device) -> str:
    """'flash' (requested and possible on this device; dtype and mask are checked per call)
    or 'sdpa' (logged once, with the reason when flash-attn was asked for)."""
    if not use_flash_attn:
        return "sdpa"
    why_not = flash_attn_refusal(device)
    if why_not is not None:
        announce_once(f"torch SDPA (--use-flash-attn given, but {why_not})")
        return "sdpa"
    return "flash"


def require_one_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q, k and v must be in one dtype (the activation dtype): a mixed set means one of them
    was upcast (its all-to-all would move twice the bytes), and FlashAttention-2 refuses it."""
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must share the activation dtype (got {q.dtype}, {k.dtype}, {v.dtype})"
        )


def _own_buffer_unless_shared_with(t: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """`t`, or a compact copy when it is a view into a larger buffer that q does not keep alive
    anyway: with RoPE, q and k are new tensors while v is still a view of the fused QKV output,
    and the kernel saving that view would keep the whole QKV output for backward."""
    storage = t.untyped_storage()
    if (
        storage.data_ptr() == q.untyped_storage().data_ptr()
        or storage.nbytes() == t.numel() * t.element_size()
    ):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _sdpa_layout(t: torch.Tensor) -> torch.Tensor:
    """t [b, h, N, d] as SDPA's kernel runs it fastest. torch's CPU flash kernel runs half
    precision 1.6x faster (bf16, 4 heads, N = 2048, forward + backward) on inputs contiguous in
    this layout than on views of [N, b, h, d] (fp32: 6%, not worth the copy); CUDA's fused
    kernels take [b, N, h, d] rows natively, so the view stays."""
    if t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16):
        return t.contiguous()
    return t


def expand_kv_for_sdpa(q, k, v, has_mask: bool, heads_dim: int = 2):
    """k, v repeated to q's heads where CUDA SDPA would otherwise run its math kernel (O(N²)
    memory) because of GQA alone: fp32 (no flash kernel) needs the efficient kernel, which
    takes equal head counts only (attention_dispatch.sdpa_cuda_backend)."""
    from .dispatch import sdpa_expands_kv

    hq, hk = q.shape[heads_dim], k.shape[heads_dim]
    if not sdpa_expands_kv(q.device, q.dtype, q.shape[-1], hq, hk, has_mask):
        return k, v
    return (
        k.repeat_interleave(hq // hk, dim=heads_dim),
        v.repeat_interleave(hq // hk, dim=heads_dim),
    )


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    backend: str,
    dropout_p: float,
    attention_mask: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
) -> torch.Tensor:
    """Causal attention. q [N, b, hq, d]; k, v [N, b, hk, d] with hq a multiple of hk (GQA).

    backend: 'flash' runs FlashAttention-2 when `flash_attn_refusal` allows this call, else
    SDPA; 'sdpa' always SDPA.
    attention_mask: optional dense bool [b, 1, N, N], True = masked, including the causal part:
    for tests that compare against Megatron's dense mask (training passes documents as offsets
    to document_attention instead).
    Returns [N, b, hq, d] in the dtype of q (the activation dtype: never upcast here).
    """
    from .dispatch import AttentionCall, decide, kv_for_kernel, sdpa_backend_pinned

    require_one_dtype(q, k, v)
    kernel = decide(
        AttentionCall(
            q.device,
            q.dtype,
            q.shape[-1],
            q.shape[2],
            k.shape[2],
            use_flash_attn=backend == "flash",
            dropout=dropout_p,
            dense_mask=attention_mask is not None,
            seq_length=q.shape[0],
            requires_grad=torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
        )
    )
    use_flash = kernel == "flash-attn"
    k, v = _own_buffer_unless_shared_with(k, q), _own_buffer_unless_shared_with(v, q)
    # Dropout on attention probabilities of this rank's heads: a per-(TP, SP)-rank stream.
    with get_rng_tracker().fork():
        if use_flash:
            # [N, b, h, d] -> [b, N, h, d]: a view whose last dimension stays contiguous.
            out = flash_attn_module().flash_attn_func(
                q.transpose(0, 1),
                k.transpose(0, 1),
                v.transpose(0, 1),
                dropout_p=dropout_p,
                softmax_scale=softmax_scale,
                causal=True,
            )
            return out.transpose(0, 1)
        # GQA (query head i uses kv head i // (hq / hk)): SDPA's enable_gqa broadcasts the kv
        # heads inside the kernel instead of keeping k and v repeated hq/hk times for backward.
        # On torch 2.13 CPU the flash kernel takes it; 8 q / 2 kv heads, N=2048, d=64: saved
        # bytes 16.8 MB -> 10.6 MB, forward+backward time unchanged (0.59 s both).
        k, v = kv_for_kernel(kernel, q, k, v)
        gqa = k.shape[2] != q.shape[2]
        # [N, b, h, d] -> [b, h, N, d]
        q_, k_, v_ = (_sdpa_layout(t.permute(1, 2, 0, 3)) for t in (q, k, v))
        # On CUDA torch runs the decided backend or refuses (attention_dispatch).
        with sdpa_backend_pinned(kernel):
            if attention_mask is None:
                out = F.scaled_dot_product_attention(
                    q_,
                    k_,
                    v_,
                    dropout_p=dropout_p,
                    is_causal=True,
                    scale=softmax_scale,
                    enable_gqa=gqa,
                )
            else:
                out = F.scaled_dot_product_attention(
                    q_,
                    k_,
                    v_,
                    attn_mask=~attention_mask,
                    dropout_p=dropout_p,
                    scale=softmax_scale,
                    enable_gqa=gqa,
                )
        return out.permute(2, 0, 1, 3)
