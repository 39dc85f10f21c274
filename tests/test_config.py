"""Bad configurations fail before any model is built, with a message naming the flags."""

import pytest

from megatron_ul.config import ConfigError
from megatron_ul.training.pretrain import configure

OK = [
    "--mock-data",
    "--vocab-size",
    "100",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "8",
    "--seq-length",
    "64",
]


def test_valid_configuration_derives_data_parallel_size_and_batches():
    cfg = configure(
        OK
        + [
            "--tensor-model-parallel-size",
            "2",
            "--ds-sequence-parallel-size",
            "2",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "16",
        ],
        world_size=8,
    )
    assert cfg.parallel.data_parallel_size == 2
    assert cfg.num_micro_batches == 4
    assert cfg.model.padded_vocab_size(2) == 256


@pytest.mark.parametrize(
    "flags,world,expected",
    [
        (
            ["--tensor-model-parallel-size", "2", "--ds-sequence-parallel-size", "2"],
            6,
            "world size 6 is not divisible by --tensor-model-parallel-size × "
            "--ds-sequence-parallel-size",
        ),
        (["--ds-sequence-parallel-size", "16"], 16, "--num-attention-heads 8 is not divisible by"),
        (
            ["--group-query-attention", "--num-query-groups", "3"],
            1,
            "--num-attention-heads 8 is not divisible by --num-query-groups 3",
        ),
        (
            [
                "--group-query-attention",
                "--num-query-groups",
                "2",
                "--tensor-model-parallel-size",
                "4",
            ],
            4,
            "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4",
        ),
        (
            ["--seq-length", "60", "--ds-sequence-parallel-size", "8"],
            8,
            "--seq-length 60 is not divisible by --ds-sequence-parallel-size = 8",
        ),
        (
            [
                "--seq-length",
                "36",
                "--ds-sequence-parallel-size",
                "2",
                "--tensor-model-parallel-size",
                "4",
                "--sequence-parallel",
            ],
            8,
            "with --sequence-parallel) = 8",
        ),
        (
            ["--micro-batch-size", "3", "--global-batch-size", "8"],
            2,
            "--global-batch-size 8 is not divisible by --micro-batch-size × data-parallel "
            "size = 3×2",
        ),
        (["--max-position-embeddings", "32"], 1, "--max-position-embeddings 32 is smaller than"),
        (["--bf16", "--fp16"], 1, "--bf16 and --fp16 are mutually exclusive"),
    ],
)
def test_bad_configuration_names_the_flags(flags, world, expected):
    with pytest.raises(ConfigError) as err:
        configure(OK + flags, world_size=world)
    assert expected in str(err.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        configure(
            OK
            + [
                "--seq-length",
                "63",
                "--ds-sequence-parallel-size",
                "2",
                "--micro-batch-size",
                "3",
                "--global-batch-size",
                "4",
            ],
            world_size=2,
        )
    assert "--seq-length 63" in str(err.value) and "--global-batch-size 4" in str(err.value)


def test_mock_data_needs_a_vocab_size():
    with pytest.raises(ConfigError, match="--mock-data needs --vocab-size"):
        configure(["--mock-data"], world_size=1)


def test_no_data_is_an_error():
    with pytest.raises(ConfigError, match="no training data"):
        configure(["--vocab-size", "100"], world_size=1)


def test_missing_tokenizer_file_names_the_flag(tmp_path):
    missing = tmp_path / "none.model"
    with pytest.raises(ConfigError) as raised:
        configure(
            OK + ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(missing)],
            world_size=1,
        )
    assert f"--tokenizer-model {missing}: no such file" in str(raised.value)
