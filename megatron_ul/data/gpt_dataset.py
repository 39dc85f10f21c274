"""GPT pretraining datasets over MMIDIDX files, with Megatron's indices and blending.

A ``GPTDataset`` sample is ``seq_length + 1`` consecutive tokens of a shuffled
stream of documents (samples cross document boundaries; consecutive samples
share one token so every token is predicted once). Three indices define it,
as in Megatron-LM:

* document index: the split's document ids, repeated for as many epochs as the
  requested samples need, shuffled (a short final epoch is shuffled apart);
* sample index: row i = (position in the document index, token offset) where
  sample i starts; row i + 1 is where it ends (inclusive);
* shuffle index: a permutation of the samples.

They are cached as .npy files named by a hash of everything they depend on, so
restarts reuse them and every rank reads the same ones.
"""

import hashlib
import json
import math
import os
import time

import numpy as np

from megatron_ul.data.indexed_dataset import IndexedDataset

INDEX_KINDS = ("document_index", "sample_index", "shuffle_index")
# Megatron shuffles a final epoch separately when it would contribute less
# than this fraction of an epoch, so that its samples are not all clumped late.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
# Each blended component gets this much headroom over its expected share.
BLEND_OVERSAMPLING = 1.005
CACHE_WAIT_TIMEOUT_S = 1800.0


def parse_data_path(data_path):
    """Splits ``--data-path`` values into (prefixes, weights or None).

    Accepts ``[prefix, ...]`` or ``[weight, prefix, weight, prefix, ...]``;
    a single string is split on whitespace.
    """
    if isinstance(data_path, str):
        data_path = [data_path]
    items = [token for item in data_path for token in item.split()]
    if not items:
        raise ValueError("--data-path is empty")
    if len(items) % 2 == 0 and all(_is_number(items[i]) for i in range(0, len(items), 2)):
        weights = [float(items[i]) for i in range(0, len(items), 2)]
        prefixes = items[1::2]
        if any(weight < 0 for weight in weights) or sum(weights) <= 0:
            raise ValueError(f"--data-path weights must be >= 0 and not all 0, got {weights}")
        return prefixes, weights
    numeric = [item for item in items if _is_number(item)]
    if numeric:
        raise ValueError(f"--data-path mixes weights and prefixes; expected 'weight prefix' pairs, got {items}")
    return items, None


def _is_number(text):
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_split(split: str) -> list:
    """``'949,50,1'`` -> three fractions summing to 1 (missing parts are 0)."""
    try:
        parts = [float(part) for part in split.replace("/", ",").split(",") if part.strip()]
    except ValueError as error:
        raise ValueError(f"--split {split!r}: expected comma-separated numbers like 949,50,1") from error
    if not parts or len(parts) > 3 or any(part < 0 for part in parts) or sum(parts) <= 0:
        raise ValueError(f"--split {split!r}: expected up to three non-negative numbers, not all 0")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [part / total for part in parts]


def split_boundaries(split: str, num_documents: int) -> list:
    """Megatron's document boundaries [0, a, b, num_documents] for train/valid/test."""
    boundaries = [0]
    for fraction in parse_split(split):
        boundaries.append(boundaries[-1] + int(round(fraction * num_documents)))
    excess = boundaries[-1] - num_documents
    return [boundaries[0]] + [boundary - excess for boundary in boundaries[1:]]


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
    """Megatron's epoch count and whether the final epoch is shuffled apart."""
    if tokens_per_epoch <= 1:
        raise ValueError(f"only {tokens_per_epoch} tokens in the split; cannot build samples")
    tokens_needed = num_samples * seq_length + 1
    num_epochs = max(1, math.ceil(tokens_needed / tokens_per_epoch))
    if num_epochs == 1:
        return num_epochs, False, None
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    samples_before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    samples_from_final = num_samples - samples_before_final
    separate = samples_from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch)
    return num_epochs, separate, samples_before_final


