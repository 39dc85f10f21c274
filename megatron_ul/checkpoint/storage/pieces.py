"""Which rectangular pieces of which layout-independent global tensor this rank holds: the
geometry of the torch_dist checkpoint format (checkpoint/storage/dcp_pieces.py).

Every parameter and Adam moment is one global tensor, named by its layout-independent
parameter name (pipeline.model.global_named_parameters) and shaped as the TP-merged parameter
(mpu/param_spec.full_shape; the vocabulary padded for the saving run's TP size). A rank holds
a contiguous flat range of its TP-local tensor: all of it (plain AdamW and ZeRO-1 parameters),
a range of rows (ZeRO-3 / FSDP2 DTensor chunks) or any element range (ZeRO-1 flat optimizer
shards). That range is cut into boxes (a partial row, whole rows, a partial row), each box into
the pieces its TP slice maps to (a strided TP split, e.g. SwiGLU's [gate; up], puts each of the
`stride` blocks elsewhere in the global tensor), and each piece into row blocks of at most
`max_bytes`, so that a reader on another layout reads no more than one block beyond what it
needs. Every piece is a contiguous view of the rank's own memory: saving reads it in place and
loading writes into it in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...mpu.param_spec import ParamSpec

# Largest piece written as one storage item (and so the most a layout-changing load reads
# beyond the bytes it needs per piece boundary, and the extra memory a save or load uses).
BLOCK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Piece:
    tensor: torch.Tensor  # contiguous view into this rank's storage
    offsets: tuple[int, ...]  # where it lies in the global tensor

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)


def _boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[int, tuple, tuple]]:
    """The flat element range [lo, hi) of a tensor of `shape` (at most 2-D) as boxes:
    (flat start, starts, sizes) — a partial row, whole rows, a partial row."""
    if lo >= hi:
        return []
    if len(shape) == 0:
        return [(0, (), ())]
    if len(shape) == 1:
        return [(lo, (lo,), (hi - lo,))]
    if len(shape) != 2:
        raise NotImplementedError(
            f"torch_dist checkpoints hold tensors of at most 2 dimensions, not {tuple(shape)}"
        )
    cols = shape[1]
    out = []
    row, col = divmod(lo, cols)
    if col:  # leading partial row
        end = min(hi, (row + 1) * cols)
        out.append((lo, (row, col), (1, end - lo)))
        lo, row = end, row + 1
    full_rows = (hi - lo) // cols
    if full_rows:
        out.append((lo, (row, 0), (full_rows, cols)))
        lo, row = lo + full_rows * cols, row + full_rows
    if lo < hi:  # trailing partial row
        out.append((lo, (row, 0), (1, hi - lo)))
    return out


def _tp_map(
    start: int, size: int, local_dim: int, spec: ParamSpec, tp: int, tp_rank: int
) -> list[tuple[int, int, int]]:
    """[start, start + size) along the TP partition dim of a local tensor whose dim has
    `local_dim` entries, as (local start, length, global start) runs: the local dim is
    `stride` blocks, block i being rows tp_rank·b .. of global block i (mpu.layers.tp_slice)."""
    block = local_dim // spec.partition_stride
    runs = []
    for i in range(spec.partition_stride):
        a, b = max(start, i * block), min(start + size, (i + 1) * block)
        if a < b:
            runs.append((a, b - a, i * block * tp + tp_rank * block + (a - i * block)))
    return runs


def pieces_of(
    data: torch.Tensor,
    local_shape: tuple[int, ...],
    lo: int,
    spec: ParamSpec,
    tp: int,
    tp_rank: int,
    max_bytes: int = BLOCK_BYTES,
) -> list[Piece]:
    """The global pieces of `data`, a contiguous tensor holding flat elements
    [lo, lo + data.numel()) of this rank's TP-local tensor of `local_shape`."""
    flat = data.detach().reshape(-1)
    hi = lo + flat.numel()
    dim = spec.partition_dim
    if dim is not None and dim > 0 and spec.partition_stride != 1:
        raise NotImplementedError("a strided TP split along a dimension other than 0")
    if not local_shape:  # a 0-d tensor
        return [Piece(flat.view(()), ())]
    out = []
    for flat_start, starts, sizes in _boxes(tuple(local_shape), lo, hi):
        base = flat_start - lo
        row_len = math.prod(sizes[1:])  # elements per row of this box (contiguous)
        rest = list(starts[1:])  # global offsets of the other dims
        if dim == 0:
            runs = _tp_map(starts[0], sizes[0], local_shape[0], spec, tp, tp_rank)
        else:
            runs = [(starts[0], sizes[0], starts[0])]
            if dim is not None:  # dim >= 1, stride 1: an offset only
                rest[dim - 1] += tp_rank * local_shape[dim]
        step = max(1, max_bytes // max(1, row_len * flat.element_size()))
        for local_row, rows, global_row in runs:
            for r in range(0, rows, step):
                n = min(step, rows - r)
                first = base + (local_row - starts[0] + r) * row_len
                view = flat[first : first + n * row_len].view((n,) + tuple(sizes[1:]))
                out.append(Piece(view, (global_row + r,) + tuple(rest)))
    return out


def clip_rows(pieces: list[Piece], rows: int) -> tuple[list[Piece], list[torch.Tensor]]:
    """Pieces cut to the first `rows` rows of the global tensor (a vocabulary padded for
    another TP size), and the views of the rows beyond (to be zeroed: padding rows are inert)."""
    kept, beyond = [], []
    for p in pieces:
        start, n = p.offsets[0], p.sizes[0]
        inside = max(0, min(n, rows - start))
        if inside:
            kept.append(Piece(p.tensor[:inside], p.offsets))
        if inside < n:
            beyond.append(p.tensor[inside:])
    return kept, beyond
