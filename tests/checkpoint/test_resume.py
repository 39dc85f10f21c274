"""Exact resume: a run resumed from iteration k reproduces the uninterrupted run's per-step
losses bit for bit (fp32, dropout on, so RNG streams must be restored on every rank), on
TP/SP/DP layouts and on pipelines (TP2·PP2, and interleaved PP2 with SP2)."""

from tests.checkpoint.runs import TINY, assert_bitwise_resume, resume_on_layouts
from tests.distributed import run_distributed

LAYOUTS = {
    "TP2-SP2": ["--tensor-model-parallel-size", "2", "--ds-sequence-parallel-size", "2"],
    "SP2-DP2": ["--ds-sequence-parallel-size", "2"],
    # pipelines with tied embeddings: the last stage's copy and its Adam moments must resume
    "TP2-PP2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    "PP2-interleaved-SP2": [
        "--num-layers",
        "4",
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
        "--ds-sequence-parallel-size",
        "2",
    ],
}


def test_resume_is_bitwise_identical(tmp_path):
    results = run_distributed(resume_on_layouts, 4, TINY, LAYOUTS, str(tmp_path))
    assert_bitwise_resume(results, LAYOUTS)