class IndexCache:
    """Builds a set of named arrays once and shares them through .npy files.

    One process builds (rank 0 of torch.distributed when initialised, else
    the process whose RANK env var is 0 or unset), writing every file through a
    temporary name and the description file last; the others wait for it
    (barrier, or polling with a timeout) and memory-map the result.
    """

    def __init__(self, cache_dir, description: dict, label: str):
        self.cache_dir = cache_dir
        self.description_text = json.dumps(description, sort_keys=True, indent=2)
        digest = hashlib.sha256(self.description_text.encode("utf-8")).hexdigest()[:20]
        self.stem = f"{digest}-{label}"

    def path(self, name):
        return os.path.join(self.cache_dir, f"{self.stem}-{name}.npy")

    @property
    def marker_path(self):
        return os.path.join(self.cache_dir, f"{self.stem}-description.json")

    def load_or_build(self, names, build_fn) -> dict:
        if self.cache_dir is None:
            return build_fn()
        distributed_rank = _distributed_rank()
        if distributed_rank is not None:
            # Every rank reaches the barrier, whether or not it sees the files,
            # so ranks can never disagree on the number of collective calls.
            if distributed_rank == 0 and not os.path.isfile(self.marker_path):
                self._write(build_fn())
            import torch.distributed

            torch.distributed.barrier()
        elif not os.path.isfile(self.marker_path):
            if int(os.environ.get("RANK", "0")) == 0:
                self._write(build_fn())
            else:
                self._wait_for_marker()
        return {name: np.load(self.path(name), mmap_mode="r", allow_pickle=False) for name in names}

    def _write(self, arrays: dict) -> None:
        os.makedirs(self.cache_dir, exist_ok=True)
        for name, array in arrays.items():
            temporary = self.path(name) + f".tmp-{os.getpid()}.npy"
            np.save(temporary, array, allow_pickle=False)
            os.replace(temporary, self.path(name))
        temporary = self.marker_path + f".tmp-{os.getpid()}"
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.write(self.description_text)
        os.replace(temporary, self.marker_path)

    def _wait_for_marker(self) -> None:
        deadline = time.time() + CACHE_WAIT_TIMEOUT_S
        while not os.path.isfile(self.marker_path):
            if time.time() > deadline:
                raise TimeoutError(f"{self.marker_path}: not written by rank 0 within {CACHE_WAIT_TIMEOUT_S:.0f} s")
            time.sleep(0.5)


