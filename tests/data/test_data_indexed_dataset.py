"""MMIDIDX format: round trip, exact header bytes, and detection of damaged files."""

import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from megatron_ul.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    token_dtype_for_vocab,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def random_documents(seed=0, count=20, vocab=1000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=rng.integers(0, 50)) for _ in range(count)]


def write_dataset(prefix, documents, dtype=np.uint16):
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    for document in documents:
        builder.add_item(document)
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_round_trip(tmp_path, dtype):
    documents = random_documents(vocab=200)
    dataset = IndexedDataset(write_dataset(tmp_path / "d", documents, dtype))
    assert len(dataset) == len(documents) == dataset.num_documents
    assert dataset.dtype == np.dtype(dtype)
    for index, document in enumerate(documents):
        np.testing.assert_array_equal(dataset[index], document)
    np.testing.assert_array_equal(dataset.sequence_lengths, [len(d) for d in documents])
    np.testing.assert_array_equal(dataset.document_indices, np.arange(len(documents) + 1))
    longest = int(np.argmax(dataset.sequence_lengths))
    np.testing.assert_array_equal(dataset.get(longest, offset=3, length=5), documents[longest][3:8])


def test_multi_sequence_documents_and_fast_path_agree(tmp_path):
    tokens = np.arange(10)
    slow = IndexedDatasetBuilder(str(tmp_path / "slow.bin"), dtype=np.int32)
    slow.add_document(tokens[:6], [2, 4])  # one document of two sequences
    slow.add_item(tokens[6:])
    slow.end_document()
    slow.finalize(str(tmp_path / "slow.idx"))
    dataset = IndexedDataset(str(tmp_path / "slow"))
    assert len(dataset) == 3 and dataset.num_documents == 2
    np.testing.assert_array_equal(dataset.document_indices, [0, 2, 3])
    np.testing.assert_array_equal(dataset[1], [2, 3, 4, 5])
    fast = IndexedDatasetBuilder(str(tmp_path / "fast.bin"), dtype=np.int32)
    fast.add_documents(tokens, [2, 4, 4])
    fast.finalize(str(tmp_path / "fast.idx"))
    assert (tmp_path / "fast.bin").read_bytes() == (tmp_path / "slow.bin").read_bytes()
    np.testing.assert_array_equal(
        IndexedDataset(str(tmp_path / "fast")).document_indices, [0, 1, 2, 3]
    )


def test_header_bytes_match_documented_layout(tmp_path):
    prefix = write_dataset(
        tmp_path / "h", [np.array([5, 6, 7]), np.array([], dtype=int), np.array([8, 9])]
    )
    raw = (tmp_path / "h.idx").read_bytes()
    expected = (
        b"MMIDIDX\x00\x00"
        + (1).to_bytes(8, "little")  # version
        + bytes([8])  # dtype code 8 = uint16
        + (3).to_bytes(8, "little")  # sequences
        + (4).to_bytes(8, "little")  # document_indices entries (documents + 1)
        + b"".join(n.to_bytes(4, "little") for n in (3, 0, 2))
        + b"".join(n.to_bytes(8, "little") for n in (0, 6, 6))  # byte pointers
        + b"".join(n.to_bytes(8, "little") for n in (0, 1, 2, 3))
    )
    assert raw == expected
    assert (tmp_path / "h.bin").read_bytes() == b"".join(
        n.to_bytes(2, "little") for n in (5, 6, 7, 8, 9)
    )
    assert IndexedDataset(prefix).num_documents == 3


def test_token_dtype_rule():
    assert token_dtype_for_vocab(50257) == np.uint16
    assert token_dtype_for_vocab(65499) == np.uint16
    assert token_dtype_for_vocab(65500) == np.int32
    assert token_dtype_for_vocab(128256) == np.int32


def corrupt(path, transform):
    data = bytearray(open(path, "rb").read())
    open(path, "wb").write(bytes(transform(data)))


@pytest.mark.parametrize(
    "name, damage, file_suffix",
    [
        ("truncated idx", lambda d: d[:-5], ".idx"),
        ("idx cut inside header", lambda d: d[:20], ".idx"),
        ("bad magic", lambda d: b"XXIDIDX\x00\x00" + d[9:], ".idx"),
        ("bad dtype code", lambda d: d[:17] + bytes([42]) + d[18:], ".idx"),
        ("bad version", lambda d: d[:9] + struct.pack("<Q", 7) + d[17:], ".idx"),
        ("corrupt length", lambda d: d[:34] + struct.pack("<i", 999) + d[38:], ".idx"),
        ("truncated bin", lambda d: d[:-2], ".bin"),
        ("bin too long", lambda d: d + b"\x00\x00", ".bin"),
    ],
)
def test_damaged_files_raise_naming_the_file(tmp_path, name, damage, file_suffix):
    prefix = write_dataset(tmp_path / "c", random_documents(count=5))
    corrupt(prefix + file_suffix, damage)
    with pytest.raises(IndexedDatasetError, match=os.path.basename(prefix) + r"\.(idx|bin)"):
        IndexedDataset(prefix)


def test_bin_from_another_dataset_is_detected(tmp_path):
    first = write_dataset(tmp_path / "a", random_documents(seed=1))
    second = write_dataset(tmp_path / "b", random_documents(seed=2))
    os.replace(second + ".bin", first + ".bin")
    with pytest.raises(IndexedDatasetError, match=r"a\.bin"):
        IndexedDataset(first)


def test_missing_files(tmp_path):
    with pytest.raises(IndexedDatasetError, match=r"nothing\.idx"):
        IndexedDataset(str(tmp_path / "nothing"))
    prefix = write_dataset(tmp_path / "m", random_documents())
    os.remove(prefix + ".bin")
    with pytest.raises(IndexedDatasetError, match=r"m\.bin"):
        IndexedDataset(prefix)


def test_merge_datasets_tool(tmp_path):
    first_docs, second_docs = random_documents(seed=3), random_documents(seed=4, count=7)
    first = write_dataset(tmp_path / "x", first_docs)
    second = write_dataset(tmp_path / "y", second_docs)
    output = str(tmp_path / "out" / "xy")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.merge_datasets",
            "--input",
            first,
            second,
            "--output-prefix",
            output,
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr
    merged = IndexedDataset(output)
    assert len(merged) == len(first_docs) + len(second_docs)
    np.testing.assert_array_equal(merged.document_indices, np.arange(len(merged) + 1))
    for index, document in enumerate(first_docs + second_docs):
        np.testing.assert_array_equal(merged[index], document)
    assert sorted(os.listdir(tmp_path / "out")) == ["xy.bin", "xy.idx"]


def test_pickling_reopens_by_path(tmp_path):
    import pickle

    documents = random_documents(seed=5)
    dataset = IndexedDataset(write_dataset(tmp_path / "p", documents))
    payload = pickle.dumps(dataset)
    assert len(payload) < 500  # the path travels, not the tokens
    copy = pickle.loads(payload)
    np.testing.assert_array_equal(copy[7], documents[7])
