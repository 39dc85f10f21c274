"""Block-sparse attention layouts: DeepSpeed's Fixed, BigBird, BSLongformer and Variable
patterns as boolean [heads, query blocks, key blocks] tensors (True = the block is attended).

The rules are those of DeepSpeed 0.18.9's `ops/sparse_attention/sparsity_config.py` (its last
release with sparse attention), written here as whole-tensor comparisons of block indices:
the deterministic parts equal its `make_layout` (tests/model/test_block_sparse_layouts.py
compares them over a grid of parameters). Its parameter names are kept (flags
`--sparse-<name>`); each pattern takes only its own parameters, with its own defaults.

Random blocks (BigBird, Variable) come from our generator, not Python's `random`: a CPU
`torch.Generator` seeded from (run seed, layer, global head, chunk of RANDOM_ROWS rows), so
every rank draws the same blocks for a head whichever rows or heads it asks for, and each
layer has its own. Where the attention is unidirectional they are drawn from the blocks at or
before the diagonal (at most row + 1 of them; DeepSpeed's BigBird raises there, its Variable
draws from the whole row and causality then hides about half).

Causality: the model is a causal GPT, so a token only ever sees earlier tokens, whatever the
layout. `attention='unidirectional'` (the default here) builds DeepSpeed's unidirectional
layout; 'bidirectional' builds its bidirectional one (global rows, horizontal global
attention, random blocks from the whole row), which causality then trims. `computed` blocks
are those at or below the block diagonal: the only ones a kernel runs.

Layouts are made in bands of query rows (`rows=`), so a long sequence never holds the whole
[blocks, blocks] layout of every head at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...sparsity_config import SparsityPattern

# Rows of random blocks drawn from one generator state: a band of rows draws the same blocks
# as the whole layout does.
RANDOM_ROWS = 64


# ---- layouts ---------------------------------------------------------------------------------
def block_layout(
    p: SparsityPattern,
    num_heads: int,
    seq_length: int,
    *,
    seed: int = 0,
    layer: int = 0,
    heads: Sequence[int] | None = None,
    rows: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Bool [len(heads), r1 - r0, blocks]: the layout rows [r0, r1) (default all) of the
    global heads `heads` (default all `num_heads`). Heads that share head 0's layout are one
    expanded tensor (no copy)."""
    nb = p.num_blocks(seq_length)
    r0, r1 = rows if rows is not None else (0, nb)
    if not 0 <= r0 <= r1 <= nb:
        raise ValueError(f"layout rows {r0}..{r1} are outside the {nb} block rows")
    wanted = list(range(num_heads)) if heads is None else list(heads)
    if not p.different_layout_per_head:
        one = _head_rows(p, 0, nb, r0, r1, seed, layer)
        return one.unsqueeze(0).expand(len(wanted), *one.shape)
    return torch.stack([_head_rows(p, h, nb, r0, r1, seed, layer) for h in wanted])


def make_layout(
    p: SparsityPattern, num_heads: int, seq_length: int, *, seed: int = 0, layer: int = 0
) -> torch.Tensor:
    """The whole layout [num_heads, blocks, blocks], as DeepSpeed's `make_layout` (bool)."""
    return block_layout(p, num_heads, seq_length, seed=seed, layer=layer).clone()


