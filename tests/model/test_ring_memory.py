"""Ring attention's peak memory is linear in its chunk: at most 2.1× per doubling of the local
sequence and within 1.5× of Ulysses alone at the same tokens per rank (measured the way
tools/bench/bench_ring.py's memory table is: every CPU allocation and free of one forward +
backward, 2 gloo ranks). A C×C score tensor per unit (the explicit fp32 kernel) grew 3.8× per
doubling."""

import pytest

from tools.bench.bench_ring import memory_rows

GROWTH, VS_ULYSSES = 2.1, 1.5


def _check(chunks):
    rows = memory_rows(chunks, heads=2, head_dim=64)
    for (_, ring_a, _), (c, ring_b, _) in zip(rows, rows[1:]):
        assert ring_b / ring_a <= GROWTH, (c, rows)
    for c, ring, ulysses in rows:
        assert ring / ulysses <= VS_ULYSSES, (c, rows)


def test_ring_peak_memory_grows_linearly_with_the_chunk():
    _check([256, 512, 1024])


@pytest.mark.slow
def test_ring_peak_memory_grows_linearly_from_1k_to_16k():
    _check([1024, 2048, 4096, 8192, 16384])
