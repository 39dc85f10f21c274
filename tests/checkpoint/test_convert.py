"""Layout conversion: a checkpoint converted to another layout (offline with
tools/checkpoint/convert.py, or on load) and resumed there continues the original loss curve
within 1e-5 (fp32, dropout off)."""

import pytest
import torch

from megatron_ul.checkpoint.layout.reshard import merge_tp, split_tp
from tests.checkpoint.runs import NO_DROPOUT, TINY, assert_continues_the_curve, convert_chain
from tests.distributed import run_distributed

ARGV = (
    TINY
    + NO_DROPOUT
    + [
        "--position-embedding-type",
        "rope",
        "--swiglu",
        "--normalization",
        "RMSNorm",
        "--untie-embeddings-and-output-weights",
        "--group-query-attention",
        "--num-query-groups",
        "2",
    ]
)


def test_merge_inverts_split_with_stride():
    full = torch.arange(48.0).view(12, 4)
    for stride, tp in ((1, 3), (2, 2)):
        assert torch.equal(merge_tp(split_tp(full, 0, stride, tp), 0, stride), full)
    # stride 2 keeps matching halves of both blocks on a rank ([gate; up] of SwiGLU)
    assert torch.equal(split_tp(full, 0, 2, 2)[0], torch.cat([full[0:3], full[6:9]]))


@pytest.mark.slow  # default: test_pipeline conversions
def test_converted_checkpoints_continue_the_loss_curve(tmp_path):
    out = run_distributed(convert_chain, 4, ARGV, str(tmp_path))[0]
    assert_continues_the_curve(out)


def test_pipeline_targets_round_trip(tmp_path, single_rank):
    """The name-based stage split, and TP2·PP2 and back to TP1·PP1 reproduces every parameter
    and optimizer moment exactly (training on converted pipelines: test_pipeline.py)."""
    from megatron_ul.checkpoint import files
    from megatron_ul.checkpoint.layout.reshard import convert, read_full
    from megatron_ul.training.pretrain import configure, setup

    src, pp2, back = (str(tmp_path / n) for n in ("src", "pp2", "back"))
    one_iter = ["--train-iters", "1", "--lr-warmup-iters", "0", "--save", src]
    setup(configure(TINY + one_iter, 1)).train()
    convert(src, pp2, tp=2, pp=2)
    convert(pp2, back, tp=1, pp=1)
    stage = [
        files.load_torch(files.model_file(f"{pp2}/iter_0000001", 0, s, 2), "")["model"]
        for s in (0, 1)
    ]
    assert {n.split(".")[1] for n in stage[0] if n.startswith("layers.")} == {"0"}
    assert {n.split(".")[1] for n in stage[1] if n.startswith("layers.")} == {"1"}
    assert "position_embeddings.weight" in stage[0] and "final_norm.weight" in stage[1]
    assert "word_embeddings.weight" not in stage[1]  # tied head: the last stage's copy
    assert torch.equal(
        stage[1]["replica.word_embeddings.weight"], stage[0]["word_embeddings.weight"]
    )
    a, b = read_full(f"{src}/iter_0000001"), read_full(f"{back}/iter_0000001")
    assert a.params.keys() == b.params.keys()
    assert all(torch.equal(a.params[n], b.params[n]) for n in a.params)
    assert all(
        torch.equal(a.optim_state[n]["exp_avg_sq"], b.optim_state[n]["exp_avg_sq"])
        for n in a.optim_state
    )
