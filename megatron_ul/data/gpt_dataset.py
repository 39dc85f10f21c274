"""GPT pretraining datasets over MMIDIDX files: megatron-core's splits, indices and blends.

A ``GPTDataset`` sample is ``seq_length + 1`` consecutive tokens of a shuffled
stream of sequences (samples cross sequence boundaries; consecutive samples
share one token so every token is predicted once). Three indices define it,
built exactly as megatron-core's GPTDataset builds them (same arrays for the
same .bin/.idx, split, sample count and seed):

* document index: the split's sequence ids, repeated for as many epochs as the
  requested samples need, shuffled (a short final epoch is shuffled apart);
* sample index: row i = (position in the document index, token offset) where
  sample i starts; row i + 1 is where it ends (inclusive);
* shuffle index: a permutation of the samples.

``--split`` cuts the sequences (megatron-core splits GPT data by sequence, with
Python's round()); blends follow megatron-core's BlendedMegatronDatasetBuilder.
Indices are cached by index_cache.IndexCache.
"""

import functools
import logging
import math
import os
import re
from typing import Any

import numpy as np

from megatron_ul.data.index_cache import IndexCache
from megatron_ul.data.indexed_dataset import IndexedDataset

log = logging.getLogger("megatron_ul")

INDEX_KINDS = ("document_index", "sample_index", "shuffle_index")
SPLIT_NAMES = ("train", "valid", "test")
# megatron-core shuffles a final epoch separately when it would contribute less
# than this fraction of an epoch, so that its samples are not all clumped late.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
# Each weighted blend component is built with this surplus over its share
# (megatron-core's mid_level_dataset_surplus).
MID_LEVEL_DATASET_SURPLUS = 0.005
DEFAULT_CACHE_FOLDER = "index_cache"


class DataError(ValueError):
    """Data that training cannot use; the message names the flag and file."""


def parse_data_path(data_path):
    """Splits ``--data-path`` values into (prefixes, weights or None).

    Accepts ``[prefix, ...]`` or ``[weight, prefix, weight, prefix, ...]``;
    a single string is split on whitespace. Weights must be finite and > 0
    (megatron-core asserts that only when it blends).
    """
    if isinstance(data_path, str):
        data_path = [data_path]
    items = [token for item in data_path for token in item.split()]
    if not items:
        raise ValueError("--data-path is empty")
    if len(items) % 2 == 0 and all(_is_number(items[i]) for i in range(0, len(items), 2)):
        weights = [float(items[i]) for i in range(0, len(items), 2)]
        prefixes = items[1::2]
        bad = [weight for weight in weights if not math.isfinite(weight) or weight <= 0]
        if bad:
            raise ValueError(
                f"--data-path: weights must be finite and > 0, got {bad[0]} in {items}"
            )
        return prefixes, weights
    numeric = [item for item in items if _is_number(item)]
    if numeric:
        raise ValueError(
            f"--data-path mixes weights and prefixes; expected 'weight prefix' pairs, got {items}"
        )
    return items, None


def _is_number(text):
    try:
        float(text)
    except ValueError:
        return False
    return True


def normalize(weights) -> list:
    """megatron-core's normalisation (numpy float64 division), for bit-equal weights."""
    weights = np.array(weights, dtype=np.float64)
    return (weights / np.sum(weights)).tolist()


def parse_split(split: str) -> list:
    """``'949,50,1'`` -> three fractions summing to 1 (missing parts are 0), as megatron-core."""
    parts = [float(part) for part in re.findall(r"[.0-9]+", split) if part.strip(".")]
    if not parts or len(parts) > 3 or sum(parts) <= 0 or re.search(r"[^.0-9,/\s]", split):
        raise ValueError(
            f"--split {split!r}: expected up to three non-negative numbers like 969,30,1, not all 0"
        )
    parts += [0.0] * (3 - len(parts))
    return normalize(parts)


def split_matrix(split: str) -> list:
    """Per split, its (start, end) fraction of the data, or None when empty."""
    cumulative = functools.reduce(lambda acc, part: acc + [acc[-1] + part], parse_split(split), [0])
    return [
        (low, high) if high > low else None for low, high in zip(cumulative[:-1], cumulative[1:])
    ]


def split_ranges(split: str, num_sequences: int) -> list:
    """megatron-core's sequence ranges [begin, end) per split (None when the split is empty)."""
    ranges: list[tuple[int, int] | None] = []
    for bookends in split_matrix(split):
        if bookends is None:
            ranges.append(None)
            continue
        ranges.append(
            (
                int(round(bookends[0] * float(num_sequences))),
                int(round(bookends[1] * float(num_sequences))),
            )
        )
    return ranges