def computed_blocks(
    p: SparsityPattern,
    num_heads: int,
    seq_length: int,
    *,
    seed: int = 0,
    layers: Sequence[int] = (0,),
    heads: Sequence[int] | None = None,
    band: int = 1024,
) -> int:
    """Blocks a kernel runs, summed over `heads` (default all) and `layers`: layout blocks at
    or below the block diagonal (causality hides the others entirely). Row band by row band;
    the layers differ only by their random blocks."""
    nb = p.num_blocks(seq_length)
    wanted = list(range(num_heads)) if heads is None else list(heads)
    drawn = list(layers) if p.draws_random_blocks else list(layers[:1])
    counted = wanted if p.different_layout_per_head else wanted[:1]
    total = 0
    for layer in drawn:
        for r0 in range(0, nb, band):
            r1 = min(r0 + band, nb)
            rows = block_layout(
                p, num_heads, seq_length, seed=seed, layer=layer, heads=counted, rows=(r0, r1)
            )
            total += int((rows & _lower(r0, r1, nb)).sum()) * (len(wanted) // len(counted))
    return total * len(layers) // len(drawn)


def _lower(r0: int, r1: int, nb: int) -> torch.Tensor:
    return torch.arange(nb).unsqueeze(0) <= torch.arange(r0, r1).unsqueeze(1)


def _head_rows(
    p: SparsityPattern, h: int, nb: int, r0: int, r1: int, seed: int, layer: int
) -> torch.Tensor:
    r = torch.arange(r0, r1).unsqueeze(1)
    c = torch.arange(nb).unsqueeze(0)
    uni = p.attention == "unidirectional"
    if p.mode == "fixed":
        out = _fixed(p, h, nb, r, c, uni)
    elif p.mode == "bigbird":
        out = _window(p.num_sliding_window_blocks, r, c) | (r < p.num_global_blocks)
        out = out | (c < p.num_global_blocks)
    elif p.mode == "bslongformer":
        glob = _global_set(p, nb)
        out = _window(p.num_sliding_window_blocks, r, c) | glob[r0:r1].unsqueeze(1) | glob
    else:
        out = _variable(p, nb, r, c, uni)
    if p.draws_random_blocks:
        out = out | _random(p.num_random_blocks, nb, r0, r1, uni, (seed, layer, h))
    if uni and p.mode in ("bigbird", "bslongformer"):
        out = out & (c <= r)  # DeepSpeed trims these two layouts to the lower triangle
    return out


def _window(num_window_blocks: int, r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Blocks within num_window_blocks // 2 of the diagonal, both sides."""
    return (r - c).abs() <= num_window_blocks // 2


def _same_window(starts: torch.Tensor, r: torch.Tensor, c: torch.Tensor, uni: bool):
    """Blocks of the local window that holds the row; `starts[i]`: the start of i's window."""
    same = starts[r] == starts[c]
    return same & (c <= r) if uni else same


def _fixed(p: SparsityPattern, h: int, nb: int, r, c, uni: bool) -> torch.Tensor:
    size, width = p.num_local_blocks, p.num_global_blocks
    index = torch.arange(nb)
    out = _same_window(index - index % size, r, c, uni)
    # The global blocks of each full window: `width` blocks ending `h % patterns` groups
    # before its end; a short last window takes its own, clamped to the sequence.
    first = size - (1 + h % p.num_different_global_patterns) * width
    full_end = nb - nb % size
    group_start = index - index % size + first
    is_global = (index < full_end) & (index % size >= first) & (index % size < first + width)
    groups = [(is_global, group_start)]
    if full_end < nb:
        start = min(full_end + first, nb - width)
        last = (index >= start) & (index < start + width)
        groups.append((last, torch.full_like(index, start)))
    for columns, starts in groups:
        vertical = columns.unsqueeze(0)
        out = out | (vertical & (r >= starts.unsqueeze(0)) if uni else vertical)
        if p.horizontal_global_attention:
            out = out | columns[r]
    return out


def _global_set(p: SparsityPattern, nb: int) -> torch.Tensor:
    """Bool [nb]: the blocks named by the global indices (ranges with end indices)."""
    index = torch.arange(nb)
    chosen = torch.zeros(nb, dtype=torch.bool)
    ends = p.global_block_end_indices or tuple(i + 1 for i in p.global_block_indices)
    for start, end in zip(p.global_block_indices, ends):
        chosen |= (index >= start) & (index < end)
    return chosen


def _variable(p: SparsityPattern, nb: int, r, c, uni: bool) -> torch.Tensor:
    # Local windows of the listed sizes, then the last size repeated to the end.
    starts = torch.empty(nb, dtype=torch.long)
    at = 0
    for size in p.local_window_blocks:
        starts[at : min(at + size, nb)] = at
        at += size
    last = p.local_window_blocks[-1]
    for rest in range(at, nb, last):
        starts[rest : min(rest + last, nb)] = rest
    out = _same_window(starts, r, c, uni)
    # Global columns (and rows with horizontal attention); unidirectional columns start at
    # their range's first block.
    ends = p.global_block_end_indices or tuple(i + 1 for i in p.global_block_indices)
    for start, end in zip(p.global_block_indices, ends):
        if start >= nb:
            continue
        columns = (c >= start) & (c < min(end, nb))
        out = out | (columns & (r >= start) if uni else columns)
        if p.horizontal_global_attention:
            out = out | ((r >= start) & (r < min(end, nb)))
    return out


def _random(
    count: int, nb: int, r0: int, r1: int, uni: bool, key: tuple[int, int, int]
) -> torch.Tensor:
    """`count` distinct random blocks per row of [r0, r1) (at most row + 1 when `uni`), drawn
    per chunk of RANDOM_ROWS rows from a generator keyed by (seed, layer, head, chunk)."""
    out = torch.zeros(r1 - r0, nb, dtype=torch.bool)
    for chunk in range(r0 // RANDOM_ROWS, -(-r1 // RANDOM_ROWS)):
        a, b = chunk * RANDOM_ROWS, min((chunk + 1) * RANDOM_ROWS, nb)
        generator = torch.Generator().manual_seed(_random_key(*key, chunk))
        scores = torch.rand(b - a, nb, generator=generator)
        rows = torch.arange(a, b).unsqueeze(1)
        if uni:
            scores = scores.masked_fill(torch.arange(nb).unsqueeze(0) > rows, float("inf"))
        value, picked = scores.topk(min(count, nb), dim=1, largest=False)
        chosen = torch.zeros(b - a, nb, dtype=torch.bool)
        chosen.scatter_(1, picked, value.isfinite())
        lo, hi = max(a, r0), min(b, r1)
        out[lo - r0 : hi - r0] = chosen[lo - a : hi - a]
    return out


def _random_key(seed: int, layer: int, head: int, chunk: int) -> int:
    key = 0
    for part in (seed, layer, head, chunk):
        key = (key * 1_000_003 + part) % (2**63 - 25)
    return key


__all__ = ["RANDOM_ROWS", "SparsityPattern", "block_layout", "make_layout", "computed_blocks"]
