"""Sampling rules, and tools/generate.py end to end on a checkpoint saved under TP2 (merged to
TP1 on load)."""

import os
import subprocess
import sys

import pytest
import torch

from megatron_ul.inference.generate import generate, load_for_generation, sample_next
from megatron_ul.mpu.parallel_state import single_rank_dims
from megatron_ul.mpu.random import model_parallel_seed
from tests.checkpoint.runs import NO_DROPOUT, TINY, train
from tests.distributed import run_distributed


def test_greedy_and_top_k_1_take_the_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert sample_next(logits) == 1
    assert sample_next(logits, top_k=1, generator=torch.Generator().manual_seed(0)) == 1


def test_top_k_and_top_p_sample_only_inside_the_kept_set():
    logits = torch.tensor([5.0, 4.0, 3.0, 0.0, -1.0, -2.0])
    g = torch.Generator().manual_seed(0)
    top_k = {sample_next(logits, top_k=3, generator=g) for _ in range(300)}
    assert top_k == {0, 1, 2}
    # probabilities ≈ [.66, .24, .09, ...]: top_p 0.8 keeps the two most likely
    top_p = {sample_next(logits, top_p=0.8, generator=g) for _ in range(300)}
    assert top_p == {0, 1}


def _logits_and_greedy(rank: int, world: int, load_dir: str):
    model_parallel_seed(0, single_rank_dims())
    model = load_for_generation(load_dir)
    tokens = torch.tensor([[5, 17, 42, 3, 99, 150, 7, 64]])
    with torch.no_grad():
        logits = model(tokens, torch.arange(tokens.shape[1]).unsqueeze(0))
    return logits, generate(model, [5, 17, 42], 6)


def _generate_cli(load: str) -> list[str]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.generate",
            "--load",
            load,
            "--prompt",
            "5 17 42",
            "--max-new-tokens",
            "6",
        ],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.slow  # a TP2 save, merge and generate
def test_generate_cli_on_a_tp2_checkpoint(tmp_path):
    """A TP2 checkpoint, merged to TP1 on load, is the model a one-process run trains: the
    same logits (a wrong merge of the column/row shards or the fused QKV is far off) and the
    same greedy continuation from the command line as from the one-process model."""
    argv = TINY + NO_DROPOUT + ["--train-iters", "2", "--tokenizer-type", "NullTokenizer"]
    tp1, tp2 = str(tmp_path / "tp1"), str(tmp_path / "tp2")
    run_distributed(train, 1, argv + ["--save", tp1])
    run_distributed(train, 2, argv + ["--tensor-model-parallel-size", "2", "--save", tp2])
    (merged, _), (reference, greedy) = (
        run_distributed(_logits_and_greedy, 1, d)[0] for d in (tp2, tp1)
    )
    assert merged.shape == reference.shape and merged.shape[-1] >= 200
    assert (merged - reference).abs().max() < 1e-5
    ids = _generate_cli(tp2)
    assert ids[:3] == ["5", "17", "42"] and len(ids) == 9
    assert ids[3:] == [str(i) for i in greedy]
