#!/usr/bin/env python
"""Tokenizes a corpus into Megatron's MMIDIDX ``{prefix}_{key}_{document|sentence}.bin/.idx``.

Same flags and the same bytes as Megatron-LM's tools/preprocess_data.py (see
docs/data.md). ``--input`` is a JSON-lines file (.gz/.zst too), a Parquet
file, a directory or a glob of shards. Worker processes parse and tokenize
chunks of records; the main process reads the input, writes the tokens in
input order, and renames temporary outputs into place only when everything
succeeded (the .idx last), so an interrupted or killed (SIGTERM) run never
leaves a pair that looks complete.
"""

import argparse
import itertools
import json
import os
import signal
import sys
from typing import Any

import numpy as np

try:
    import megatron_ul  # noqa: F401
except ModuleNotFoundError:  # `python tools/NAME.py` from a checkout without the install
    sys.exit("megatron_ul is not installed: run `bash scripts/install.sh` (or pip install -e .)")

from megatron_ul import progress
from megatron_ul.data import corpus
from megatron_ul.data.indexed_dataset import (
    IndexedDatasetBuilder,
    data_file_path,
    index_file_path,
    token_dtype_for_vocab,
)
from megatron_ul.data.ordered_workers import OrderedWorkers, WorkerError
from megatron_ul.data.sentences import (
    SentenceSplitterError,
    build_sentence_splitter,
    split_sentences,
)
from megatron_ul.data.tokenizers import TOKENIZER_TYPES, build_tokenizer

# Chunk sizes live in corpus.py; kept here as names tests may shrink.
LINES_PER_CHUNK = corpus.LINES_PER_CHUNK
CHUNK_BYTES = corpus.CHUNK_BYTES


class InputError(Exception):
    """A problem with the command line or the input found before or during the run."""


class Terminated(BaseException):
    """SIGTERM arrived (e.g. Slurm preemption): clean up like Ctrl-C."""


