"""GPTDataset indices, caching, splits, blending, and the mock dataset."""

import os

import numpy as np
import pytest

from megatron_ul.data import gpt_dataset, index_cache
from megatron_ul.data.gpt_dataset import (
    GPTDataset,
    build_sample_index,
    build_train_valid_test_datasets,
    parse_data_path,
    split_ranges,
)
from megatron_ul.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron_ul.data.mock import MockGPTDataset
from tools.local_ranks import run_on_local_ranks


def write_dataset(prefix, documents, dtype=np.int32):
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    for document in documents:
        builder.add_item(document)
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


def documents_with_token_range(seed, count, low, high, include_empty=True):
    rng = np.random.default_rng(seed)
    documents = [rng.integers(low, high, size=rng.integers(1, 40)) for _ in range(count)]
    if include_empty:
        documents[3] = np.array([], dtype=np.int64)
        documents[4] = np.array([], dtype=np.int64)
    return documents


def megatron_sample_index(sizes, doc_idx, seq_length, num_samples):
    """Straight port of Megatron's C++ build_sample_idx, as an independent reference."""
    sample_idx = np.zeros((num_samples + 1, 2), dtype=np.int64)
    doc_idx_index, doc_offset = 0, 0
    for sample_index in range(1, num_samples + 1):
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = sizes[doc_idx[doc_idx_index]] - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        sample_idx[sample_index] = (doc_idx_index, doc_offset)
    return sample_idx


def test_sample_index_matches_megatron_loop():
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 30, size=50)
    sizes[[0, 7, 8]] = 0
    doc_idx = rng.permutation(np.tile(np.arange(50), 3)).astype(np.int32)
    for seq_length in (1, 7, 64):
        ours = build_sample_index(sizes, doc_idx, seq_length)
        num_samples = ours.shape[0] - 1
        assert num_samples == (int(sizes.sum()) * 3 - 1) // seq_length
        np.testing.assert_array_equal(
            ours, megatron_sample_index(sizes, doc_idx, seq_length, num_samples)
        )


