"""Layout conversion: a checkpoint converted to another layout (offline with
tools/checkpoint/convert.py, or on load) and resumed there continues the original loss curve
within 1e-5 (fp32, dropout off)."""
import torch

from megatron_ul.checkpoint.reshard import merge_tp, split_tp
from tests.checkpoint.runs import NO_DROPOUT, TINY, convert_chain
from tests.distributed import run_distributed

ARGV = TINY + NO_DROPOUT + ["--position-embedding-type", "rope", "--swiglu",
                            "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights",
                            "--group-query-attention", "--num-query-groups", "2"]


def test_merge_inverts_split_with_stride():
    full = torch.arange(48.0).view(12, 4)
    for stride, tp in ((1, 3), (2, 2)):
        assert torch.equal(merge_tp(split_tp(full, 0, stride, tp), 0, stride), full)
    # stride 2 keeps matching halves of both blocks on a rank ([gate; up] of SwiGLU)
    assert torch.equal(split_tp(full, 0, 2, 2)[0], torch.cat([full[0:3], full[6:9]]))


def test_converted_checkpoints_continue_the_loss_curve(tmp_path):
    out = run_distributed(convert_chain, 4, ARGV, str(tmp_path))[0]
    original = out.pop("original")
    assert len(original) == 4
    for name, resumed in out.items():
        diff = max(abs(a - b) for a, b in zip(resumed, original[2:]))
        print(f"{name}: original {original[2:]} resumed {resumed} max diff {diff:.2e}")
        assert len(resumed) == 2 and diff < 1e-5, name
