"""The index cache: keyed by the .idx contents, damaged sets named and rebuilt, read-only use."""

import logging
import os

import numpy as np
import pytest

from megatron_ul.data import index_cache
from megatron_ul.data.gpt_dataset import GPTDataset, build_train_valid_test_datasets
from megatron_ul.data.indexed_dataset import IndexedDataset
from tests.data.test_data_gpt_dataset import documents_with_token_range, write_dataset


def all_samples(dataset):
    return np.stack([dataset[i]["text"] for i in range(len(dataset))])


def build(prefix, cache):
    return GPTDataset(
        IndexedDataset(prefix), (0, len(IndexedDataset(prefix))), 60, 8, seed=1, cache_path=cache
    )


def cache_files(cache):
    folder = os.path.join(cache, "GPTDataset_indices")
    return sorted(os.path.join(folder, name) for name in os.listdir(folder))


def test_rewritten_data_under_the_same_prefix_gets_new_indices(tmp_path):
    cache = str(tmp_path / "cache")
    prefix = write_dataset(tmp_path / "d", documents_with_token_range(1, 40, 0, 500))
    build(prefix, cache)
    # Same prefix, same number of documents, different lengths: the old indices would read
    # wrong tokens.
    write_dataset(tmp_path / "d", documents_with_token_range(2, 40, 0, 500))
    rebuilt = build(prefix, cache)
    np.testing.assert_array_equal(all_samples(rebuilt), all_samples(build(prefix, None)))
    assert len(cache_files(cache)) == 8  # two index sets side by side


@pytest.mark.parametrize(
    "damage", ["delete_array", "truncate_array", "garbage_marker", "wrong_values"]
)
def test_damaged_cache_is_named_and_rebuilt(tmp_path, caplog, damage):
    cache = str(tmp_path / "cache")
    prefix = write_dataset(tmp_path / "d", documents_with_token_range(3, 40, 0, 500))
    reference = all_samples(build(prefix, None))
    build(prefix, cache)
    shuffle = [path for path in cache_files(cache) if path.endswith("shuffle_index.npy")][0]
    marker = [path for path in cache_files(cache) if path.endswith("description.json")][0]
    if damage == "delete_array":
        os.remove(shuffle)
    elif damage == "truncate_array":
        with open(shuffle, "r+b") as handle:
            handle.truncate(os.path.getsize(shuffle) - 8)
    elif damage == "garbage_marker":
        with open(marker, "w") as handle:
            handle.write("{not json")
    else:  # same shape and dtype, values out of range
        array = np.load(shuffle)
        np.save(shuffle, array + len(array))
    with caplog.at_level(logging.WARNING, logger="megatron_ul"):
        dataset = build(prefix, cache)
    assert "rebuilding" in caplog.text
    assert (
        (os.path.basename(shuffle) in caplog.text)
        or (os.path.basename(marker) in caplog.text)
        or "-*.npy: corrupt" in caplog.text
    )
    np.testing.assert_array_equal(all_samples(dataset), reference)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_ul"):
        build(prefix, cache)  # repaired: a clean hit
    assert "rebuilding" not in caplog.text


def test_read_only_cache(tmp_path, monkeypatch, caplog):
    cache = str(tmp_path / "cache")
    prefix = write_dataset(tmp_path / "d", documents_with_token_range(4, 40, 0, 500))
    build(prefix, cache)
    before = {path: os.path.getmtime(path) for path in cache_files(cache)}

    def refuse(self, arrays):
        raise PermissionError(13, "Permission denied", self.cache_dir)

    monkeypatch.setattr(index_cache.IndexCache, "_write", refuse)
    loaded = build(prefix, cache)  # a hit needs no write
    assert isinstance(loaded.shuffle_index, np.memmap)
    with caplog.at_level(logging.WARNING, logger="megatron_ul"):
        other = GPTDataset(
            IndexedDataset(prefix), (0, 40), 90, 8, seed=2, cache_path=cache
        )  # a miss
    assert "not writable" in caplog.text and len(other) >= 90
    assert {path: os.path.getmtime(path) for path in cache_files(cache)} == before


def test_default_cache_is_beside_the_data(tmp_path):
    (tmp_path / "data").mkdir()
    prefix = write_dataset(tmp_path / "data" / "d", documents_with_token_range(5, 40, 0, 500))
    train, _, _ = build_train_valid_test_datasets([prefix], "1", 8, (50, 0, 0), 1)
    assert isinstance(train.shuffle_index, np.memmap)
    assert os.listdir(tmp_path / "data" / "index_cache" / "GPTDataset_indices")
