"""Megatron's MMIDIDX ``.bin``/``.idx`` token files: writer and memory-mapped reader.

``.idx`` layout (little endian), identical to Megatron-LM's:

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    uint64    version (1)
    uint8     dtype code (see DTYPE_CODES)
    uint64    S = number of sequences
    uint64    D = number of entries in document_indices (documents + 1)
    int32[S]  sequence_lengths (tokens)
    int64[S]  sequence_pointers (byte offset of each sequence in .bin)
    int64[D]  document_indices (0, then the sequence count at each document end)

``.bin`` is the token sequences back to back in that dtype, nothing else.
"""

import hashlib
import os
import struct

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_SIZE = len(INDEX_MAGIC) + 8 + 1 + 8 + 8

DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(dtype): code for code, dtype in DTYPE_CODES.items()}


class IndexedDatasetError(ValueError):
    """A .bin/.idx pair is missing, truncated, corrupt or inconsistent."""


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def token_dtype_for_vocab(vocab_size) -> np.dtype:
    """Megatron's rule: uint16 when every id fits comfortably, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def write_index(idx_path: str, dtype, sequence_lengths, document_indices) -> None:
    """Writes an .idx file; sequence pointers are derived from the lengths."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    documents = np.asarray(document_indices, dtype=np.int64)
    with open(idx_path, "wb") as handle:
        handle.write(INDEX_MAGIC)
        handle.write(struct.pack("<Q", INDEX_VERSION))
        handle.write(struct.pack("<B", CODE_OF_DTYPE[dtype]))
        handle.write(struct.pack("<Q", len(lengths)))
        handle.write(struct.pack("<Q", len(documents)))
        handle.write(lengths.astype("<i4").tobytes(order="C"))
        handle.write(pointers.astype("<i8").tobytes(order="C"))
        handle.write(documents.astype("<i8").tobytes(order="C"))


class IndexedDatasetBuilder:
    """Appends token sequences to a .bin file; ``finalize`` writes the .idx.

    Same method names as Megatron's builder. Callers that want atomic output
    pass temporary paths and rename them afterwards (see tools/preprocess_data.py).
    """

    def __init__(self, bin_path: str, dtype=np.int32):
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no MMIDIDX code")
        self.bin_path = bin_path
        self.data_file = open(bin_path, "wb")
        self.length_chunks: list[np.ndarray] = []
        self.document_ends = [0]
        self.num_sequences = 0

    def add_item(self, tokens) -> None:
        """Appends one sequence (does not end the document)."""
        array = np.asarray(tokens, dtype=self.dtype)
        self.data_file.write(array.tobytes(order="C"))
        self.length_chunks.append(np.array([array.size], dtype=np.int32))
        self.num_sequences += 1

    def end_document(self) -> None:
        self.document_ends.append(self.num_sequences)

    def add_document(self, tokens, lengths) -> None:
        """Appends one document made of sequences of the given lengths."""
        self.add_sequences(tokens, lengths)
        self.end_document()

    def add_documents(self, tokens, lengths, sequences_per_document=None) -> None:
        """Fast path: many documents, tokens concatenated in one array.

        ``sequences_per_document[i]`` sequences of ``lengths`` make document i
        (default: one each). A document of 0 sequences is an empty document:
        Megatron-LM records its end in the document indices and writes no sequence.
        """
        start = self.num_sequences
        self.add_sequences(tokens, lengths)
        if sequences_per_document is None:
            self.document_ends.extend(range(start + 1, self.num_sequences + 1))
            return
        ends = start + np.cumsum(np.asarray(sequences_per_document, dtype=np.int64))
        if len(ends) and ends[-1] != self.num_sequences:
            raise ValueError(
                f"sequences_per_document sums to {ends[-1] - start}, not {len(lengths)}"
            )
        self.document_ends.extend(ends.tolist())

    def add_sequences(self, tokens, lengths) -> None:
        array = np.asarray(tokens, dtype=self.dtype)
        lengths = np.asarray(lengths, dtype=np.int32)
        if int(lengths.sum(dtype=np.int64)) != array.size:
            raise ValueError(
                f"lengths sum to {int(lengths.sum())} but {array.size} tokens were given"
            )
        self.data_file.write(array.tobytes(order="C"))
        self.length_chunks.append(lengths)
        self.num_sequences += len(lengths)

    def add_index(self, prefix: str) -> None:
        """Appends a whole existing dataset (used to merge datasets)."""
        source = IndexedDataset(prefix)
        if source.dtype != self.dtype:
            raise IndexedDatasetError(
                f"{index_file_path(prefix)}: dtype {source.dtype} differs from the output's "
                f"{self.dtype}"
            )
        offset = self.num_sequences
        self.length_chunks.append(np.array(source.sequence_lengths, dtype=np.int32))
        self.document_ends.extend((source.document_indices[1:] + offset).tolist())
        self.num_sequences += len(source)
        with open(data_file_path(prefix), "rb") as handle:
            while True:
                block = handle.read(1 << 24)
                if not block:
                    break
                self.data_file.write(block)
        source.close()

    def finalize(self, idx_path: str) -> None:
        self.data_file.close()
        lengths = (
            np.concatenate(self.length_chunks) if self.length_chunks else np.zeros(0, np.int32)
        )
        write_index(idx_path, self.dtype, lengths, self.document_ends)

    def abort(self) -> None:
        """Closes the .bin without writing an index (the caller deletes files)."""
        if not self.data_file.closed:
            self.data_file.close()


