"""The --data-path files checked before anything heavy starts: every problem as one line.

Each prefix's .idx is parsed and checked against itself and its .bin's size (indexed_dataset),
the data must not be empty, the training split must hold tokens, and every token id must fit
the vocabulary. The ids are read in full on every start (a vectorised pass over the memory map;
docs/data.md gives its cost): a key made of sizes, times or the index alone would miss a .bin
rewritten in place.
"""

from __future__ import annotations

from .gpt_dataset import SPLIT_NAMES, parse_data_path, split_ranges, vocabulary_problem
from .indexed_dataset import IndexedDataset, IndexedDatasetError


def data_problems(
    data_path: list[str], split: str, vocab_size: int, needed_splits: tuple[str, ...] = ("train",)
) -> list[str]:
    """One line per problem of the --data-path datasets (their files are known to exist)."""
    prefixes, _ = parse_data_path(data_path)
    found = []
    for prefix in prefixes:
        try:
            indexed = IndexedDataset(prefix)
            problem = _dataset_problem(indexed, split, vocab_size, needed_splits)
        except IndexedDatasetError as e:
            problem = f"--data-path {prefix}: {e}"
        if problem:
            found.append(problem)
    return found


def _dataset_problem(
    indexed: IndexedDataset, split: str, vocab_size: int, needed_splits: tuple[str, ...]
):
    prefix = indexed.path_prefix
    if len(indexed) == 0 or len(indexed.tokens) == 0:
        return (
            f"--data-path {prefix}: the dataset is empty (no tokens); preprocess a corpus "
            f"with documents in it"
        )
    for name, bounds in zip(SPLIT_NAMES, split_ranges(split, len(indexed))):
        # a split of weight 0 is simply absent, except the training split
        if name not in needed_splits or (bounds is None and name != "train"):
            continue
        if bounds is None or _tokens(indexed, bounds) < 2:
            return (
                f"--split {split}: the {name} split of --data-path {prefix} holds fewer than "
                f"2 tokens ({len(indexed)} sequences in all); give it a larger share or "
                f"use more data"
            )
    return vocabulary_problem(indexed, vocab_size)


def _tokens(indexed: IndexedDataset, bounds: tuple[int, int]) -> int:
    first, last = bounds
    return int(indexed.sequence_lengths[first:last].sum(dtype="int64"))