def build_document_index(documents, num_epochs, rng, separate_final_epoch) -> np.ndarray:
    if not separate_final_epoch or num_epochs == 1:
        document_index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(document_index)
        return document_index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sequence_lengths, document_index, seq_length) -> np.ndarray:
    """Start (and end) positions of every full sample in the document stream.

    Vectorised equivalent of Megatron's C++ ``build_sample_idx``: sample i
    covers stream positions [i * seq_length, i * seq_length + seq_length].
    """
    lengths = np.asarray(sequence_lengths, dtype=np.int64)[document_index]
    ends = np.cumsum(lengths)
    total_tokens = int(ends[-1]) if len(ends) else 0
    num_samples = (total_tokens - 1) // seq_length
    if num_samples < 1:
        raise ValueError(f"{total_tokens} tokens cannot make one sample of {seq_length + 1} tokens")
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # side="right" skips empty documents: a position belongs to the first
    # document whose end lies beyond it.
    rows = np.searchsorted(ends, positions, side="right")
    sample_index = np.stack([rows, positions - (ends[rows] - lengths[rows])], axis=1)
    sample_index[0] = (0, 0)  # Megatron's first row, even if document 0 is empty
    return sample_index


def build_shuffle_index(num_samples, total_size, rng) -> np.ndarray:
    """Shuffles [0, num_samples) and [num_samples, total_size) separately."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def plan_epochs(tokens_per_epoch, num_samples, seq_length):
    """megatron-core's epoch count, whether the final epoch is shuffled apart, and
    the samples before it. ``num_samples`` None means exactly one epoch."""
    if tokens_per_epoch <= 1:
        raise ValueError(f"only {tokens_per_epoch} tokens in the split; cannot build samples")
    if num_samples is None:
        return 1, False, None
    tokens_needed = num_samples * seq_length + 1
    num_epochs = max(1, math.ceil(tokens_needed / tokens_per_epoch))
    if num_epochs == 1:
        return num_epochs, False, None
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    samples_before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    samples_from_final = num_samples - samples_before_final
    separate = samples_from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch)
    return num_epochs, separate, samples_before_final


class GPTDataset:
    """Samples of ``seq_length + 1`` tokens from a sequence range of an IndexedDataset.

    ``dataset[i] == {'text': np.ndarray[int64] of length seq_length + 1}``.
    Length is at least ``num_samples`` (whole epochs may give a few more);
    ``num_samples=None`` builds exactly one epoch (megatron-core's unweighted blends).
    ``cache_path``: a folder for the index cache, or None to build in memory.
    """

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        sequence_range,
        num_samples,
        seq_length: int,
        seed: int,
        split_name: str = "train",
        cache_path=None,
    ):
        if seq_length < 1 or (num_samples is not None and num_samples < 0):
            raise ValueError(
                f"need seq_length >= 1 and num_samples >= 0, got {seq_length}, {num_samples}"
            )
        self.indexed_dataset = indexed_dataset
        self.seq_length = seq_length
        self.num_samples = num_samples
        first, last = (int(bound) for bound in sequence_range)
        if not 0 <= first < last <= len(indexed_dataset):
            raise ValueError(
                f"{indexed_dataset.path_prefix}: the {split_name} split has no sequences "
                f"(range [{first}, {last}) of {len(indexed_dataset)})"
            )
        self.sequences = np.arange(first, last, dtype=np.int32)
        self.sequence_range = (first, last)
        description = {
            "class": "GPTDataset",
            "path_prefix": os.path.abspath(indexed_dataset.path_prefix),
            "idx_fingerprint": indexed_dataset.fingerprint() if cache_path is not None else None,
            "split": split_name,
            "sequence_range": [first, last],
            "num_samples": num_samples,
            "seq_length": int(seq_length),
            "seed": int(seed),
            "add_extra_token_to_sequence": 1,
        }
        cache_dir = None if cache_path is None else os.path.join(cache_path, "GPTDataset_indices")
        self.cache = IndexCache(cache_dir, description, f"GPTDataset-{split_name}")
        indices = self.cache.load_or_build(
            INDEX_KINDS, lambda: self._build_indices(num_samples, seed), self._validate
        )
        self.document_index = indices["document_index"]
        self.sample_index = indices["sample_index"]
        self.shuffle_index = indices["shuffle_index"]

    def _build_indices(self, num_samples, seed) -> dict:
        rng = np.random.RandomState(seed)
        lengths = self.indexed_dataset.sequence_lengths
        tokens_per_epoch = int(lengths[self.sequences].sum(dtype=np.int64))
        num_epochs, separate_final, samples_before_final = plan_epochs(
            tokens_per_epoch, num_samples, self.seq_length
        )
        document_index = build_document_index(self.sequences, num_epochs, rng, separate_final)
        sample_index = build_sample_index(lengths, document_index, self.seq_length)
        total = sample_index.shape[0] - 1
        shuffle_index = build_shuffle_index(
            samples_before_final if separate_final else total, total, rng
        )
        return {
            "document_index": document_index,
            "sample_index": sample_index,
            "shuffle_index": shuffle_index,
        }

    def _validate(self, indices) -> None:
        """Cheap whole-array checks that catch a corrupt or foreign cached index set."""
        document_index, sample_index, shuffle_index = (indices[name] for name in INDEX_KINDS)
        first, last = self.sequence_range
        if len(document_index) == 0 or len(document_index) % (last - first):
            raise ValueError(f"document index of length {len(document_index)} is not whole epochs")
        if document_index.min() < first or document_index.max() >= last:
            raise ValueError("document index holds sequences outside the split")
        if (
            sample_index.ndim != 2
            or sample_index.shape[1] != 2
            or len(shuffle_index) != len(sample_index) - 1
        ):
            raise ValueError(
                f"sample index {sample_index.shape} and shuffle index {shuffle_index.shape} "
                f"disagree"
            )
        if np.any(np.diff(sample_index[:, 0]) < 0) or sample_index[-1, 0] >= len(document_index):
            raise ValueError("sample index rows are not ordered positions in the document index")
        if len(shuffle_index) and (
            shuffle_index.min() < 0 or shuffle_index.max() >= len(shuffle_index)
        ):
            raise ValueError("shuffle index points outside the samples")
        if self.num_samples is not None and len(shuffle_index) < self.num_samples:
            raise ValueError(
                f"{len(shuffle_index)} samples, fewer than the {self.num_samples} requested"
            )

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, index) -> dict:
        sample = int(self.shuffle_index[index])
        first_row, first_offset = (int(v) for v in self.sample_index[sample])
        last_row, last_offset = (int(v) for v in self.sample_index[sample + 1])
        get = self.indexed_dataset.get
        if first_row == last_row:
            pieces = [
                get(self.document_index[first_row], first_offset, last_offset - first_offset + 1)
            ]
        else:
            pieces = [get(self.document_index[first_row], first_offset)]
            pieces += [get(self.document_index[row]) for row in range(first_row + 1, last_row)]
            pieces.append(get(self.document_index[last_row], 0, last_offset + 1))
        return {"text": np.concatenate(pieces).astype(np.int64)}


def build_blending_indices(weights, size):
    """megatron-core's greedy blend: each sample goes to the dataset furthest behind its share.

    Returns (dataset_index int16, dataset_sample_index int64); after n samples
    every dataset's count is within one of weight * n. Ties go to the lower index.
    """
    weights = [float(weight) for weight in weights]
    counts = [0] * len(weights)
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    indices = range(len(weights))
    for sample in range(size):
        target = float(max(sample, 1))
        chosen = max(indices, key=lambda i: (weights[i] * target - counts[i], -i))
        dataset_index[sample] = chosen
        dataset_sample_index[sample] = counts[chosen]
        counts[chosen] += 1
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """Draws ``size`` samples from several datasets in proportion to ``weights``."""

    def __init__(self, datasets, weights, size: int, cache_path=None, description=None):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("BlendedDataset needs one weight per dataset")
        self.datasets = datasets
        self.weights = normalize(weights)
        self.size = size
        description = dict(
            description or {}, **{"class": "BlendedDataset", "weights": self.weights, "size": size}
        )
        cache_dir = (
            None if cache_path is None else os.path.join(cache_path, "BlendedDataset_indices")
        )
        cache = IndexCache(cache_dir, description, "BlendedDataset")
        names = ("dataset_index", "dataset_sample_index")
        indices = cache.load_or_build(
            names,
            lambda: dict(zip(names, build_blending_indices(self.weights, size))),
            self._validate,
        )
        self.dataset_index = indices["dataset_index"]
        self.dataset_sample_index = indices["dataset_sample_index"]
        for dataset_id, dataset in enumerate(datasets):
            needed = int(np.count_nonzero(np.asarray(self.dataset_index) == dataset_id))
            if needed > len(dataset):
                raise ValueError(
                    f"blend needs {needed} samples from dataset {dataset_id}, which has "
                    f"{len(dataset)}"
                )

    def _validate(self, indices) -> None:
        dataset_index, sample_index = indices["dataset_index"], indices["dataset_sample_index"]
        if len(dataset_index) != self.size or len(sample_index) != self.size:
            raise ValueError(
                f"blending indices of length {len(dataset_index)}, expected {self.size}"
            )
        if self.size and (dataset_index.min() < 0 or dataset_index.max() >= len(self.datasets)):
            raise ValueError("dataset index names datasets outside the blend")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index) -> dict:
        dataset_id = int(self.dataset_index[index])
        return self.datasets[dataset_id][int(self.dataset_sample_index[index])]


def default_cache_path(prefix: str) -> str:
    """Where indices are cached without ``--data-cache-path``: beside the data."""
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), DEFAULT_CACHE_FOLDER)


def check_vocabulary(indexed_datasets, vocab_size: int) -> None:
    """Refuses data holding token ids the model's vocabulary cannot embed (read in full each
    time: a .bin rewritten in place keeps its size and index)."""
    for indexed in indexed_datasets:
        problem = vocabulary_problem(indexed, vocab_size)
        if problem:
            raise DataError(problem)


def vocabulary_problem(indexed: IndexedDataset, vocab_size: int):
    """The message when the tokens of ``indexed`` do not fit ids [0, vocab_size), else None."""
    lowest, largest = indexed.token_range()
    if largest >= vocab_size:
        return (
            f"--data-path {indexed.path_prefix}: token id {largest} does not fit the vocabulary "
            f"of {vocab_size} (--tokenizer-type / --vocab-size); the data was tokenized with "
            f"another "
            f"tokenizer"
        )
    if lowest < 0:
        return f"--data-path {indexed.path_prefix}: negative token id {lowest} (corrupt .bin)"
    return None


def build_train_valid_test_datasets(
    data_path,
    split: str,
    seq_length: int,
    train_valid_test_num_samples,
    seed: int,
    cache_path="default",
    vocab_size=None,
):
    """(train, valid, test) datasets from ``--data-path`` and ``--split``, as megatron-core's
    BlendedMegatronDatasetBuilder builds them:

    * one prefix without weight: a GPTDataset per split of the requested size;
    * weights (even for one prefix): component i gets ceil(ceil(n * w_i) * 1.005)
      samples, the blend sum_i ceil(n * w_i) samples;
    * several prefixes without weights: one epoch of each component, blended by
      their sample counts, the blend min(n, total) samples.

    A split is None when it is empty or zero samples were requested.
    ``cache_path``: a folder, None (build in memory), or "default" (beside the first prefix).
    ``vocab_size``: when given, data with a token id >= vocab_size is refused (DataError).
    """
    prefixes, weights = parse_data_path(data_path)
    if cache_path == "default":
        cache_path = default_cache_path(prefixes[0])
    indexed = [IndexedDataset(prefix) for prefix in prefixes]
    if vocab_size is not None:
        check_vocabulary(indexed, vocab_size)
    ranges = [split_ranges(split, len(dataset)) for dataset in indexed]
    results: list[Any] = []  # per split: a GPTDataset, a blend of them, or None
    for split_id, split_name in enumerate(SPLIT_NAMES):
        num_samples = int(train_valid_test_num_samples[split_id])
        if num_samples <= 0 or ranges[0][split_id] is None:
            results.append(None)
            continue
        split_ranges_here = [dataset_ranges[split_id] for dataset_ranges in ranges]
        if len(indexed) == 1 and weights is None:
            results.append(
                GPTDataset(
                    indexed[0],
                    split_ranges_here[0],
                    num_samples,
                    seq_length,
                    seed,
                    split_name,
                    cache_path,
                )
            )
        elif weights is not None:
            results.append(
                _build_weighted_blend(
                    indexed,
                    split_ranges_here,
                    normalize(weights),
                    num_samples,
                    seq_length,
                    seed,
                    split_name,
                    cache_path,
                )
            )
        else:
            results.append(
                _build_unweighted_blend(
                    indexed,
                    split_ranges_here,
                    num_samples,
                    seq_length,
                    seed,
                    split_name,
                    cache_path,
                )
            )
    return tuple(results)


def _build_weighted_blend(
    indexed, ranges, weights, num_samples, seq_length, seed, split_name, cache_path
):
    targets = [int(math.ceil(num_samples * weight)) for weight in weights]
    components = [
        GPTDataset(
            dataset,
            sequence_range,
            int(math.ceil(target * (1 + MID_LEVEL_DATASET_SURPLUS))),
            seq_length,
            seed,
            split_name,
            cache_path,
        )
        for dataset, sequence_range, target in zip(indexed, ranges, targets)
    ]
    return BlendedDataset(
        components, weights, sum(targets), cache_path, _blend_description(components, split_name)
    )


def _build_unweighted_blend(indexed, ranges, num_samples, seq_length, seed, split_name, cache_path):
    components = [
        GPTDataset(dataset, sequence_range, None, seq_length, seed, split_name, cache_path)
        for dataset, sequence_range in zip(indexed, ranges)
    ]
    sizes = [len(component) for component in components]
    return BlendedDataset(
        components,
        sizes,
        min(num_samples, sum(sizes)),
        cache_path,
        _blend_description(components, split_name),
    )


def _blend_description(components, split_name):
    return {
        "split": split_name,
        "components": [component.cache.key_text for component in components],
    }
