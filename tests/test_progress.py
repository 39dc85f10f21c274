"""The shared progress reporter: a line per interval with items/s and MB/s (Megatron-LM's
preprocess style), the share done and ETA from bytes read or items, and the summary."""

import io

import pytest

from megatron_ul.progress import Progress


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_lines_at_each_interval_with_rates_share_and_eta():
    clock, out = Clock(), io.StringIO()
    p = Progress("documents", 10, rate_unit="docs", total_bytes=4_000_000, stream=out, clock=clock)
    clock.now += 2.0
    p.update(6, 1_000_000, position=1_000_000, tokens=500_000)  # below the interval: silent
    assert out.getvalue() == ""
    clock.now += 2.0
    p.update(6, 1_000_000, position=2_000_000, tokens=500_000)  # 12 documents in 4 s
    line = out.getvalue().strip()
    # 12/4 = 3 docs/s; 2 MB/4 s = 0.5 MB/s; 1 M tokens/4 s; half the input in 4 s: 4 s to go
    assert line == (
        "processed 12 documents: 3.00 docs/s, 0.50 MB/s, 0.250 M tokens/s, 50.0% of input, ETA 4 s"
    )
    p.update(7, 0)  # 19: the next line waits for 20
    assert out.getvalue().count("\n") == 1
    p.update(1, 0)
    assert out.getvalue().count("\n") == 2


def test_item_total_and_summary():
    clock, out = Clock(), io.StringIO()
    p = Progress("tensor groups", 1, total=4, verb="converted", stream=out, clock=clock)
    clock.now += 1.0
    p.update(1, 3_000_000)
    clock.now += 1.0
    p.summary("2 files")
    first, last = out.getvalue().splitlines()
    assert first == (
        "converted 1 tensor groups: 1.00 tensor groups/s, 3.00 MB/s, 25.0% of 4 tensor groups, "
        "ETA 3 s"
    )
    assert last == "done in 2.00 s: 1 tensor groups (2 files); 0.50 tensor groups/s, 1.50 MB/s"


def test_unknown_total_and_bad_interval():
    out = io.StringIO()
    Progress("documents", 1, stream=out).update(1, 10)
    assert out.getvalue().rstrip().endswith("ETA unknown")
    with pytest.raises(ValueError, match="interval 0"):
        Progress("documents", 0)
