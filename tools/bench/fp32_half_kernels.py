"""Half-precision matmuls and attention computed in fp32 on CPUs without native bf16/fp16.

On an AVX2-only CPU torch's bf16 GEMM runs ~60x slower than its fp32 one (1.5 vs 86 GFLOPS
at 4096 x 512 x 8000) and bf16 SDPA ~5x slower, which puts a half-precision memory measurement
at a real vocabulary out of reach. Under this mode those kernels take fp32 copies of their
half-precision inputs and return their outputs in the dtypes the real kernel returns (checked
on the meta device), as a half-precision GEMM that accumulates in fp32 would.

For memory measurement only: entered *below* `LiveTensorTracker` (enter this mode first), the
tracker sees the op and the tensors it returns, exactly as without the mode, and none of the
fp32 copies, which live and die inside the op like a kernel's workspace. Peak RSS does see them.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

_HALF = (torch.bfloat16, torch.float16)
_aten = torch.ops.aten
KERNELS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
}


def native_half_matmul_is_slow() -> bool:
    """True on a CPU without AVX512-BF16 / AMX, where the mode is worth entering."""
    return torch.backends.cpu.get_cpu_capability() not in ("AVX512_BF16", "AMX")


class Fp32HalfKernels(TorchDispatchMode):
    """Runs the half-precision CPU kernels in KERNELS in fp32 (see the module's docstring)."""

    def __init__(self):
        super().__init__()
        self.widened = 0  # kernel calls run in fp32

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in KERNELS or not _has_half_cpu_tensor(args):
            return func(*args, **kwargs)
        out_dtypes = _output_dtypes(func, args, kwargs)
        self.widened += 1
        wide = tree_map(_to_fp32, (args, kwargs))
        out = func(*wide[0], **wide[1])
        if isinstance(out, torch.Tensor):
            return out.to(out_dtypes[0])
        return type(out)(
            o.to(d) if isinstance(o, torch.Tensor) else o for o, d in zip(out, out_dtypes)
        )


def _has_half_cpu_tensor(args) -> bool:
    return any(
        isinstance(a, torch.Tensor) and a.dtype in _HALF and a.device.type == "cpu" for a in args
    )


def _to_fp32(x):
    if isinstance(x, torch.Tensor) and x.dtype in _HALF:
        return x.float()
    return x


def _to_meta(x):
    return x.to("meta") if isinstance(x, torch.Tensor) else x


def _output_dtypes(func, args, kwargs) -> list:
    meta_args, meta_kwargs = tree_map(_to_meta, (args, kwargs))
    out = func(*meta_args, **meta_kwargs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o.dtype if isinstance(o, torch.Tensor) else None for o in outs]
