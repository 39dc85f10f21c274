"""tools/compare_with_transformers.py's pieces: the transformers model built from our initial
weights gives our loss on our batches (both shapes), and its learning rate is our schedule's."""

import pytest

from megatron_ul.training.pretrain import configure, setup
from tests.distributed import run_distributed

TINY = [
    "--mock-data", "--vocab-size", "100", "--num-layers", "2", "--hidden-size", "32",
    "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--train-iters", "20", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "3",
    "--attention-dropout", "0", "--hidden-dropout", "0",
    # large weights: logits far from uniform, so every mapped tensor moves the loss
    "--init-method-std", "0.5",
]  # fmt: skip


def _losses(rank, world, argv, shape):
    import torch

    from megatron_ul.model.chunks import model_dims
    from megatron_ul.training.data import build_datasets, eod_token_for, global_batches
    from megatron_ul.training.step import evaluate_loss
    from tools.compare_with_transformers import hf_loss, hf_model_from_ours, megatron_lr

    cfg = configure(argv, world)
    trainer = setup(cfg)
    eod = eod_token_for(cfg)
    hf = hf_model_from_ours(trainer.model, cfg, shape, eod)
    train_ds, _, _ = build_datasets(cfg)
    batch = next(global_batches(cfg, model_dims(trainer.model), train_ds, torch.device("cpu"), eod))
    with torch.no_grad():
        theirs = float(hf_loss(hf, batch))
    t = cfg.train
    lrs = []
    for step in range(t.train_iters + 3):  # past the decay: min_lr
        written = megatron_lr(step, t.lr, t.min_lr, t.lr_warmup_iters, t.lr_decay_iters)
        lrs.append((written, trainer.scheduler.lr))
        trainer.scheduler.step()
    return evaluate_loss(trainer.model, batch), theirs, lrs


@pytest.mark.parametrize("shape", ["gpt2", "llama"])
def test_transformers_model_from_our_weights_gives_our_loss(shape):
    pytest.importorskip("transformers")
    from tools.compare_with_transformers import SHAPES

    ours, theirs, lrs = run_distributed(_losses, 1, TINY + SHAPES[shape], shape)[0]
    assert abs(ours - theirs) < 1e-5, (ours, theirs)
    assert ours > 6.0  # well above ln(100): the logits are far from uniform
    for written, scheduled in lrs:
        assert written == pytest.approx(scheduled, rel=1e-12, abs=1e-15)
