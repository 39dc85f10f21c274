"""Corpus inputs for tools/preprocess_data.py: which files, and their records in order.

``--input`` is a file, a directory (its recognised files, sorted by name) or a
glob (matches sorted by name). Formats, by file name:

* JSON lines: ``.jsonl``/``.json`` or anything unrecognised (as Megatron-LM
  reads any file), optionally compressed: ``.gz`` (gzip), ``.zst`` (needs the
  ``zstandard`` package);
* Parquet: ``.parquet`` (needs ``pyarrow``); each row is one record.

Records are numbered across all shards from 0 in input order (Megatron-LM's
``--partitions`` deals lines out by this number). JSON records are the raw line
bytes (parsed by the workers); Parquet records are already dicts.
"""

import glob
import gzip
import io
import os

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")
PARQUET_SUFFIXES = (".parquet",)
RECOGNISED_SUFFIXES = JSONL_SUFFIXES + PARQUET_SUFFIXES
LINES_PER_CHUNK = 1024
CHUNK_BYTES = 1 << 20


class CorpusError(ValueError):
    """An input that cannot be read; the message names the file and the flag."""


def expand_inputs(pattern: str) -> list:
    """The shard files ``--input`` names, in processing order."""
    if os.path.isdir(pattern):
        names = sorted(os.listdir(pattern))
        files = [
            os.path.join(pattern, name)
            for name in names
            if name.endswith(RECOGNISED_SUFFIXES) and os.path.isfile(os.path.join(pattern, name))
        ]
        if not files:
            raise CorpusError(
                f"--input {pattern}: directory holds no {', '.join(RECOGNISED_SUFFIXES)} files"
            )
        return files
    if glob.has_magic(pattern):
        files = sorted(path for path in glob.glob(pattern, recursive=True) if os.path.isfile(path))
        if not files:
            raise CorpusError(f"--input {pattern}: the pattern matches no file")
        return files
    if not os.path.isfile(pattern):
        raise CorpusError(f"--input {pattern}: no such file (or not a regular file)")
    return [pattern]


def is_parquet(path: str) -> bool:
    return path.endswith(PARQUET_SUFFIXES)


def _open_binary(path: str):
    """Opens a JSON-lines shard; returns (the file, a reader of decompressed bytes)."""
    raw = open(path, "rb")
    try:
        return raw, _decompressing_reader(path, raw)
    except BaseException:
        raw.close()
        raise


def _decompressing_reader(path, raw):
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if path.endswith(".zst"):
        try:
            import zstandard
        except ImportError as error:
            raise CorpusError(
                f"--input {path}: .zst input needs the zstandard package (pip install zstandard)"
            ) from error
        # BufferedReader adds the line iteration the zstandard reader lacks.
        return io.BufferedReader(
            zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        )
    return raw


def _parquet_file(path: str):
    try:
        import pyarrow.parquet
    except ImportError as error:
        raise CorpusError(
            f"--input {path}: Parquet input needs the pyarrow package (pip install pyarrow)"
        ) from error
    try:
        return pyarrow.parquet.ParquetFile(path)
    except Exception as error:
        raise CorpusError(f"--input {path}: not a readable Parquet file ({error})") from error


def check_shard(path: str, keys) -> bool:
    """Fails before any output exists if the shard cannot be read; returns whether it has a
    record."""
    if is_parquet(path):
        parquet = _parquet_file(path)
        missing = [key for key in keys if key not in parquet.schema_arrow.names]
        if missing:
            raise CorpusError(
                f"--input {path}: no column {missing[0]!r} (--json-keys); "
                f"columns are {parquet.schema_arrow.names}"
            )
        return parquet.metadata.num_rows > 0
    try:
        raw, handle = _open_binary(path)
        with raw:
            for line in handle:
                if line.strip():
                    return True
    except (OSError, EOFError) as error:
        raise CorpusError(f"--input {path}: cannot be read ({error})") from error
    except Exception as error:
        raise CorpusError(
            f"--input {path}: cannot be read ({type(error).__name__}: {error})"
        ) from error
    return False


class Chunk:
    """Consecutive records of one shard: ``records[i]`` is record ``first + i`` overall
    and line/row ``first_in_shard + i + 1`` of ``path``."""

    __slots__ = ("path", "first", "first_in_shard", "records", "num_bytes", "position")

    def __init__(self, path, first, first_in_shard, records, num_bytes, position):
        self.path, self.first, self.first_in_shard = path, first, first_in_shard
        self.records, self.num_bytes, self.position = records, num_bytes, position


def read_chunks(paths, keys, max_lines=None, max_bytes=None):
    """Yields Chunks of every shard in order. ``position`` is the count of input-file
    bytes read so far (compressed size for compressed shards), for progress and ETA."""
    max_lines = max_lines or LINES_PER_CHUNK
    max_bytes = max_bytes or CHUNK_BYTES
    first, done_bytes = 0, 0
    for path in paths:
        size = os.path.getsize(path)
        if is_parquet(path):
            chunks = _parquet_chunks(path, keys, max_lines)
        else:
            chunks = _jsonl_chunks(path, max_lines, max_bytes)
        for first_in_shard, records, num_bytes, fraction in chunks:
            yield Chunk(
                path, first, first_in_shard, records, num_bytes, done_bytes + int(fraction * size)
            )
            first += len(records)
        done_bytes += size


def _jsonl_chunks(path, max_lines, max_bytes):
    size = max(os.path.getsize(path), 1)
    raw, handle = _open_binary(path)
    with raw:
        first_in_shard = 0
        lines, num_bytes = [], 0
        for line in _lines_of(path, handle):
            lines.append(line)
            num_bytes += len(line)
            if len(lines) >= max_lines or num_bytes >= max_bytes:
                # The file offset counts compressed bytes (read ahead a little).
                yield first_in_shard, lines, num_bytes, min(raw.tell() / size, 1.0)
                first_in_shard += len(lines)
                lines, num_bytes = [], 0
        if lines:
            yield first_in_shard, lines, num_bytes, 1.0


def _lines_of(path, handle):
    """The shard's lines; a truncated or corrupt compressed stream (EOFError, zlib.error,
    zstandard.ZstdError, ...) or a read error is a CorpusError naming the file."""
    try:
        yield from handle
    except Exception as error:
        raise CorpusError(
            f"--input {path}: cannot be read ({type(error).__name__}: {error}); the file is "
            f"truncated or corrupt"
        ) from error


def _parquet_chunks(path, keys, max_rows):
    parquet = _parquet_file(path)
    total = max(parquet.metadata.num_rows, 1)
    first_in_shard = 0
    for batch in parquet.iter_batches(batch_size=max_rows, columns=list(dict.fromkeys(keys))):
        rows = batch.to_pylist()
        num_bytes = batch.nbytes
        yield first_in_shard, rows, num_bytes, min((first_in_shard + len(rows)) / total, 1.0)
        first_in_shard += len(rows)