class TerminationRequest:
    """Set by the SIGTERM handler, acted on between chunks: raising from inside the
    handler could interrupt a half-written pipe message or output file."""

    requested = False

    @classmethod
    def handler(cls, signum, frame):
        cls.requested = True

    @classmethod
    def check(cls):
        if cls.requested:
            raise Terminated()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    group = parser.add_argument_group("input data")
    group.add_argument(
        "--input",
        required=True,
        help="JSONL file (.gz/.zst accepted), Parquet file, a directory or a glob of shards",
    )
    group.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="keys (columns) to extract from each record",
    )
    group.add_argument(
        "--split-sentences",
        action="store_true",
        help="split texts into sentences with NLTK Punkt (needs nltk and its punkt_tab data)",
    )
    group.add_argument(
        "--keep-newlines",
        action="store_true",
        help="with --split-sentences: keep the newlines (whitespace) after each sentence",
    )
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer merges.txt")
    group.add_argument(
        "--tokenizer-model",
        default=None,
        help="SentencePiece .model, or a Hugging Face tokenizer folder for HuggingFaceTokenizer",
    )
    group.add_argument(
        "--vocab-size", type=int, default=None, help="NullTokenizer: ids 0..N-1, EOD = N"
    )
    group.add_argument(
        "--append-eod", action="store_true", help="append the EOD token to every non-empty document"
    )
    group.add_argument("--lang", default="english", help="Punkt model for --split-sentences")
    # Megatron-LM's two HuggingFaceTokenizer paths: with the tokenizer's special tokens (BOS
    # ...; its default from 0.18 and its --legacy-tokenizer) or the text's tokens only (its
    # 0.16/0.17 default; --tokenizer-hf-no-include-special-tokens from 0.18).
    group.add_argument(
        "--tokenizer-hf-no-include-special-tokens",
        dest="include_special_tokens",
        action="store_false",
        default=True,
        help="HuggingFaceTokenizer: the text's own tokens only, no BOS (Megatron-LM 0.16/0.17's "
        "default); default: with the special tokens, as Megatron-LM 0.18+ and --legacy-tokenizer",
    )
    group.add_argument(
        "--tokenizer-hf-include-special-tokens",
        dest="include_special_tokens",
        action="store_true",
        help="HuggingFaceTokenizer: with the special tokens (the default; Megatron-LM 0.16/0.17 "
        "spelling)",
    )
    group.add_argument(
        "--legacy-tokenizer",
        action="store_true",
        help="Megatron-LM 0.16/0.17's legacy tokenizers: for HuggingFaceTokenizer the special "
        "tokens included (the default here); other tokenizer types are the same either way",
    )
    group = parser.add_argument_group("output data")
    group.add_argument(
        "--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx"
    )
    group.add_argument(
        "--dataset-impl",
        default="mmap",
        choices=["mmap"],
        help="accepted for older Megatron command lines; mmap (MMIDIDX) is the only format",
    )
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="Megatron-LM's output order for N partitions: record i goes to partition i %% N, "
        "partitions are concatenated in order (all in one process here)",
    )
    group.add_argument(
        "--keep-sequential-samples",
        action="store_true",
        help="with --partitions: partitions are contiguous blocks, i.e. input order is kept",
    )
    group.add_argument(
        "--shard-block",
        default=None,
        metavar="I/N",
        help="process only block I of N contiguous blocks of the sorted input shards (Slurm "
        "arrays: merging the N outputs in order with tools/merge_datasets.py gives the "
        "bytes of one run over all shards); an empty block writes an empty dataset",
    )
    group.add_argument(
        "--log-interval", type=int, default=1000, help="documents between progress lines"
    )
    group.add_argument(
        "--strict",
        action="store_true",
        help="stop at the first malformed record instead of skipping",
    )
    args = parser.parse_args(argv)
    for flag in ("workers", "partitions", "log_interval"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.keep_newlines and not args.split_sentences:
        parser.error("--keep-newlines only applies with --split-sentences")
    if args.legacy_tokenizer and not args.include_special_tokens:
        parser.error(
            "--legacy-tokenizer always includes the special tokens; drop "
            "--tokenizer-hf-no-include-special-tokens"
        )
    if not args.include_special_tokens and args.tokenizer_type != "HuggingFaceTokenizer":
        parser.error(
            "--tokenizer-hf-no-include-special-tokens applies to --tokenizer-type "
            "HuggingFaceTokenizer only"
        )
    if args.shard_block is not None:
        try:
            index, count = (int(part) for part in args.shard_block.split("/"))
        except ValueError:
            parser.error(f"--shard-block {args.shard_block!r}: expected I/N, e.g. 3/16")
        if not 0 <= index < count:
            parser.error(f"--shard-block {args.shard_block!r}: need 0 <= I < N")
        args.shard_block = (index, count)
        if args.partitions > 1 and not args.keep_sequential_samples:
            parser.error(
                "--shard-block cannot reproduce --partitions' interleaved order; use one or the "
                "other"
            )
    return args


def shard_block(shards, index, count):
    """Block ``index`` of ``count`` contiguous, near-equal blocks (sizes differ by at most one)."""
    start = index * len(shards) // count
    return shards[start : (index + 1) * len(shards) // count]


def output_level(args) -> str:
    return "sentence" if args.split_sentences else "document"


def check_inputs(args) -> list:
    """Every shard readable (and at least one record) before any output exists."""
    try:
        shards = corpus.expand_inputs(args.input)
        if args.shard_block is not None:
            shards = shard_block(shards, *args.shard_block)
        has_records = [corpus.check_shard(path, args.json_keys) for path in shards]
    except corpus.CorpusError as error:
        raise InputError(str(error)) from error
    if not any(has_records) and args.shard_block is None:
        raise InputError(f"--input {args.input}: empty input (no non-blank line)")
    return shards


def check_output_prefix(prefix) -> None:
    directory = os.path.dirname(os.path.abspath(prefix))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        raise InputError(
            f"--output-prefix {prefix}: cannot create directory {directory} ({error})"
        ) from error
    if not os.access(directory, os.W_OK | os.X_OK):
        raise InputError(f"--output-prefix {prefix}: directory {directory} is not writable")


def build_tokenizer_from_args(args):
    try:
        tokenizer = build_tokenizer(
            args.tokenizer_type,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            tokenizer_model=args.tokenizer_model,
            vocab_size=args.vocab_size,
            include_special_tokens=args.include_special_tokens,
        )
        if args.append_eod:
            tokenizer.eod  # noqa: B018 -- fails now, not mid-run, if there is no EOD
    except (ValueError, FileNotFoundError, OSError, RuntimeError) as error:
        raise InputError(str(error)) from error
    return tokenizer


def build_splitter_from_args(args):
    if not args.split_sentences:
        return None
    try:
        return build_sentence_splitter(args.lang, args.keep_newlines)
    except SentenceSplitterError as error:
        raise InputError(str(error)) from error


class ChunkEncoder:
    """Runs in each worker: parses, splits and tokenizes one corpus.Chunk.

    The tokenizer lives on the class (set by the initializer in each worker
    process), so pickling the encoder never ships a tokenizer.
    """

    # set once per worker process by initializer()
    tokenizer: Any = None
    splitter: Any = None
    dtype: Any = None

    def __init__(self, args):
        self.args = args

    def initializer(self):
        ChunkEncoder.tokenizer = build_tokenizer_from_args(self.args)
        ChunkEncoder.splitter = build_splitter_from_args(self.args)
        ChunkEncoder.dtype = token_dtype_for_vocab(ChunkEncoder.tokenizer.vocab_size)

    def encode(self, chunk):
        """Returns an EncodedChunk for the chunk's valid records."""
        errors: list[tuple] = []
        record_ids: list[int] = []
        documents: list[tuple] = []
        for position, record in enumerate(chunk.records):
            where = (chunk.path, chunk.first_in_shard + position + 1)
            document = parse_record(record, self.args.json_keys, where, errors)
            if document is not None:
                record_ids.append(chunk.first + position)
                documents.append((where, document))
        sentence_ids = self.tokenize_documents(documents, errors)
        keep = [position for position, ids in enumerate(sentence_ids) if ids is not None]
        outputs, empty = {}, 0
        for key_position, key in enumerate(self.args.json_keys):
            per_document = [sentence_ids[position][key_position] for position in keep]
            outputs[key] = self.to_arrays(per_document)
        empty = sum(
            1
            for position in keep
            if any(not any(sentences) for sentences in sentence_ids[position])
        )
        errors.sort()
        return EncodedChunk(
            chunk, errors, [record_ids[position] for position in keep], outputs, empty
        )

    def sentences_of(self, value):
        if isinstance(value, list):  # Megatron's format for text already split into sentences
            return value
        if self.splitter is not None:
            return split_sentences(self.splitter, value)
        return [value]

    def tokenize_documents(self, documents, errors):
        """Per document: [per key: [ids per sentence]], or None if it failed (reported)."""
        keys = self.args.json_keys
        texts, shapes = [], []
        for _, document in documents:
            shape = []
            for key in keys:
                sentences = self.sentences_of(document[key])
                texts.extend(sentences)
                shape.append(len(sentences))
            shapes.append(shape)
        try:
            flat = self.tokenizer.tokenize_batch(texts) if texts else []
        except Exception:
            flat = None
        results: list[list | None] = []
        cursor = 0
        for (where, _), shape in zip(documents, shapes):
            count = sum(shape)
            ids = (
                flat[cursor : cursor + count]
                if flat is not None
                else self.tokenize_one(texts[cursor : cursor + count], where, errors)
            )
            cursor += count
            if ids is None:
                results.append(None)
                continue
            per_key, start = [], 0
            for num_sentences in shape:
                per_key.append(ids[start : start + num_sentences])
                start += num_sentences
            results.append(per_key)
        return results

    def tokenize_one(self, texts, where, errors):
        try:
            return [self.tokenizer.tokenize(text) for text in texts]
        except Exception as error:
            errors.append((*where, f"cannot tokenize ({error})"))
            return None

    def to_arrays(self, documents):
        """Megatron's rule per document: drop empty sentences; EOD joins the last one
        (a document without tokens gets no EOD and no sequence)."""
        eod = self.tokenizer.eod if self.args.append_eod else None
        lengths: list[int] = []
        counts: list[int] = []
        pieces: list[list[int]] = []
        for sentences in documents:
            kept = [ids for ids in sentences if len(ids)]
            if kept and eod is not None:
                kept[-1] = list(kept[-1]) + [eod]
            counts.append(len(kept))
            lengths.extend(len(ids) for ids in kept)
            pieces.extend(kept)
        sizes = np.asarray(lengths, dtype=np.int32)
        tokens = np.fromiter(
            itertools.chain.from_iterable(pieces), dtype=self.dtype, count=int(sizes.sum())
        )
        return tokens, sizes, np.asarray(counts, dtype=np.int64)


class EncodedChunk:
    __slots__ = ("chunk_bytes", "position", "errors", "record_ids", "outputs", "empty")

    def __init__(self, chunk, errors, record_ids, outputs, empty):
        self.chunk_bytes, self.position = chunk.num_bytes, chunk.position
        self.errors, self.record_ids, self.outputs, self.empty = errors, record_ids, outputs, empty

    @property
    def num_documents(self):
        return len(self.record_ids)

    @property
    def num_tokens(self):
        return sum(len(tokens) for tokens, _, _ in self.outputs.values())


def parse_record(record, keys, where, errors):
    """Returns the record as a dict, or None after recording why it is skipped."""
    if isinstance(record, dict):
        document = record
    else:
        if not record.strip():
            return None
        try:
            document = json.loads(record)
        except ValueError as error:
            errors.append((*where, f"malformed JSON ({error})"))
            return None
        if not isinstance(document, dict):
            errors.append((*where, "not a JSON object"))
            return None
    for key in keys:
        if key not in document:
            errors.append((*where, f"missing key {key!r}"))
            return None
        value = document[key]
        if not (
            isinstance(value, str)
            or (isinstance(value, list) and all(isinstance(s, str) for s in value))
        ):
            errors.append((*where, f"key {key!r} is not a string or a list of strings"))
            return None
    return document


class OutputSet:
    """Per JSON key, one builder per partition, writing temporary files until ``commit``.

    With one partition the builder writes the final file's temporary name
    directly; with N (Megatron-LM's ``--partitions`` order) partitions 1..N-1
    go to their own temporary files and are appended at commit time.
    """

    def __init__(self, prefix, keys, dtype, level="document", partitions=1):
        self.final_prefixes = {key: f"{prefix}_{key}_{level}" for key in keys}
        self.suffix = f".tmp-{os.getpid()}"
        self.partitions = partitions
        self.builders = {}
        for key, final in self.final_prefixes.items():
            self.builders[key] = [
                IndexedDatasetBuilder(data_file_path(final) + self.suffix, dtype=dtype)
            ]
            self.builders[key] += [
                IndexedDatasetBuilder(data_file_path(self.partition_prefix(final, p)), dtype=dtype)
                for p in range(1, partitions)
            ]

    def partition_prefix(self, final, partition):
        return f"{final}-partition{partition}{self.suffix}"

    def write(self, encoded: EncodedChunk):
        if self.partitions == 1:
            for key, (tokens, lengths, counts) in encoded.outputs.items():
                self.builders[key][0].add_documents(tokens, lengths, counts)
            return
        partition_of = np.asarray(encoded.record_ids, dtype=np.int64) % self.partitions
        for key, (tokens, lengths, counts) in encoded.outputs.items():
            sequence_ends = np.cumsum(counts)
            token_ends = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
            for position, partition in enumerate(partition_of):
                first_sequence = int(sequence_ends[position] - counts[position])
                last_sequence = int(sequence_ends[position])
                self.builders[key][partition].add_documents(
                    tokens[token_ends[first_sequence] : token_ends[last_sequence]],
                    lengths[first_sequence:last_sequence],
                    [counts[position]],
                )

    def commit(self):
        for key, final in self.final_prefixes.items():
            builders = self.builders[key]
            for partition in range(1, self.partitions):
                builders[partition].finalize(
                    index_file_path(self.partition_prefix(final, partition))
                )
                builders[0].add_index(self.partition_prefix(final, partition))
            builders[0].finalize(index_file_path(final) + self.suffix)
        for final in self.final_prefixes.values():
            # Remove a stale .idx first so no moment pairs the new .bin with an old .idx.
            if os.path.exists(index_file_path(final)):
                os.remove(index_file_path(final))
            os.replace(data_file_path(final) + self.suffix, data_file_path(final))
            os.replace(index_file_path(final) + self.suffix, index_file_path(final))
        self.remove_partition_files()

    def remove_partition_files(self):
        for final in self.final_prefixes.values():
            for partition in range(1, self.partitions):
                prefix = self.partition_prefix(final, partition)
                for path in (data_file_path(prefix), index_file_path(prefix)):
                    if os.path.exists(path):
                        os.remove(path)

    def discard(self):
        for key, final in self.final_prefixes.items():
            for builder in self.builders[key]:
                builder.abort()
            for path in (data_file_path(final) + self.suffix, index_file_path(final) + self.suffix):
                if os.path.exists(path):
                    os.remove(path)
        self.remove_partition_files()


class Progress:
    """Documents/s, MB/s, tokens/s, share of the input read and ETA, on stderr (the shared
    reporter of megatron_ul/progress.py), and the counts check_documents judges."""

    def __init__(self, log_interval, total_bytes):
        self.reporter = progress.Progress(
            "documents", log_interval, rate_unit="docs", total_bytes=max(int(total_bytes), 1)
        )
        self.skipped = self.empty = 0

    @property
    def documents(self) -> int:
        return self.reporter.count

    @property
    def tokens(self) -> int:
        return self.reporter.extras.get("tokens", 0)

    def update(self, encoded: EncodedChunk):
        self.skipped += len(encoded.errors)
        self.empty += encoded.empty
        self.reporter.update(
            encoded.num_documents,
            encoded.chunk_bytes,
            position=encoded.position,
            tokens=encoded.num_tokens,
        )

    def summary(self, outputs):
        self.reporter.summary(
            f"{self.tokens} tokens, {self.empty} empty documents, {self.skipped} bad lines skipped"
        )
        for final in outputs.final_prefixes.values():
            print(
                f"wrote {data_file_path(final)} and {index_file_path(final)}",
                file=sys.stderr,
                flush=True,
            )


def run(args) -> Progress:
    """Tokenizes the input into the output files; raises InputError on bad input."""
    shards = check_inputs(args)
    check_output_prefix(args.output_prefix)
    tokenizer = build_tokenizer_from_args(args)
    build_splitter_from_args(args)  # a missing NLTK model stops the run here, not in a worker
    dtype = token_dtype_for_vocab(tokenizer.vocab_size)
    encoder = ChunkEncoder(args)
    progress = Progress(args.log_interval, sum(os.path.getsize(path) for path in shards))
    # Contiguous partitions (--keep-sequential-samples) concatenate back to input order.
    partitions = 1 if args.keep_sequential_samples else args.partitions
    outputs = OutputSet(args.output_prefix, args.json_keys, dtype, output_level(args), partitions)
    workers = None
    try:
        workers = start_workers(encoder, args.workers)
        chunks = corpus.read_chunks(shards, args.json_keys, LINES_PER_CHUNK, CHUNK_BYTES)
        encoded_chunks = (
            workers.imap(chunks, TerminationRequest.check)
            if workers
            else map(encoder.encode, chunks)
        )
        for encoded in encoded_chunks:
            TerminationRequest.check()
            report_errors(encoded.errors, args.strict)
            outputs.write(encoded)
            progress.update(encoded)
        TerminationRequest.check()
        check_documents(args, progress)
        outputs.commit()
    except corpus.CorpusError as error:
        outputs.discard()
        raise InputError(str(error)) from error
    except InputError:
        outputs.discard()
        raise
    except OSError as error:
        outputs.discard()
        raise InputError(
            f"--output-prefix {args.output_prefix}: write failed ({error}); nothing written"
        ) from error
    except WorkerError:
        outputs.discard()
        TerminationRequest.check()  # a worker killed along with us is the termination, not a bug
        raise
    except BaseException:
        outputs.discard()
        raise
    finally:
        if workers:
            workers.stop()
    progress.summary(outputs)
    return progress


def check_documents(args, progress) -> None:
    """A run whose input yields no document at all (every line bad, or every document empty:
    no token written) fails instead of writing an empty dataset. A --shard-block with no
    records is allowed (its empty part merges to nothing)."""
    if progress.tokens > 0:
        return
    if args.shard_block is not None and progress.documents == 0 and progress.skipped == 0:
        return
    raise InputError(
        f"--input {args.input}: no document to write ({progress.documents} documents, "
        f"{progress.empty} of them empty, {progress.skipped} bad lines skipped); is it JSON "
        f"lines with the --json-keys {args.json_keys}?"
    )


def start_workers(encoder, workers):
    """Worker processes for several workers; one worker runs in this process, which saves
    shipping every line and token to another process and back."""
    if workers == 1:
        encoder.initializer()
        return None
    return OrderedWorkers(workers, encoder.initializer, encoder.encode)


def report_errors(errors, strict) -> None:
    for path, line_number, message in errors:
        text = f"{path} line {line_number}: {message}"
        if strict:
            raise InputError(f"{text} (--strict: stopping)")
        print(f"{text}; skipped", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    TerminationRequest.requested = False
    previous = signal.signal(signal.SIGTERM, TerminationRequest.handler)
    try:
        run(args)
    except InputError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2  # bad input or output: like every other tool's refusal
    except KeyboardInterrupt:
        print("interrupted; no output written", file=sys.stderr, flush=True)
        return 130
    except Terminated:
        print("terminated (SIGTERM); no output written", file=sys.stderr, flush=True)
        return 143
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
