"""The storage table (checkpoint/storage): one entry per --ckpt-format, each reading back what
it wrote, and a checkpoint in a format the table does not know refused naming its file."""

import os
import typing

import pytest
import torch

from megatron_ul.checkpoint import files, storage
from megatron_ul.checkpoint.files import CheckpointError
from megatron_ul.checkpoint.layout import reshard
from megatron_ul.config import CheckpointConfig
from tests.checkpoint.conftest import copy_of


def test_the_table_holds_every_ckpt_format_choice():
    choices = typing.get_args(typing.get_type_hints(CheckpointConfig)["ckpt_format"])
    assert sorted(storage.FORMATS) == sorted(choices)
    for name, fmt in storage.FORMATS.items():
        assert fmt.name == name and storage.storage_format(name) is fmt
    with pytest.raises(CheckpointError, match="--ckpt-format 'zarr'"):
        storage.storage_format("zarr")


def test_both_formats_read_back_the_same_training_state(pristine):
    """The same two iterations saved in each format: each format's own reader (torch files
    merged by the table; DCP pieces assembled) gives the same tensors."""
    full = {
        name: reshard.read_full(os.path.join(d, files.iteration_dir_name(2)))
        for name, d in pristine.items()
    }
    a, b = full["torch"], full["torch_dist"]
    assert a.metadata["storage"] == "torch" and b.metadata["storage"] == "torch_dist"
    assert sorted(a.params) == sorted(b.params) and a.params
    for name in a.params:
        assert torch.equal(a.params[name], b.params[name]), name
    assert a.optim_state is not None and b.optim_state is not None
    assert sorted(a.optim_state) == sorted(b.optim_state)
    for name, state in a.optim_state.items():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[k], b.optim_state[name][k]), (name, k)
    assert a.common["consumed_samples"] == b.common["consumed_samples"]


def test_an_unknown_storage_format_is_refused_naming_the_file(pristine, tmp_path):
    d = copy_of(pristine, "torch", tmp_path / "ckpt")
    iter_dir = os.path.join(d, files.iteration_dir_name(2))
    meta = files.read_metadata(iter_dir)
    meta["storage"] = "zarr"  # as a later version might write, with a valid checksum
    files.write_metadata(iter_dir, meta)
    with pytest.raises(CheckpointError, match=r"metadata\.json: unknown storage format 'zarr'"):
        reshard.read_full(iter_dir)
