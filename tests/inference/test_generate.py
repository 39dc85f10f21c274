"""Sampling rules, and tools/generate.py end to end on a checkpoint saved under TP2 (merged to
TP1 on load)."""
import os
import subprocess
import sys

import torch

from megatron_ul.inference.generate import sample_next
from tests.checkpoint.runs import TINY, train
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


def test_generate_cli_on_a_tp2_checkpoint(tmp_path):
    save = str(tmp_path / "ckpt")
    argv = TINY + ["--train-iters", "2", "--tensor-model-parallel-size", "2", "--save", save,
                   "--tokenizer-type", "NullTokenizer"]
    run_distributed(train, 2, argv)
    out = subprocess.run([sys.executable, "-m", "tools.generate", "--load", save, "--prompt",
                          "5 17 42", "--max-new-tokens", "6"], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr
    ids = out.stdout.split()
    assert ids[:3] == ["5", "17", "42"] and 3 < len(ids) <= 9
    assert all(0 <= int(i) < 200 for i in ids)
