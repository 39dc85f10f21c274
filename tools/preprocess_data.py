#!/usr/bin/env python
"""Tokenizes a JSONL corpus into Megatron's MMIDIDX ``{prefix}_{key}_document.bin/.idx``.

Same flags as Megatron-LM's tools/preprocess_data.py. Worker processes parse and
tokenize chunks of lines; the main process reads the input, writes the tokens in
input order, and renames temporary outputs into place only when everything
succeeded (the .idx last), so an interrupted run never leaves a pair that looks
complete.
"""

import argparse
import gzip
import itertools
import json
import multiprocessing
import os
import sys
import time

import numpy as np

from megatron_ul.data.indexed_dataset import (
    IndexedDatasetBuilder, data_file_path, index_file_path, token_dtype_for_vocab)
from megatron_ul.data.tokenizers import TOKENIZER_TYPES, build_tokenizer

LINES_PER_CHUNK = 1024
CHUNK_BYTES = 1 << 20


class InputError(Exception):
    """A problem with the command line or the input found before or during the run."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="JSONL file, one document per line (.gz accepted)")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each line")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer merges.txt")
    group.add_argument("--tokenizer-model", default=None, help="SentencePiece .model")
    group.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocabulary size")
    group.add_argument("--append-eod", action="store_true", help="append the EOD token to every document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    group.add_argument("--dataset-impl", default="mmap", choices=["mmap"],
                       help="accepted for older Megatron command lines; mmap (MMIDIDX) is the only format")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines")
    group.add_argument("--strict", action="store_true", help="stop at the first malformed line instead of skipping")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    if args.log_interval < 1:
        parser.error("--log-interval must be >= 1")
    return args


def open_input(path):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def check_input(path) -> None:
    """Unreadable, corrupt-gzip or empty input stops the run before any output exists."""
    if not os.path.isfile(path):
        raise InputError(f"--input {path}: no such file (or not a regular file)")
    try:
        with open_input(path) as handle:
            for line in handle:
                if line.strip():
                    return
    except (OSError, EOFError) as error:
        raise InputError(f"--input {path}: cannot be read ({error})") from error
    raise InputError(f"--input {path}: empty input (no non-blank line)")


def check_output_prefix(prefix) -> None:
    directory = os.path.dirname(os.path.abspath(prefix))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        raise InputError(f"--output-prefix {prefix}: cannot create directory {directory} ({error})") from error
    if not os.access(directory, os.W_OK | os.X_OK):
        raise InputError(f"--output-prefix {prefix}: directory {directory} is not writable")


def build_tokenizer_from_args(args):
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                                    tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size)
        if args.append_eod:
            tokenizer.eod  # noqa: B018 -- fails now, not mid-run, if there is no EOD
    except (ValueError, FileNotFoundError, OSError, RuntimeError) as error:
        raise InputError(str(error)) from error
    return tokenizer


class ChunkEncoder:
    """Runs in each worker: parses and tokenizes one chunk of numbered lines.

    The tokenizer lives on the class (set by the pool initializer in each
    worker) because the pool pickles a fresh copy of the instance per task.
    """

    tokenizer = None
    dtype = None

    def __init__(self, args):
        self.args = args

    def initializer(self):
        ChunkEncoder.tokenizer = build_tokenizer_from_args(self.args)
        ChunkEncoder.dtype = token_dtype_for_vocab(ChunkEncoder.tokenizer.vocab_size)

    def encode(self, chunk):
        """Returns (first line number, lines, bytes, errors, {key: (tokens, lengths)}, empty docs)."""
        first_line_number, lines = chunk
        errors, line_numbers, documents = [], [], []
        for line_number, line in enumerate(lines, start=first_line_number):
            document = parse_line(line, self.args.json_keys, line_number, errors)
            if document is not None:
                line_numbers.append(line_number)
                documents.append(document)
        ids_per_key = self.tokenize_documents(documents, line_numbers, errors)
        outputs, empty = {}, 0
        for key, ids in ids_per_key.items():
            outputs[key] = self.to_arrays(ids)
            empty = max(empty, int(np.count_nonzero(outputs[key][1] == 0)))
        errors.sort()
        return first_line_number, len(lines), sum(map(len, lines)), errors, outputs, empty

    def tokenize_documents(self, documents, line_numbers, errors):
        """{key: [ids per document]}; a document any key fails to tokenize is dropped for all keys."""
        ids_per_key, failed = {}, set()
        for key in self.args.json_keys:
            texts = [document[key] for document in documents]
            try:
                ids_per_key[key] = self.tokenizer.tokenize_batch(texts) if texts else []
            except Exception:  # noqa: BLE001 -- retry one by one to find and report the culprit
                ids_per_key[key] = []
                for position, text in enumerate(texts):
                    try:
                        ids_per_key[key].append(self.tokenizer.tokenize(text))
                    except Exception as error:  # noqa: BLE001
                        errors.append((line_numbers[position], f"cannot tokenize key {key!r} ({error})"))
                        ids_per_key[key].append(None)
                        failed.add(position)
        if failed:
            ids_per_key = {key: [ids for position, ids in enumerate(all_ids) if position not in failed]
                           for key, all_ids in ids_per_key.items()}
        return ids_per_key

    def to_arrays(self, ids):
        if self.args.append_eod:
            eod = self.tokenizer.eod
            for document_ids in ids:
                document_ids.append(eod)
        lengths = np.fromiter((len(document_ids) for document_ids in ids), dtype=np.int32, count=len(ids))
        tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=self.dtype, count=int(lengths.sum()))
        return tokens, lengths


def parse_line(line, keys, line_number, errors):
    """Returns the decoded JSON object, or None after recording why the line is skipped."""
    if not line.strip():
        return None
    try:
        document = json.loads(line)
    except ValueError as error:
        errors.append((line_number, f"malformed JSON ({error})"))
        return None
    if not isinstance(document, dict):
        errors.append((line_number, "not a JSON object"))
        return None
    for key in keys:
        if key not in document:
            errors.append((line_number, f"missing key {key!r}"))
            return None
        if not isinstance(document[key], str):
            errors.append((line_number, f"key {key!r} is not a string"))
            return None
    return document


def read_chunks(path, max_lines=None, max_bytes=None):
    """Yields (first line number, [line bytes]) chunks; line numbers start at 1.

    Chunks are capped in bytes as well as lines so that corpora of large
    documents still spread evenly over the workers.
    """
    max_lines = max_lines or LINES_PER_CHUNK
    max_bytes = max_bytes or CHUNK_BYTES
    with open_input(path) as handle:
        line_number = 1
        lines, size = [], 0
        for line in handle:
            lines.append(line)
            size += len(line)
            if len(lines) >= max_lines or size >= max_bytes:
                yield line_number, lines
                line_number += len(lines)
                lines, size = [], 0
        if lines:
            yield line_number, lines


class OutputSet:
    """One builder per JSON key, writing temporary files until ``commit``."""

    def __init__(self, prefix, keys, dtype):
        self.final_prefixes = {key: f"{prefix}_{key}_document" for key in keys}
        self.suffix = f".tmp-{os.getpid()}"
        self.builders = {}
        for key, final in self.final_prefixes.items():
            self.builders[key] = IndexedDatasetBuilder(data_file_path(final) + self.suffix, dtype=dtype)

    def write(self, outputs):
        for key, (tokens, lengths) in outputs.items():
            self.builders[key].add_documents(tokens, lengths)

    def commit(self):
        for key, final in self.final_prefixes.items():
            self.builders[key].finalize(index_file_path(final) + self.suffix)
        for final in self.final_prefixes.values():
            # Remove a stale .idx first so no moment pairs the new .bin with an old .idx.
            if os.path.exists(index_file_path(final)):
                os.remove(index_file_path(final))
            os.replace(data_file_path(final) + self.suffix, data_file_path(final))
            os.replace(index_file_path(final) + self.suffix, index_file_path(final))

    def discard(self):
        for key, final in self.final_prefixes.items():
            self.builders[key].abort()
            for path in (data_file_path(final) + self.suffix, index_file_path(final) + self.suffix):
                if os.path.exists(path):
                    os.remove(path)


class Progress:
    def __init__(self, log_interval):
        self.log_interval = log_interval
        self.start = time.time()
        self.documents = self.skipped = self.empty = self.tokens = self.bytes = 0
        self.next_log = log_interval

    def update(self, num_documents, num_skipped, num_empty, num_tokens, num_bytes):
        self.documents += num_documents
        self.skipped += num_skipped
        self.empty += num_empty
        self.tokens += num_tokens
        self.bytes += num_bytes
        if self.documents >= self.next_log:
            self.next_log = (self.documents // self.log_interval + 1) * self.log_interval
            print(f"processed {self.documents} documents: {self.rates()}", file=sys.stderr, flush=True)

    def rates(self):
        elapsed = max(time.time() - self.start, 1e-9)
        return (f"{self.documents / elapsed:.0f} docs/s, {self.bytes / elapsed / 1e6:.2f} MB/s, "
                f"{self.tokens / elapsed / 1e6:.3f} M tokens/s")

    def summary(self, outputs):
        elapsed = time.time() - self.start
        print(f"done in {elapsed:.2f} s: {self.documents} documents, {self.tokens} tokens "
              f"({self.empty} empty documents, {self.skipped} bad lines skipped); {self.rates()}",
              file=sys.stderr, flush=True)
        for final in outputs.final_prefixes.values():
            print(f"wrote {data_file_path(final)} and {index_file_path(final)}", file=sys.stderr, flush=True)


def run(args) -> Progress:
    """Tokenizes the input into the output files; raises InputError on bad input."""
    check_input(args.input)
    check_output_prefix(args.output_prefix)
    tokenizer = build_tokenizer_from_args(args)
    dtype = token_dtype_for_vocab(tokenizer.vocab_size)
    encoder = ChunkEncoder(args)
    progress = Progress(args.log_interval)
    outputs = OutputSet(args.output_prefix, args.json_keys, dtype)
    pool = None
    try:
        pool = start_workers(encoder, args.workers)
        encoded_chunks = pool.imap(encoder.encode, read_chunks(args.input)) if pool else \
            map(encoder.encode, read_chunks(args.input))
        for _, _, num_bytes, errors, encoded, empty in encoded_chunks:
            report_errors(errors, args.strict)
            num_documents = len(encoded[args.json_keys[0]][1])
            num_tokens = sum(len(tokens) for tokens, _ in encoded.values())
            outputs.write(encoded)
            progress.update(num_documents, len(errors), empty, num_tokens, num_bytes)
        outputs.commit()
    except BaseException:
        outputs.discard()
        raise
    finally:
        if pool:
            pool.terminate()
            pool.join()
    progress.summary(outputs)
    return progress


def start_workers(encoder, workers):
    """A pool for several workers; one worker runs in this process, which saves
    shipping every line and token to another process and back."""
    if workers == 1:
        encoder.initializer()
        return None
    return multiprocessing.Pool(workers, initializer=encoder.initializer)


def report_errors(errors, strict) -> None:
    for line_number, message in errors:
        text = f"line {line_number}: {message}"
        if strict:
            raise InputError(f"{text} (--strict: stopping)")
        print(f"{text}; skipped", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except InputError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("interrupted; no output written", file=sys.stderr, flush=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
