#!/usr/bin/env python
"""Benchmarks tools/preprocess_data.py: worker scaling, and side by side with Megatron-LM's script.

In one run: builds the demo corpus (>= 20 MB of Python standard library source,
unless --input is given), trains a SentencePiece model (unless
--tokenizer-model is given), then times

* a plain loop: read line, json.loads, encode, append EOD, write with the builder;
* tools/preprocess_data.py (the real command line) with each of --workers;
* with --megatron-lm DIR: Megatron-LM's tools/preprocess_data.py from that
  checkout (run with DIR first on PYTHONPATH) with the same flags and workers;

all with GPTSentencePieceTokenizer and --append-eod; checks that every output is
byte-identical, and prints the table (docs/benchmarks.md with --write-docs).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from megatron_ul.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    token_dtype_for_vocab,
)
from megatron_ul.data.tokenizers import build_tokenizer
from tools.bench.common import markdown_table, report

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIN_CORPUS_MB = 20
TOKENIZER = (
    "GPTSentencePieceTokenizer"  # the same id rule on both sides (no special-token splitting)
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--input", default=None, help="JSONL corpus (default: build the demo corpus)"
    )
    parser.add_argument(
        "--tokenizer-model", default=None, help="SentencePiece model (default: train one)"
    )
    parser.add_argument(
        "--vocab-size", type=int, default=32000, help="vocab size when training the model"
    )
    parser.add_argument(
        "--workdir", default=None, help="where corpus, model and outputs go (default: a temp dir)"
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per method; the fastest counts"
    )
    parser.add_argument(
        "--megatron-lm",
        default=None,
        help="a Megatron-LM checkout whose tools/preprocess_data.py runs here (e.g. core_v0.9.0)",
    )
    parser.add_argument(
        "--write-docs", action="store_true", help="write the section into docs/benchmarks.md"
    )
    return parser.parse_args(argv)


def run_tool(script, *arguments):
    command = [sys.executable, "-m", "tools." + script.removesuffix(".py"), *arguments]
    subprocess.run(
        command, check=True, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def prepare_inputs(args, workdir):
    corpus = args.input
    if corpus is None:
        corpus = os.path.join(workdir, "corpus.jsonl")
        run_tool("make_demo_corpus.py", "--output", corpus)
    size_mb = os.path.getsize(corpus) / 1e6
    if size_mb < MIN_CORPUS_MB:
        print(
            f"warning: corpus is {size_mb:.1f} MB, under the {MIN_CORPUS_MB} MB the benchmark "
            f"calls for",
            file=sys.stderr,
        )
    model = args.tokenizer_model
    if model is None:
        prefix = os.path.join(workdir, "sp")
        run_tool(
            "train_tokenizer.py",
            "--input",
            corpus,
            "--model-prefix",
            prefix,
            "--vocab-size",
            str(args.vocab_size),
        )
        model = prefix + ".model"
    return corpus, model


def plain_loop(corpus, model, prefix):
    """The straightforward single-process version, as a baseline; returns seconds."""
    start = time.time()
    tokenizer = build_tokenizer(TOKENIZER, tokenizer_model=model)
    builder = IndexedDatasetBuilder(
        prefix + ".bin", dtype=token_dtype_for_vocab(tokenizer.vocab_size)
    )
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
    run_tool(
        "preprocess_data.py",
        "--input",
        corpus,
        "--output-prefix",
        prefix,
        "--tokenizer-type",
        TOKENIZER,
        "--tokenizer-model",
        model,
        "--append-eod",
        "--workers",
        str(workers),
        "--log-interval",
        "1000000",
    )
    return time.time() - start


def timed_megatron_lm(checkout, corpus, model, prefix, workers):
    start = time.time()
    subprocess.run(
        [
            sys.executable,
            os.path.join(checkout, "tools", "preprocess_data.py"),
            "--input",
            corpus,
            "--output-prefix",
            prefix,
            "--tokenizer-type",
            TOKENIZER,
            "--tokenizer-model",
            model,
            "--append-eod",
            "--workers",
            str(workers),
            "--log-interval",
            "1000000",
        ],
        check=True,
        cwd=checkout,
        env=dict(os.environ, PYTHONPATH=checkout),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.time() - start


def same_files(first_prefix, second_prefix):
    return all(
        open(first_prefix + suffix, "rb").read() == open(second_prefix + suffix, "rb").read()
        for suffix in (".bin", ".idx")
    )


def measure(args, workdir):
    corpus, model = prepare_inputs(args, workdir)
    rows = []
    baseline_prefix = os.path.join(workdir, "plain_text_document")
    seconds = min(plain_loop(corpus, model, baseline_prefix) for _ in range(args.repeats))
    num_tokens = int(IndexedDataset(baseline_prefix).sequence_lengths.sum())
    rows.append(("plain loop (1 process, in the benchmark)", None, seconds))
    methods = [("megatron_ul tools/preprocess_data.py", timed_preprocess)]
    if args.megatron_lm:
        methods.append(
            (
                "Megatron-LM tools/preprocess_data.py",
                lambda c, m, p, w: timed_megatron_lm(args.megatron_lm, c, m, p, w),
            )
        )
    for workers in args.workers:
        # Alternate the tools within each repeat so that load on a shared machine hits both alike.
        best: dict[str, float] = {}
        for _ in range(args.repeats):
            for name, timed in methods:
                prefix = os.path.join(workdir, f"{len(best)}-{name.split()[0]}-w{workers}")
                seconds = timed(corpus, model, prefix, workers)
                if not same_files(prefix + "_text_document", baseline_prefix):
                    raise SystemExit(
                        f"error: {name} --workers {workers} wrote other bytes than the plain loop"
                    )
                best[name] = min(best.get(name, float("inf")), seconds)
        rows += [(name, workers, best[name]) for name, _ in methods]
    corpus_mb = os.path.getsize(corpus) / 1e6
    return corpus_mb, num_tokens, rows


def format_table(corpus_mb, num_tokens, rows):
    reference = {
        workers: seconds for name, workers, seconds in rows if name.startswith("Megatron-LM")
    }
    header = [
        "method",
        "--workers",
        "wall time (s)",
        "tokens/s",
        "MB/s",
        "vs Megatron-LM, same workers",
    ]
    table = []
    for name, workers, seconds in rows:
        ratio = f"{reference[workers] / seconds:.2f}x" if workers in reference else "-"
        table.append(
            [
                name,
                workers if workers is not None else "-",
                f"{seconds:.2f}",
                f"{num_tokens / seconds / 1e6:.2f} M",
                f"{corpus_mb / seconds:.1f}",
                ratio,
            ]
        )
    return markdown_table(header, table)


def main(argv=None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        corpus_mb, num_tokens, rows = measure(args, workdir)
    load = f"1-minute load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after the run"
    setup = (
        f"Corpus: {corpus_mb:.1f} MB JSONL ({num_tokens:,} tokens, EOD included), {TOKENIZER} "
        f"(BPE SentencePiece, {args.vocab_size} pieces), --append-eod. Best of {args.repeats} "
        f"runs each, "
        "the tools alternating; wall time includes starting the process (Megatron-LM's imports "
        "torch and "
        f"megatron). Every output is checked byte-identical to the plain loop's. {load} "
        f"(on {os.cpu_count()} cores: a loaded machine slows every row, workers most)."
    )
    report(
        "preprocess",
        "Preprocessing throughput (tools/preprocess_data.py)",
        setup,
        format_table(corpus_mb, num_tokens, rows),
        write_docs=args.write_docs,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
