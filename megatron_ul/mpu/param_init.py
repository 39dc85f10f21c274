"""Deterministic, layout-independent, shard-only parameter initialisation.

Every element's initial value is a function of (seed, parameter key, the element's position in
the full, unsharded parameter) only, computed by a counter-based generator: a rank computes
exactly the elements it holds — its TP slice, its pipeline stage's layers and, under ZeRO-3,
its dp_cp_sp shard — directly on the training device, and the values agree with the single-process
model whatever the layout. Nothing is drawn in full and sliced.

Generator. Element i of a parameter keyed k is the (i mod 2)-th output of a Box-Muller pair
built from one 64-bit SplitMix64 output, mix(k + (i//2 + 1)·γ) (Steele et al., "Fast splittable
pseudorandom number generators", 2014): its high 32 bits give u1 ∈ (0, 1], its low 32 bits
u2 ∈ [0, 1), and the pair is r·cos θ, r·sin θ with r = sqrt(-2 ln u1), θ = 2π u2. The integer
part is exact int64 arithmetic (wrapping multiplication, logical shifts by masking), so it gives
the same bits on every device; the float part runs in fp64 and is rounded to the parameter's
dtype once.

Parameters are created through `new_parameter`, which records how to compute them
(`init_spec`). Inside `deferred()` they are created on the meta device instead, to be sharded
(ZeRO-3) and then `materialize`d shard by shard.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

Index = tuple  # one 1-D LongTensor per dimension: the global positions this shard holds


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= (1 << 63) else x


_GAMMA = _signed(0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)
# Elements computed at a time: bounds the generator's workspace (five int64/fp64 buffers)
# whatever the parameter's size.
WORKSPACE_ELEMENTS = 1 << 20
WORKSPACE_BYTES = 5 * 8 * WORKSPACE_ELEMENTS


def _mix_(z: torch.Tensor, shift: int, multiplier: int | None, scratch: torch.Tensor) -> None:
    """z ^= z >>> shift (logical shift); z *= multiplier (wrapping) — in place."""
    torch.bitwise_right_shift(z, shift, out=scratch)
    scratch.bitwise_and_((1 << (64 - shift)) - 1)
    z.bitwise_xor_(scratch)
    if multiplier is not None:
        z.mul_(multiplier)


def workspace(elements: int, device) -> tuple[torch.Tensor, ...]:
    """Buffers for standard_normal_at: allocated once per parameter and reused chunk after
    chunk, so that the allocator does not fragment the heap between parameters."""
    return (
        torch.empty(elements, dtype=torch.int64, device=device),
        torch.empty(elements, dtype=torch.int64, device=device),
        torch.empty(elements, dtype=torch.float64, device=device),
        torch.empty(elements, dtype=torch.float64, device=device),
    )


def standard_normal_at(flat_index: torch.Tensor, key: int, buffers=None) -> torch.Tensor:
    """N(0, 1) values (fp64) of the elements at `flat_index` (int64) of the stream `key`,
    computed in place in `buffers` (see workspace(); allocated here when None)."""
    n = flat_index.numel()
    z, scratch, angle, u1 = (
        b[:n].view(flat_index.shape) for b in (buffers or workspace(n, flat_index.device))
    )
    torch.bitwise_right_shift(flat_index, 1, out=z)
    z.add_(1).mul_(_GAMMA).add_(key)
    _mix_(z, 30, _MUL1, scratch)
    _mix_(z, 27, _MUL2, scratch)
    _mix_(z, 31, None, scratch)
    # u2 ∈ [0, 1) from the low 32 bits, u1 ∈ (0, 1] from the high 32 bits.
    torch.bitwise_and(z, 0xFFFFFFFF, out=scratch)
    angle.copy_(scratch).mul_(2.0**-32 * 2 * math.pi)
    # Odd elements take the pair's sine: sin θ = cos(θ - π/2).
    torch.bitwise_and(flat_index, 1, out=scratch)
    u1.copy_(scratch)
    angle.sub_(u1.mul_(math.pi / 2))
    z.bitwise_right_shift_(32).bitwise_and_(0xFFFFFFFF).add_(1)
    u1.copy_(z).mul_(2.0**-32)
    return u1.log_().mul_(-2.0).sqrt_().mul_(angle.cos_())


def stream_key(seed: int, key: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest()
    return _signed(int.from_bytes(digest, "little"))


def full_index(shape) -> Index:
    return tuple(torch.arange(n) for n in shape)


class Init:
    """The values of a parameter at given global positions."""

    def fill_(self, out: torch.Tensor, global_shape: tuple, index: Index) -> torch.Tensor:
        """Write the values at positions `index` (the outer product of its per-dimension
        positions) into `out`, in place."""
        raise NotImplementedError

    def values(self, global_shape: tuple, index: Index, device, dtype) -> torch.Tensor:
        out = torch.empty([len(i) for i in index], device=device, dtype=dtype)
        return self.fill_(out, global_shape, index)


@dataclass(frozen=True)
class Constant(Init):
    value: float

    def fill_(self, out, global_shape, index):
        return out.fill_(self.value)


@dataclass(frozen=True)
class Normal(Init):
    """N(0, std²), counter-based (module docstring)."""

    std: float
    seed: int
    key: str

    def fill_(self, out, global_shape, index):
        if out.numel() == 0:
            return out
        strides = [math.prod(global_shape[d + 1 :]) for d in range(len(global_shape))]
        index = [i.to(out.device) for i in index]
        key = stream_key(self.seed, self.key)
        row_elements = max(out[0].numel(), 1)
        rows_per_chunk = max(WORKSPACE_ELEMENTS // row_elements, 1)
        chunk = min(rows_per_chunk, out.shape[0]) * row_elements
        flat_buffer, buffers = (
            torch.empty(chunk, dtype=torch.int64, device=out.device),
            workspace(chunk, out.device),
        )
        for start in range(0, out.shape[0], rows_per_chunk):
            rows = index[0][start : start + rows_per_chunk]
            shape = [len(rows), *[len(i) for i in index[1:]]]
            flat = flat_buffer[: math.prod(shape)].view(shape)
            flat.copy_((rows * strides[0]).view(-1, *[1] * (len(index) - 1)).expand(shape))
            for d in range(1, len(index)):
                view = [1] * len(index)
                view[d] = -1
                flat.add_(index[d].view(view), alpha=strides[d])
            out[start : start + len(rows)] = standard_normal_at(flat, key, buffers).mul_(self.std)
        return out


class FromFull(Init):
    """Draw the full tensor with `fill(full)` and take the shard (for tests that need given
    values; it is not shard-only)."""

    def __init__(self, fill: Callable[[torch.Tensor], None]):
        self.fill = fill

    def fill_(self, out, global_shape, index):
        full = torch.empty(global_shape, dtype=torch.float32)
        self.fill(full)
        return out.copy_(full[torch.meshgrid(*index, indexing="ij")])


# ---- creating and materialising parameters ------------------------------------------------------
@dataclass
class InitSpec:
    init: Init
    global_shape: tuple
    index: Index  # global positions held by this rank before ZeRO-3 sharding


_deferred = False


@contextlib.contextmanager
def deferred():
    """Parameters created inside are meta tensors, to be materialised after sharding."""
    global _deferred
    previous, _deferred = _deferred, True
    try:
        yield
    finally:
        _deferred = previous


def new_parameter(
    init: Init, global_shape, index: Index | None = None, *, device=None, dtype=torch.float32
) -> nn.Parameter:
    """A parameter holding positions `index` (default: all) of a `global_shape` tensor."""
    global_shape = tuple(global_shape)
    index = full_index(global_shape) if index is None else tuple(index)
    if _deferred:
        param = nn.Parameter(torch.empty([len(i) for i in index], device="meta", dtype=dtype))
    else:
        param = nn.Parameter(init.values(global_shape, index, device, dtype))
    # on the parameter itself, as its ParamSpec: materialising and resharding find it there
    param.init_spec = InitSpec(init, global_shape, index)  # type: ignore[attr-defined]
    return param


def _dim0_shard(param) -> tuple[torch.Tensor, int]:
    """(local tensor, offset of its first row in the unsharded parameter) of a parameter that
    is a DTensor sharded on dim 0 (FSDP2), or (param, 0)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return param.data, 0
    if any(
        not (isinstance(p, Shard) and p.dim == 0) for p in param.placements if not p.is_replicate()
    ):
        raise ValueError(
            f"cannot materialise placements {param.placements}: only dim-0 "
            f"sharding (FSDP2) is supported"
        )
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    return param.to_local(), offset[0] if offset else 0


M = TypeVar("M", bound=nn.Module)  # materialised in place: the module handed in comes back


@torch.no_grad()
def materialize(module: M, device) -> M:
    """Allocate every meta parameter of `module` on `device` and compute only the elements
    this rank holds (its ZeRO-3 shard of its TP slice)."""
    attributes = {name: dict(vars(p)) for name, p in module.named_parameters()}
    missing = [name for name, a in attributes.items() if "init_spec" not in a]
    if missing:
        raise ValueError(f"parameters without an init_spec cannot be materialised: {missing}")
    module.to_empty(device=device)
    for name, param in module.named_parameters():
        # to_empty may make new Parameter objects: keep what our layers hung on the old ones.
        for attribute, value in attributes[name].items():
            if not hasattr(param, attribute):
                setattr(param, attribute, value)
        spec: InitSpec = param.init_spec  # type: ignore[attr-defined]  # set by new_parameter
        local, offset = _dim0_shard(param)
        if local.numel() == 0:
            continue
        index = (spec.index[0][offset : offset + local.shape[0]], *spec.index[1:])
        spec.init.fill_(local, spec.global_shape, index)
    return module