def _read_index(idx_path: str):
    """Parses and validates an .idx; every failure names the file."""
    if not os.path.isfile(idx_path):
        raise IndexedDatasetError(f"{idx_path}: index file not found")
    with open(idx_path, "rb") as handle:
        raw = handle.read()
    if len(raw) < HEADER_SIZE:
        raise IndexedDatasetError(
            f"{idx_path}: truncated index ({len(raw)} bytes, header needs {HEADER_SIZE})"
        )
    if raw[: len(INDEX_MAGIC)] != INDEX_MAGIC:
        raise IndexedDatasetError(f"{idx_path}: not an MMIDIDX index (bad magic {raw[:9]!r})")
    version, dtype_code, num_sequences, num_doc_entries = struct.unpack_from(
        "<QBQQ", raw, len(INDEX_MAGIC)
    )
    if version != INDEX_VERSION:
        raise IndexedDatasetError(f"{idx_path}: unsupported index version {version}")
    if dtype_code not in DTYPE_CODES:
        raise IndexedDatasetError(f"{idx_path}: unknown dtype code {dtype_code}")
    if np.dtype(DTYPE_CODES[dtype_code]).kind == "f":
        raise IndexedDatasetError(
            f"{idx_path}: dtype {np.dtype(DTYPE_CODES[dtype_code])} cannot "
            "hold token ids (corrupt index, or not token data)"
        )
    expected = HEADER_SIZE + 12 * num_sequences + 8 * num_doc_entries
    if len(raw) != expected:
        raise IndexedDatasetError(
            f"{idx_path}: size {len(raw)} bytes does not match its header ({expected} bytes "
            f"expected); "
            "truncated or corrupt"
        )
    offset = HEADER_SIZE
    lengths = np.frombuffer(raw, dtype="<i4", count=num_sequences, offset=offset)
    offset += 4 * num_sequences
    pointers = np.frombuffer(raw, dtype="<i8", count=num_sequences, offset=offset)
    offset += 8 * num_sequences
    document_indices = np.frombuffer(raw, dtype="<i8", count=num_doc_entries, offset=offset)
    dtype = np.dtype(DTYPE_CODES[dtype_code])
    _check_index_arrays(idx_path, dtype, lengths, pointers, document_indices)
    return dtype, lengths, pointers, document_indices


def _check_index_arrays(idx_path, dtype, lengths, pointers, document_indices) -> None:
    """Catches corruption that a well-formed header would hide."""
    if len(lengths) and lengths.min() < 0:
        raise IndexedDatasetError(f"{idx_path}: negative sequence length (corrupt index)")
    expected_pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=expected_pointers[1:])
    if not np.array_equal(pointers, expected_pointers):
        raise IndexedDatasetError(
            f"{idx_path}: sequence pointers disagree with sequence lengths (corrupt index)"
        )
    if (
        len(document_indices) == 0
        or document_indices[0] != 0
        or document_indices[-1] != len(lengths)
    ):
        raise IndexedDatasetError(
            f"{idx_path}: document indices must run from 0 to the sequence count {len(lengths)} "
            f"(corrupt index)"
        )
    if np.any(np.diff(document_indices) < 0):
        raise IndexedDatasetError(f"{idx_path}: document indices decrease (corrupt index)")


