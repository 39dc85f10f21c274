"""Pipeline configurations that cannot work fail in validate(), naming the flags."""

import pytest

from megatron_ul.config import ConfigError
from megatron_ul.training.pretrain import configure

BASE = [
    "--mock-data",
    "--vocab-size",
    "1000",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "1",
]


def test_layers_not_divisible_by_pipeline_size():
    with pytest.raises(
        ConfigError, match="--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"
    ):
        configure(BASE + ["--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2)


def test_layers_not_divisible_into_virtual_stages():
    with pytest.raises(ConfigError, match="--num-layers-per-virtual-pipeline-stage = 2×3"):
        configure(
            BASE
            + [
                "--num-layers",
                "4",
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "3",
                "--global-batch-size",
                "4",
            ],
            2,
        )


def test_virtual_stages_need_pipeline():
    with pytest.raises(ConfigError, match="needs --pipeline-model-parallel-size > 1"):
        configure(BASE + ["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"], 1)


def test_interleaving_needs_micro_batches_multiple_of_stages():
    with pytest.raises(ConfigError, match="multiple of --pipeline-model-parallel-size 2"):
        configure(
            BASE
            + [
                "--num-layers",
                "4",
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--global-batch-size",
                "3",
            ],
            2,
        )


def test_valid_pipeline_configurations_pass():
    cfg = configure(
        BASE
        + [
            "--num-layers",
            "8",
            "--pipeline-model-parallel-size",
            "4",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
            "--global-batch-size",
            "8",
        ],
        4,
    )
    assert cfg.num_micro_batches == 8
    configure(BASE + ["--num-layers", "4", "--pipeline-model-parallel-size", "2"], 4)
