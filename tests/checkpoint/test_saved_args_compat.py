"""Checkpoints written before the resolved config kept --vocab-size as given: their saved
arguments have no data.given_vocab_size (and model.vocab_size is the model's, as now). They
load and resume the curve exactly."""

import dataclasses
import glob
import os

import torch

from megatron_ul.checkpoint import files
from megatron_ul.checkpoint.training import save as checkpoint_save
from tests.checkpoint.runs import NO_DROPOUT, TINY, train


def _as_saved_before(cfg) -> dict:
    """asdict as the checkpoint writer saw it before: a data section without the field."""
    out = dataclasses.asdict(cfg)
    if isinstance(out.get("data"), dict):
        out["data"].pop("given_vocab_size", None)
    return out


def test_a_checkpoint_with_the_old_saved_arguments_resumes_exactly(
    tmp_path, single_rank, monkeypatch
):
    save_dir = str(tmp_path / "ckpt")
    argv = TINY + NO_DROPOUT + ["--tokenizer-type", "NullTokenizer"]
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint_save, "asdict", _as_saved_before)
        full = train(
            0, 1, argv + ["--train-iters", "3", "--save", save_dir, "--save-interval", "2"]
        )
    files.release_save_dir(save_dir)
    files.write_tracker(save_dir, 2)  # resume from iteration 2, as if the run had stopped there
    resumed = train(0, 1, argv + ["--train-iters", "3", "--load", save_dir])
    payloads = glob.glob(
        os.path.join(save_dir, files.iteration_dir_name(2), "**", "*.pt"), recursive=True
    )
    args = [
        p["args"]
        for p in (torch.load(path, weights_only=False) for path in payloads)
        if isinstance(p, dict) and "args" in p
    ]
    assert args and all("given_vocab_size" not in a["data"] for a in args)
    assert args[0]["model"]["vocab_size"] == 200  # the model's (mock data: --vocab-size)
    assert len(full) == 3 and resumed == full[2:]  # bitwise: the same curve