class IndexedDataset:
    """Read-only, memory-mapped view of ``{prefix}.bin`` + ``{prefix}.idx``.

    ``dataset[i]`` is sequence i as a numpy array (a view into the mmap).
    """

    def __init__(self, path_prefix: str):
        self.path_prefix = path_prefix
        idx_path, bin_path = index_file_path(path_prefix), data_file_path(path_prefix)
        self.dtype, self.sequence_lengths, self.sequence_pointers, self.document_indices = (
            _read_index(idx_path)
        )
        if not os.path.isfile(bin_path):
            raise IndexedDatasetError(f"{bin_path}: data file not found")
        expected_bytes = int(self.sequence_lengths.sum(dtype=np.int64)) * self.dtype.itemsize
        actual_bytes = os.path.getsize(bin_path)
        if actual_bytes != expected_bytes:
            raise IndexedDatasetError(
                f"{bin_path}: {actual_bytes} bytes but {idx_path} describes {expected_bytes}; "
                "the pair does not match (truncated or mixed-up files)"
            )
        # np.memmap refuses empty files, and an empty dataset needs no mapping.
        self.tokens: np.ndarray  # a memory map (np.memmap is an ndarray)
        if expected_bytes:
            self.tokens = np.memmap(bin_path, dtype=self.dtype, mode="r")
        else:
            self.tokens = np.zeros(0, dtype=self.dtype)

    def __getstate__(self):
        # Reopen by path in other processes instead of pickling the mapped tokens.
        return self.path_prefix

    def __setstate__(self, path_prefix):
        IndexedDataset.__init__(self, path_prefix)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def fingerprint(self) -> str:
        """SHA-256 of the .idx contents (plus the .bin size): what cached indices depend on.
        Computed once per opened dataset (the files are read-only while it is open)."""
        if getattr(self, "_fingerprint", None) is None:
            self._fingerprint = self._compute_fingerprint()
        return self._fingerprint

    def _compute_fingerprint(self) -> str:
        digest = hashlib.sha256()
        with open(index_file_path(self.path_prefix), "rb") as handle:
            for block in iter(lambda: handle.read(1 << 24), b""):
                digest.update(block)
        digest.update(str(os.path.getsize(data_file_path(self.path_prefix))).encode())
        return digest.hexdigest()

    def token_range(self, chunk: int = 1 << 26) -> tuple[int, int]:
        """(smallest, largest) token id in the .bin, (0, -1) when empty: a vectorised pass over
        the memory map, chunked so that no full-size temporary is ever made."""
        signed = self.dtype.kind == "i"  # unsigned ids cannot be negative: one pass, not two
        lows, highs = [], []
        for start in range(0, len(self.tokens), chunk):
            block = self.tokens[start : start + chunk]
            highs.append(int(block.max()))
            lows.append(int(block.min()) if signed else 0)
        return (min(lows), max(highs)) if highs else (0, -1)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self.get(index)

    def get(self, index: int, offset: int = 0, length=None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence ``index``."""
        index = int(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(
                f"sequence {index} out of range for {len(self)} sequences in {self.path_prefix}"
            )
        sequence_length = int(self.sequence_lengths[index])
        if length is None:
            length = sequence_length - offset
        if offset < 0 or length < 0 or offset + length > sequence_length:
            raise IndexError(
                f"slice [{offset}, {offset + length}) outside sequence {index} "
                f"of length {sequence_length}"
            )
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize + offset
        return self.tokens[start : start + length]

    def close(self) -> None:
        # Dropping the reference unmaps once no returned view is alive;
        # closing the mmap explicitly would break views callers still hold.
        self.tokens = np.zeros(0, dtype=self.dtype)
