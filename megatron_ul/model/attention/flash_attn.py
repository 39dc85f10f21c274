"""Whether FlashAttention-2 can run: the one rule every attention path asks.

FlashAttention-2 runs only when it is asked for (--use-flash-attn), `flash_attn` 2.5 to 2.8 is
importable, and the tensors are on a CUDA device and in fp16/bf16. Requests are not refused by
validation, so that one launch script serves a GPU run and an fp32 CPU run: the selection
(backends.py) falls back to another kernel and the log says why.

Test hook: with the environment variable MEGATRON_UL_TEST_FLASH_ATTN_ON_CPU=1 the CPU counts as
a device where flash-attn can run. Tests set it together with the strict CPU stand-in of
`flash_attn` (tests/stand_ins/flash_attn, fixture `flash_attn_stand_in`), so the flash path,
with the real API's dtype, layout and shape checks, runs in CPU tests. Never set it otherwise:
the real kernel rejects CPU tensors.
"""

from __future__ import annotations

import importlib
import os
import re

import torch

FLASH_ON_CPU_ENV = "MEGATRON_UL_TEST_FLASH_ATTN_ON_CPU"
FLASH_DTYPES = (torch.float16, torch.bfloat16)

# The releases whose private functions lse_kernels knows how to call (the unit kernel):
# 2.5 plain functions with window_size, 2.6 adds softcap, 2.7 and 2.8 torch custom ops with
# window_size_left/right. Other releases are refused (another kernel runs, and the log says why).
FLASH_ATTN_RELEASES = ((2, 5), (2, 8))


def flash_attn_module():
    """The `flash_attn` package, or None. Looked up on every use (a dict lookup once it is
    imported), so tests can put the stand-in on sys.path after this module was imported."""
    try:
        return importlib.import_module("flash_attn")
    except Exception:
        return None


def flash_attn_release(module) -> tuple[int, int] | None:
    """(major, minor) of the package's __version__ ("2.7.4.post1" -> (2, 7)), or None."""
    match = re.match(r"(\d+)\.(\d+)", str(getattr(module, "__version__", "")))
    return (int(match.group(1)), int(match.group(2))) if match else None


def flash_attn_api(module) -> str:
    """The calling convention of the package's private functions: '2.5', '2.6' or '2.7'."""
    release = flash_attn_release(module)
    assert release is not None and FLASH_ATTN_RELEASES[0] <= release <= FLASH_ATTN_RELEASES[1]
    return "2.5" if release == (2, 5) else "2.6" if release == (2, 6) else "2.7"


def flash_attn_version_refusal(module) -> str | None:
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
    device: torch.device, dtype: torch.dtype | None = None, installed: bool | None = None
) -> str | None:
    """Why FlashAttention-2 cannot run here (for the log), or None when it can.
    dtype None: not known yet. installed None: look the package up; True/False: plan as if it
    were (not) installed on a CUDA device (--dry-run plans both)."""
    if installed is None:
        module = flash_attn_module()
        if module is None:
            return "flash-attn is not installed"
        unsupported = flash_attn_version_refusal(module)
        if unsupported is not None:
            return unsupported
        if not _device_runs_flash(device):
            return f"tensors on {device.type}, FlashAttention-2 needs a CUDA device"
    elif not installed:
        return "flash-attn is not installed"
    elif device.type != "cuda":
        return f"tensors on {device.type}, FlashAttention-2 needs a CUDA device"
    return dtype_refusal(dtype)


def dtype_refusal(dtype: torch.dtype | None) -> str | None:
    """The part of the rule that the configuration alone decides (also used by --dry-run)."""
    if dtype is not None and dtype not in FLASH_DTYPES:
        return (
            f"{str(dtype).replace('torch.', '')} activations, FlashAttention-2 takes only "
            f"fp16/bf16 (add --bf16 or --fp16)"
        )
    return None


def unit_head_dim_refusal(head_dim: int) -> str | None:
    """flash-attn's private forward/backward (the unit kernel) do not pad the head dim, unlike
    its public functions: they take multiples of 8 up to 256."""
    if head_dim % 8 == 0 and head_dim <= 256:
        return None
    return "flash-attn's unit kernel takes head dims that are multiples of 8 up to 256"