@pytest.mark.parametrize("num_samples", [10, 200])  # one epoch, and several epochs
def test_samples_are_windows_of_the_shuffled_document_stream(tmp_path, num_samples):
    documents = documents_with_token_range(0, 30, 0, 500)
    dataset = IndexedDataset(write_dataset(tmp_path / "d", documents))
    seq_length = 16
    gpt = GPTDataset(dataset, (0, 30), num_samples, seq_length, seed=5)
    assert len(gpt) >= num_samples
    stream = np.concatenate([documents[d] for d in gpt.document_index])
    seen = set()
    for index in range(len(gpt)):
        text = gpt[index]["text"]
        assert text.dtype == np.int64 and len(text) == seq_length + 1
        sample = int(gpt.shuffle_index[index])
        np.testing.assert_array_equal(
            text, stream[sample * seq_length : sample * seq_length + seq_length + 1]
        )
        seen.add(sample)
    assert seen == set(range(len(gpt)))  # the shuffle is a permutation
    assert (
        sorted(np.bincount(gpt.document_index)[:30].tolist())
        == [len(gpt.document_index) // 30] * 30
    )


def test_index_determinism_and_cache(tmp_path):
    prefix = write_dataset(tmp_path / "d", documents_with_token_range(1, 40, 0, 500))
    args = ([prefix], "80,15,5", 8, (300, 20, 10), 1234)
    in_memory = build_train_valid_test_datasets(*args, cache_path=None)
    again = build_train_valid_test_datasets(*args, cache_path=None)
    cache = str(tmp_path / "cache")
    first = build_train_valid_test_datasets(*args, cache_path=cache)
    cached_files = sorted(os.listdir(os.path.join(cache, "GPTDataset_indices")))
    assert len(cached_files) == 3 * 4  # three splits x (3 indices + description)
    from_cache = build_train_valid_test_datasets(*args, cache_path=cache)
    assert sorted(os.listdir(os.path.join(cache, "GPTDataset_indices"))) == cached_files
    assert isinstance(from_cache[0].shuffle_index, np.memmap)
    for datasets in (again, first, from_cache):
        for split, reference in zip(datasets, in_memory):
            assert len(split) == len(reference)
            for name in gpt_dataset.INDEX_KINDS:
                np.testing.assert_array_equal(getattr(split, name), getattr(reference, name))
            for index in range(len(split)):
                np.testing.assert_array_equal(split[index]["text"], reference[index]["text"])
    other_seed = build_train_valid_test_datasets(*args[:4], 99, cache_path=cache)
    assert not np.array_equal(other_seed[0].shuffle_index, in_memory[0].shuffle_index)
    assert len(os.listdir(os.path.join(cache, "GPTDataset_indices"))) == 2 * len(cached_files)


def test_non_builder_rank_waits_for_rank_zero(tmp_path, monkeypatch):
    prefix = write_dataset(tmp_path / "d", documents_with_token_range(2, 20, 0, 100))
    dataset = IndexedDataset(prefix)
    cache = str(tmp_path / "cache")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(index_cache, "CACHE_WAIT_TIMEOUT_S", 0.2)
    with pytest.raises(TimeoutError, match="description.json"):
        GPTDataset(dataset, (0, 20), 50, 8, seed=3, cache_path=cache)
    monkeypatch.setenv("RANK", "0")
    built = GPTDataset(dataset, (0, 20), 50, 8, seed=3, cache_path=cache)
    monkeypatch.setenv("RANK", "1")
    loaded = GPTDataset(dataset, (0, 20), 50, 8, seed=3, cache_path=cache)
    np.testing.assert_array_equal(loaded.shuffle_index, built.shuffle_index)


def test_split_ranges_and_parsing():
    # megatron-core: cumulative fractions, round(fraction * sequences) with Python's round.
    assert split_ranges("969,30,1", 1758) == [(0, 1704), (1704, 1756), (1756, 1758)]
    assert split_ranges("949,50,1", 1000) == [(0, 949), (949, 999), (999, 1000)]
    assert split_ranges("1", 7) == [(0, 7), None, None]
    assert split_ranges("98,2", 100) == [(0, 98), (98, 100), None]
    assert split_ranges("1,1,1", 10) == [(0, 3), (3, 7), (7, 10)]
    assert split_ranges("1,1,2", 10) == [(0, 2), (2, 5), (5, 10)]  # round(2.5) == 2: half to even
    with pytest.raises(ValueError, match="--split"):
        split_ranges("a,b", 10)
    with pytest.raises(ValueError, match="--split"):
        split_ranges("0,0,0", 10)
    assert parse_data_path(["a/b_text_document"]) == (["a/b_text_document"], None)
    assert parse_data_path(["0.3", "x", "0.7", "y"]) == (["x", "y"], [0.3, 0.7])
    assert parse_data_path(["0.3 x 0.7 y"]) == (["x", "y"], [0.3, 0.7])
    assert parse_data_path(["x", "y"]) == (["x", "y"], None)
    for bad in (
        ["0.3", "x", "y"],
        ["nan", "x"],
        ["inf", "x", "1", "y"],
        ["0", "x", "1", "y"],
        ["-1", "x"],
    ):
        with pytest.raises(ValueError, match="--data-path"):
            parse_data_path(bad)


def test_split_documents_are_disjoint(tmp_path):
    # Each document holds only its own id, so a sample reveals which documents it used.
    documents = [np.full(10, doc_id) for doc_id in range(100)]
    prefix = write_dataset(tmp_path / "d", documents)
    train, valid, test = build_train_valid_test_datasets(
        [prefix], "80,15,5", 9, (50, 20, 5), seed=0
    )
    used = [
        set(np.concatenate([split[i]["text"] for i in range(len(split))]).tolist())
        for split in (train, valid, test)
    ]
    assert (
        used[0] <= set(range(80))
        and used[1] <= set(range(80, 95))
        and used[2] <= set(range(95, 100))
    )
    assert build_train_valid_test_datasets([prefix], "100,0,0", 9, (50, 20, 5), seed=0)[1:] == (
        None,
        None,
    )


def test_blending_proportions_within_one_percent(tmp_path):
    # Token ranges tell the source of every sample without trusting the blend's own bookkeeping.
    ranges = [(0, 1000), (1000, 2000), (2000, 3000)]
    prefixes = [
        write_dataset(tmp_path / f"p{i}", documents_with_token_range(10 + i, 300, low, high, False))
        for i, (low, high) in enumerate(ranges)
    ]
    weights = [0.2, 0.5, 0.3]
    data_path = [
        item for weight, prefix in zip(weights, prefixes) for item in (str(weight), prefix)
    ]
    train, _, _ = build_train_valid_test_datasets(
        data_path, "1", 32, (10000, 0, 0), seed=7, cache_path=str(tmp_path / "cache")
    )
    assert len(train) == 10000
    sources = np.array([train[i]["text"][0] // 1000 for i in range(len(train))])
    for source, weight in enumerate(weights):
        assert abs(np.mean(sources == source) - weight) < 0.01
    # Any prefix of the blend is balanced too (greedy error minimisation).
    first_hundred = np.bincount(sources[:100], minlength=3)
    assert np.all(np.abs(first_hundred - np.array(weights) * 100) <= 1)


def test_mock_dataset_is_deterministic():
    mock = MockGPTDataset(num_samples=50, seq_length=16, vocab_size=7, seed=3)
    again = MockGPTDataset(num_samples=50, seq_length=16, vocab_size=7, seed=3)
    other = MockGPTDataset(num_samples=50, seq_length=16, vocab_size=7, seed=4)
    assert len(mock) == 50
    for index in (0, 17, 49):
        text = mock[index]["text"]
        assert text.dtype == np.int64 and text.shape == (17,)
        assert text.min() >= 0 and text.max() < 7
        np.testing.assert_array_equal(text, again[index]["text"])
    assert not np.array_equal(mock[0]["text"], mock[1]["text"])
    assert not np.array_equal(mock[0]["text"], other[0]["text"])
    with pytest.raises(IndexError):
        mock[50]


def _build_on_rank(rank, world_size, prefix, cache):
    dataset = GPTDataset(IndexedDataset(prefix), (0, 30), 80, 8, seed=11, cache_path=cache)
    return np.asarray(dataset.shuffle_index).tolist(), isinstance(dataset.shuffle_index, np.memmap)


def test_two_distributed_ranks_share_one_build(tmp_path):
    prefix = write_dataset(tmp_path / "d", documents_with_token_range(4, 30, 0, 100))
    cache = str(tmp_path / "cache")
    # Spawned gloo ranks (run_on_local_ranks): an mp.Manager's server process here segfaulted
    # once during garbage collection in a full-suite run.
    results = run_on_local_ranks(_build_on_rank, 2, prefix, cache)
    assert results[0] == results[1] and results[0][1]
    reference = GPTDataset(IndexedDataset(prefix), (0, 30), 80, 8, seed=11)
    assert results[0][0] == reference.shuffle_index.tolist()
    assert len(os.listdir(os.path.join(cache, "GPTDataset_indices"))) == 4


def test_fixed_indices_recorded_from_megatron_core(tmp_path):
    """Values recorded from megatron-core 0.16.1's BlendedMegatronDatasetBuilder on these files
    (tests/data/test_data_vs_megatron_core.py compares live when it is installed)."""
    p = write_dataset(tmp_path / "p", documents_with_token_range(2, 20, 0, 100))
    q = write_dataset(tmp_path / "q", documents_with_token_range(3, 15, 100, 200))
    train, valid, test = build_train_valid_test_datasets(
        [p], "80,15,5", 8, (60, 10, 5), 3, cache_path=None
    )
    assert [split.sequence_range for split in (train, valid, test)] == [(0, 16), (16, 19), (19, 20)]
    assert train.document_index.tolist() == [
        4,
        1,
        5,
        14,
        12,
        11,
        4,
        15,
        2,
        2,
        0,
        1,
        7,
        10,
        7,
        13,
        12,
        13,
        6,
        6,
        9,
        11,
        15,
        3,
        5,
        0,
        8,
        14,
        3,
        9,
        8,
        10,
    ]
    assert train.sample_index[:6].tolist() == [[0, 0], [1, 8], [1, 16], [1, 24], [1, 32], [3, 1]]
    assert train.shuffle_index.tolist() == [
        19,
        40,
        9,
        47,
        26,
        36,
        3,
        22,
        58,
        6,
        53,
        34,
        25,
        12,
        8,
        35,
        4,
        2,
        62,
        17,
        50,
        39,
        49,
        5,
        13,
        31,
        23,
        11,
        60,
        59,
        32,
        44,
        38,
        16,
        27,
        10,
        52,
        1,
        54,
        55,
        57,
        51,
        18,
        41,
        45,
        0,
        28,
        14,
        21,
        30,
        20,
        37,
        48,
        15,
        61,
        43,
        56,
        7,
        24,
        42,
        29,
        33,
        46,
    ]
    assert train[0]["text"].tolist() == [26, 10, 29, 41, 81, 45, 9, 33, 60]
    weighted = build_train_valid_test_datasets(
        ["0.7", p, "0.3", q], "1", 8, (40, 0, 0), 5, cache_path=None
    )[0]
    assert weighted.dataset_index.tolist() == [0, 1, 0, 0, 1, 0, 0, 1, 0, 0] * 4
    assert weighted.dataset_sample_index.tolist()[:12] == [0, 0, 1, 2, 1, 3, 4, 2, 5, 6, 7, 3]
    # Unweighted: one epoch per prefix (41 and 26 samples), the blend capped at their sum.
    unweighted = build_train_valid_test_datasets([p, q], "1", 8, (1000, 0, 0), 5, cache_path=None)[
        0
    ]
    assert len(unweighted) == 67 and [len(d) for d in unweighted.datasets] == [41, 26]
    assert unweighted.dataset_index[:20].tolist() == [
        0,
        1,
        0,
        1,
        0,
        0,
        1,
        0,
        1,
        0,
        0,
        1,
        0,
        1,
        0,
        0,
        1,
        0,
        0,
        1,
    ]
