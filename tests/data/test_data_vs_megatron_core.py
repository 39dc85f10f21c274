"""Splits, blends and sample order against megatron-core's own dataset builder (test-only
reference).

Skipped without megatron-core (`pip install --no-deps megatron-core`); the same
behaviour is pinned by fixed values in test_data_gpt_dataset.py.
"""

import numpy as np
import pytest

from megatron_ul.data.gpt_dataset import BlendedDataset, GPTDataset, build_train_valid_test_datasets
from tests.data.test_data_gpt_dataset import documents_with_token_range, write_dataset

core = pytest.importorskip(
    "megatron.core.datasets.gpt_dataset", reason="megatron-core not installed"
)


class ReferenceTokenizer:
    vocab_size = 1000
    eod = 999
    pad = 998
    unique_identifiers = {"class": "ReferenceTokenizer"}


def megatron_core_datasets(data_path, split, seq_length, sizes, seed, cache):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.utils import get_blend_from_list

    config = core.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=get_blend_from_list(data_path),
        split=split,
        path_to_cache=cache,
        tokenizer=ReferenceTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    return BlendedMegatronDatasetBuilder(core.GPTDataset, list(sizes), lambda: True, config).build()


def assert_same_gpt_dataset(ours, theirs):
    assert isinstance(ours, GPTDataset) and len(ours) == len(theirs)
    np.testing.assert_array_equal(ours.sequences, theirs.indices)
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(
            np.asarray(getattr(ours, name)), np.asarray(getattr(theirs, name)), name
        )


def assert_same_samples(ours, theirs, count=20):
    for index in list(range(min(count, len(ours)))) + [len(ours) - 1]:
        text = ours[index]["text"]
        reference = theirs[index]
        np.testing.assert_array_equal(text[:-1], reference["tokens"].numpy())
        np.testing.assert_array_equal(text[1:], reference["labels"].numpy())


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("core")
    # Different sizes, and a range of token values per prefix; some empty sequences.
    return [
        write_dataset(
            folder / f"p{i}", documents_with_token_range(20 + i, count, 100 * i, 100 * i + 90)
        )
        for i, count in enumerate((1758, 300, 517))
    ]


@pytest.mark.parametrize("split", ["969,30,1", "98,2,0", "1", "33,33,34"])
def test_single_prefix_splits_and_indices(tmp_path, prefixes, split):
    sizes = (2000, 300, 50)
    ours = build_train_valid_test_datasets([prefixes[0]], split, 16, sizes, 1234, cache_path=None)
    theirs = megatron_core_datasets([prefixes[0]], split, 16, sizes, 1234, str(tmp_path))
    for our_split, their_split in zip(ours, theirs):
        assert (our_split is None) == (their_split is None)
        if our_split is not None:
            assert_same_gpt_dataset(our_split, their_split)
            assert_same_samples(our_split, their_split)


@pytest.mark.parametrize("weighted", [True, False])
def test_blends(tmp_path, prefixes, weighted):
    data_path = (
        ["0.5", prefixes[0], "0.2", prefixes[1], "0.3", prefixes[2]] if weighted else list(prefixes)
    )
    sizes = (3000, 200, 40)
    ours = build_train_valid_test_datasets(
        data_path, "90,8,2", 8, sizes, 7, cache_path=str(tmp_path / "ours")
    )
    # No cache path: megatron-core's BlendedDataset asks torch.distributed for the rank when
    # caching.
    theirs = megatron_core_datasets(data_path, "90,8,2", 8, sizes, 7, None)
    for our_split, their_split in zip(ours, theirs):
        assert isinstance(our_split, BlendedDataset) and len(our_split) == len(their_split)
        np.testing.assert_array_equal(
            np.asarray(our_split.dataset_index), their_split.dataset_index
        )
        np.testing.assert_array_equal(
            np.asarray(our_split.dataset_sample_index), their_split.dataset_sample_index
        )
        for our_component, their_component in zip(our_split.datasets, their_split.datasets):
            assert_same_gpt_dataset(our_component, their_component)
        for index in range(30):
            reference = their_split[index]
            np.testing.assert_array_equal(
                our_split[index]["text"][:-1], reference["tokens"].numpy()
            )


def test_single_prefix_with_weight_is_a_blend(tmp_path, prefixes):
    ours = build_train_valid_test_datasets(
        ["1.0", prefixes[1]], "1", 8, (500, 0, 0), 3, cache_path=None
    )
    theirs = megatron_core_datasets(["1.0", prefixes[1]], "1", 8, (500, 0, 0), 3, None)
    assert isinstance(ours[0], BlendedDataset) and len(ours[0]) == len(theirs[0]) == 500
    assert_same_gpt_dataset(ours[0].datasets[0], theirs[0].datasets[0])