def _distributed_rank():
    """This process's torch.distributed rank, or None when not initialised."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return None


class GPTDataset:
    """Samples of ``seq_length + 1`` tokens from a document range of an IndexedDataset.

    ``dataset[i] == {'text': np.ndarray[int64] of length seq_length + 1}``.
    Length is at least ``num_samples`` (whole epochs may give a few more).
    """

    def __init__(self, indexed_dataset: IndexedDataset, document_range, num_samples: int, seq_length: int,
                 seed: int, split_name: str = "train", cache_path=None):
        if seq_length < 1 or num_samples < 1:
            raise ValueError(f"need seq_length >= 1 and num_samples >= 1, got {seq_length}, {num_samples}")
        self.indexed_dataset = indexed_dataset
        self.seq_length = seq_length
        first_doc, last_doc = document_range
        # Documents map to sequence ranges; for GPT data each is one sequence.
        first_seq = int(indexed_dataset.document_indices[first_doc])
        last_seq = int(indexed_dataset.document_indices[last_doc])
        self.sequences = np.arange(first_seq, last_seq, dtype=np.int32)
        description = {
            "class": "GPTDataset", "path_prefix": indexed_dataset.path_prefix, "split": split_name,
            "document_range": [int(first_doc), int(last_doc)], "num_samples": int(num_samples),
            "seq_length": int(seq_length), "seed": int(seed),
            "num_sequences": len(indexed_dataset), "num_tokens": int(indexed_dataset.sequence_lengths.sum()),
        }
        cache_dir = None if cache_path is None else os.path.join(cache_path, "GPTDataset_indices")
        self.cache = IndexCache(cache_dir, description, f"GPTDataset-{split_name}")
        indices = self.cache.load_or_build(INDEX_KINDS, lambda: self._build_indices(num_samples, seed))
        self.document_index = indices["document_index"]
        self.sample_index = indices["sample_index"]
        self.shuffle_index = indices["shuffle_index"]

    def _build_indices(self, num_samples, seed) -> dict:
        rng = np.random.RandomState(seed)
        lengths = self.indexed_dataset.sequence_lengths
        tokens_per_epoch = int(lengths[self.sequences].sum(dtype=np.int64))
        num_epochs, separate_final, samples_before_final = plan_epochs(tokens_per_epoch, num_samples,
                                                                       self.seq_length)
        document_index = build_document_index(self.sequences, num_epochs, rng, separate_final)
        sample_index = build_sample_index(lengths, document_index, self.seq_length)
        total = sample_index.shape[0] - 1
        shuffle_index = build_shuffle_index(samples_before_final if separate_final else total, total, rng)
        return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, index) -> dict:
        sample = int(self.shuffle_index[index])
        first_row, first_offset = (int(v) for v in self.sample_index[sample])
        last_row, last_offset = (int(v) for v in self.sample_index[sample + 1])
        get = self.indexed_dataset.get
        if first_row == last_row:
            pieces = [get(self.document_index[first_row], first_offset, last_offset - first_offset + 1)]
        else:
            pieces = [get(self.document_index[first_row], first_offset)]
            pieces += [get(self.document_index[row]) for row in range(first_row + 1, last_row)]
            pieces.append(get(self.document_index[last_row], 0, last_offset + 1))
        return {"text": np.concatenate(pieces).astype(np.int64)}


def build_blending_indices(weights, size):
    """Megatron's greedy blend: each sample goes to the dataset furthest behind its share.

    Returns (dataset_index, dataset_sample_index); after n samples every
    dataset's count is within one of weight * n.
    """
    weights = [float(weight) for weight in weights]
    counts = [0] * len(weights)
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    for sample in range(size):
        target = max(sample, 1)
        errors = [weight * target - count for weight, count in zip(weights, counts)]
        chosen = errors.index(max(errors))
        dataset_index[sample] = chosen
        dataset_sample_index[sample] = counts[chosen]
        counts[chosen] += 1
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """Draws ``size`` samples from several datasets in proportion to ``weights``."""

    def __init__(self, datasets, weights, size: int, cache_path=None, description=None):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("BlendedDataset needs one weight per dataset")
        total = float(sum(weights))
        self.datasets = datasets
        self.weights = [weight / total for weight in weights]
        self.size = size
        description = dict(description or {}, **{"class": "BlendedDataset", "weights": self.weights, "size": size})
        cache_dir = None if cache_path is None else os.path.join(cache_path, "BlendedDataset_indices")
        cache = IndexCache(cache_dir, description, "BlendedDataset")
        names = ("dataset_index", "dataset_sample_index")
        indices = cache.load_or_build(names, lambda: dict(zip(names, build_blending_indices(self.weights, size))))
        self.dataset_index = indices["dataset_index"]
        self.dataset_sample_index = indices["dataset_sample_index"]
        for dataset_id, dataset in enumerate(datasets):
            needed = int(np.count_nonzero(np.asarray(self.dataset_index) == dataset_id))
            if needed > len(dataset):
                raise ValueError(f"blend needs {needed} samples from dataset {dataset_id}, which has {len(dataset)}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index) -> dict:
        dataset_id = int(self.dataset_index[index])
        return self.datasets[dataset_id][int(self.dataset_sample_index[index])]


def build_train_valid_test_datasets(data_path, split: str, seq_length: int, train_valid_test_num_samples,
                                    seed: int, cache_path=None):
    """Builds (train, valid, test) datasets from ``--data-path`` and ``--split``.

    A split is None when it has no documents or zero samples were requested.
    Several prefixes are blended by their weights (or, without weights, by
    their token counts in that split).
    """
    prefixes, weights = parse_data_path(data_path)
    indexed = [IndexedDataset(prefix) for prefix in prefixes]
    boundaries = [split_boundaries(split, dataset.num_documents) for dataset in indexed]
    results = []
    for split_id, split_name in enumerate(("train", "valid", "test")):
        num_samples = int(train_valid_test_num_samples[split_id])
        ranges = [(bounds[split_id], bounds[split_id + 1]) for bounds in boundaries]
        if num_samples <= 0 or all(first >= last for first, last in ranges):
            results.append(None)
            continue
        if len(indexed) == 1:
            results.append(GPTDataset(indexed[0], ranges[0], num_samples, seq_length, seed, split_name, cache_path))
            continue
        split_weights = weights or [_tokens_in_range(dataset, doc_range) for dataset, doc_range in zip(indexed, ranges)]
        results.append(_build_blend(indexed, ranges, split_weights, num_samples, seq_length, seed, split_name,
                                    cache_path))
    return tuple(results)


def _tokens_in_range(dataset, document_range):
    first = int(dataset.document_indices[document_range[0]])
    last = int(dataset.document_indices[document_range[1]])
    return float(dataset.sequence_lengths[first:last].sum(dtype=np.int64))


def _build_blend(indexed, ranges, weights, num_samples, seq_length, seed, split_name, cache_path):
    total = float(sum(weights))
    components, component_weights, prefixes = [], [], []
    for dataset, doc_range, weight in zip(indexed, ranges, weights):
        if weight <= 0:
            continue
        if doc_range[0] >= doc_range[1]:
            raise ValueError(f"{dataset.path_prefix}: no documents in the {split_name} split")
        component_samples = math.ceil(num_samples * weight / total * BLEND_OVERSAMPLING)
        components.append(GPTDataset(dataset, doc_range, component_samples, seq_length, seed, split_name, cache_path))
        component_weights.append(weight)
        prefixes.append(dataset.path_prefix)
    description = {"split": split_name, "prefixes": prefixes, "seq_length": seq_length, "seed": seed,
                   "components": [len(component) for component in components]}
    return BlendedDataset(components, component_weights, num_samples, cache_path, description)
