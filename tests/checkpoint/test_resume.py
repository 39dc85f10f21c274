"""Exact resume: a run resumed from iteration k reproduces the uninterrupted run's per-step
losses bit for bit (fp32, dropout on, so RNG streams must be restored on every rank)."""
import pytest

from tests.checkpoint.runs import TINY, train_then_resume
from tests.distributed import run_distributed

LAYOUTS = {
    "TP2-SP2": ["--tensor-model-parallel-size", "2", "--ds-sequence-parallel-size", "2"],
    "SP2-DP2": ["--ds-sequence-parallel-size", "2"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_is_bitwise_identical(layout, tmp_path):
    results = run_distributed(train_then_resume, 4, TINY + LAYOUTS[layout], str(tmp_path), 2, 4)
    full, resumed = results[0]
    print(f"{layout}: uninterrupted {full}\n  resumed at 2 {resumed}")
    assert len(full) == 4 and len(resumed) == 2
    assert resumed == full[2:]          # bitwise: float equality
    for r in results:                   # every rank reports the same losses
        assert r == results[0]
