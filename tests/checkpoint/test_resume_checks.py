"""What a resume must get right besides the weights: the true data position across
--global-batch-size changes, the LR schedule (refused when the flags differ unless Megatron's
--override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler says who wins), and every
model field that changes the computed function, named by its flag."""

import os

import pytest

from megatron_ul.checkpoint import files
from megatron_ul.training.pretrain import configure, setup
from tests.checkpoint.runs import TINY

ARGV = TINY + ["--lr-decay-iters", "6"]


def _payload(directory: str, iteration: int) -> dict:
    return files.load_torch(
        files.model_file(os.path.join(directory, files.iteration_dir_name(iteration)), 0, 0, 1), ""
    )


def test_consumed_samples_are_counted_across_batch_size_changes(tmp_path, single_rank):
    d = str(tmp_path / "ckpt")
    setup(
        configure(ARGV + ["--global-batch-size", "2", "--train-iters", "4", "--save", d], 1)
    ).train()
    assert _payload(d, 4)["consumed_samples"] == 8
    trainer = setup(
        configure(
            ARGV + ["--global-batch-size", "4", "--train-iters", "6", "--load", d, "--save", d], 1
        )
    )
    assert trainer.resume.consumed_samples == 8  # the data resumes at sample 8
    trainer.train()
    assert _payload(d, 6)["consumed_samples"] == 8 + 2 * 4  # not 6 × 4 = 24


@pytest.fixture
def saved(tmp_path, single_rank):
    d = str(tmp_path / "ckpt")
    setup(configure(ARGV + ["--train-iters", "2", "--save", d], 1)).train()
    return d


def _error(argv) -> str:
    with pytest.raises(Exception) as info:
        setup(configure(argv, 1))
    return str(info.value)


SCHEDULE_CHANGES = [
    (["--lr", "2e-3"], "--lr: checkpoint 0.001, this run 0.002"),
    (["--min-lr", "0"], "--min-lr: checkpoint 0.0001, this run 0.0"),
    (["--lr-warmup-iters", "2"], "--lr-warmup-iters: checkpoint 1, this run 2"),
    (["--lr-decay-style", "linear"], "--lr-decay-style: checkpoint 'cosine', this run 'linear'"),
    (
        ["--lr-decay-iters", "8"],
        "--lr-decay-iters (default --train-iters): checkpoint 6, this run 8",
    ),
]


def test_a_different_schedule_is_refused_naming_the_flag(saved):
    for flags, named in SCHEDULE_CHANGES:
        message = _error(ARGV + ["--train-iters", "4", "--load", saved] + flags)
        assert named in message and "--override-opt_param-scheduler" in message
        assert "--use-checkpoint-opt_param-scheduler" in message


def test_override_and_use_checkpoint_say_which_schedule_wins(saved):
    argv = ARGV + ["--train-iters", "4", "--load", saved, "--lr", "2e-3"]
    ours = setup(configure(argv + ["--override-opt_param-scheduler"], 1)).scheduler
    assert (ours.max_lr, ours.num_steps) == (2e-3, 2)
    theirs = setup(configure(argv + ["--use-checkpoint-opt_param-scheduler"], 1)).scheduler
    assert (theirs.max_lr, theirs.num_steps) == (1e-3, 2)
    assert "conflict" in _error(
        argv + ["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"]
    )


def test_fields_that_change_the_function_are_checked(tmp_path, single_rank):
    d, rope = str(tmp_path / "rope"), ARGV + ["--position-embedding-type", "rope"]
    one_iter = ["--train-iters", "1", "--lr-warmup-iters", "0", "--save", d]
    setup(configure(rope + one_iter, 1)).train()
    for flags, named in [
        (["--gelu-approximate", "tanh"], "--gelu-approximate: checkpoint 'none', this run 'tanh'"),
        (["--norm-epsilon", "1e-6"], "--norm-epsilon: checkpoint 1e-05, this run 1e-06"),
        (["--rotary-base", "500"], "--rotary-base: checkpoint 10000.0, this run 500.0"),
    ]:
        assert named in _error(rope + ["--train-iters", "2", "--load", d] + flags)
