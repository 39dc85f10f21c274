#!/usr/bin/env python
"""Benchmarks tools/preprocess_data.py against a plain single-process loop.

In one run: builds the demo corpus (>= 20 MB of Python standard library source,
unless --input is given), trains a SentencePiece model (unless
--tokenizer-model is given), then times

* a plain loop: read line, json.loads, encode, append EOD, write with the builder;
* tools/preprocess_data.py (the real command line) with 1 and 2 workers;

checks that all three wrote identical .bin/.idx files, and prints a Markdown
table. With --write-docs it replaces the benchmark section of docs/data.md.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from megatron_ul.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, token_dtype_for_vocab
from megatron_ul.data.tokenizers import build_tokenizer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DOCS_PATH = os.path.join(REPO_ROOT, "docs", "data.md")
BENCH_START = "<!-- bench:start -->"
BENCH_END = "<!-- bench:end -->"
MIN_CORPUS_MB = 20


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", default=None, help="JSONL corpus (default: build the demo corpus)")
    parser.add_argument("--tokenizer-model", default=None, help="SentencePiece model (default: train one)")
    parser.add_argument("--vocab-size", type=int, default=32000, help="vocab size when training the model")
    parser.add_argument("--workdir", default=None, help="where corpus, model and outputs go (default: a temp dir)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3, help="runs per method; the fastest counts")
    parser.add_argument("--write-docs", action="store_true", help=f"write the table into {DOCS_PATH}")
    return parser.parse_args(argv)


def run_tool(script, *arguments):
    command = [sys.executable, "-m", "tools." + script.removesuffix(".py"), *arguments]
    subprocess.run(command, check=True, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def prepare_inputs(args, workdir):
    corpus = args.input
    if corpus is None:
        corpus = os.path.join(workdir, "corpus.jsonl")
        run_tool("make_demo_corpus.py", "--output", corpus)
    size_mb = os.path.getsize(corpus) / 1e6
    if size_mb < MIN_CORPUS_MB:
        print(f"warning: corpus is {size_mb:.1f} MB, under the {MIN_CORPUS_MB} MB the benchmark calls for",
              file=sys.stderr)
    model = args.tokenizer_model
    if model is None:
        prefix = os.path.join(workdir, "sp")
        run_tool("train_tokenizer.py", "--input", corpus, "--model-prefix", prefix,
                 "--vocab-size", str(args.vocab_size))
        model = prefix + ".model"
    return corpus, model


def plain_loop(corpus, model, prefix):
    """The straightforward single-process version, as a baseline; returns seconds."""
    start = time.time()
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=token_dtype_for_vocab(tokenizer.vocab_size))
    with open(corpus, encoding="utf-8") as handle:
        for line in handle:
            ids = tokenizer.tokenize(json.loads(line)["text"])
            ids.append(tokenizer.eod)
            builder.add_item(ids)
            builder.end_document()
    builder.finalize(prefix + ".idx")
    return time.time() - start


def timed_preprocess(corpus, model, prefix, workers):
    start = time.time()
    run_tool("preprocess_data.py", "--input", corpus, "--output-prefix", prefix, "--tokenizer-type",
             "SentencePieceTokenizer", "--tokenizer-model", model, "--append-eod", "--workers", str(workers),
             "--log-interval", "1000000")
    return time.time() - start


def same_files(first_prefix, second_prefix):
    return all(open(first_prefix + suffix, "rb").read() == open(second_prefix + suffix, "rb").read()
               for suffix in (".bin", ".idx"))


def measure(args, workdir):
    corpus, model = prepare_inputs(args, workdir)
    rows = []
    baseline_prefix = os.path.join(workdir, "plain_text_document")
    seconds = min(plain_loop(corpus, model, baseline_prefix) for _ in range(args.repeats))
    num_tokens = int(IndexedDataset(baseline_prefix).sequence_lengths.sum())
    rows.append(("plain loop (1 process)", seconds))
    for workers in args.workers:
        prefix = os.path.join(workdir, f"w{workers}")
        seconds = min(timed_preprocess(corpus, model, prefix, workers) for _ in range(args.repeats))
        if not same_files(prefix + "_text_document", baseline_prefix):
            raise SystemExit(f"error: output with --workers {workers} differs from the plain loop's")
        rows.append((f"tools/preprocess_data.py --workers {workers}", seconds))
    corpus_mb = os.path.getsize(corpus) / 1e6
    return corpus_mb, num_tokens, rows


def format_table(corpus_mb, num_tokens, rows, repeats):
    baseline = rows[0][1]
    lines = ["| method | wall time (s) | tokens/s | MB/s | speed-up vs plain loop |",
             "|---|---:|---:|---:|---:|"]
    for name, seconds in rows:
        lines.append(f"| {name} | {seconds:.2f} | {num_tokens / seconds / 1e6:.2f} M | "
                     f"{corpus_mb / seconds:.1f} | {baseline / seconds:.2f}x |")
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
               f"Python {platform.python_version()}")
    lines.append("")
    lines.append(f"Best of {repeats} runs each. Corpus: {corpus_mb:.1f} MB JSONL, {num_tokens:,} tokens "
                 f"(EOD included). Machine: {machine}. "
                 "The tool's wall time includes starting the process (the plain loop runs inside the benchmark); "
                 "all three outputs are checked byte-identical.")
    return "\n".join(lines)


def write_docs(table, command):
    section = f"{BENCH_START}\nCommand:\n\n```\n{command}\n```\n\n{table}\n{BENCH_END}"
    text = open(DOCS_PATH, encoding="utf-8").read() if os.path.exists(DOCS_PATH) else ""
    if BENCH_START in text and BENCH_END in text:
        head, rest = text.split(BENCH_START, 1)
        text = head + section + rest.split(BENCH_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n## Preprocessing benchmark\n\n" + section + "\n"
    with open(DOCS_PATH, "w", encoding="utf-8") as handle:
        handle.write(text)


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        corpus_mb, num_tokens, rows = measure(args, workdir)
    table = format_table(corpus_mb, num_tokens, rows, args.repeats)
    print(table)
    if args.write_docs:
        command = "python -m tools.bench.bench_preprocess " + " ".join(argv if argv is not None else sys.argv[1:])
        write_docs(table, command.strip())
        print(f"wrote the table into {DOCS_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
