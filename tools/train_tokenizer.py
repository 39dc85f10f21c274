#!/usr/bin/env python
"""Trains a SentencePiece model on one key of a JSONL corpus.

Defaults aim at a quick, usable model for the demo: BPE with byte fallback (no
unknown tokens on code), whitespace kept as-is, and a cap on sentences sampled.
The model's EOS (</s>) is what GPTSentencePieceTokenizer uses as EOD.
"""

import argparse
import json
import os
import sys


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--input", required=True, help="JSONL corpus")
    parser.add_argument("--json-key", default="text")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument(
        "--model-prefix", default="data/tokenizer", help="writes {prefix}.model and {prefix}.vocab"
    )
    parser.add_argument("--model-type", default="bpe", choices=["bpe", "unigram", "char", "word"])
    parser.add_argument(
        "--input-sentence-size",
        type=int,
        default=300000,
        help="lines sampled for training (keeps training quick)",
    )
    parser.add_argument("--max-documents", type=int, default=None)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    return parser.parse_args(argv)


def iter_lines(path, key, max_documents):
    """Yields the non-blank lines of each document's text (SentencePiece trains on sentences)."""
    with open(path, encoding="utf-8") as handle:
        for count, line in enumerate(handle):
            if max_documents is not None and count >= max_documents:
                return
            try:
                text = json.loads(line)[key]
            except (ValueError, KeyError, TypeError):
                continue
            for text_line in text.split("\n"):
                if text_line.strip():
                    yield text_line


def train(args) -> str:
    import sentencepiece

    if not os.path.isfile(args.input):
        raise SystemExit(f"error: --input {args.input}: no such file")
    os.makedirs(os.path.dirname(os.path.abspath(args.model_prefix)), exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter_lines(args.input, args.json_key, args.max_documents),
        model_prefix=args.model_prefix,
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        byte_fallback=True,
        character_coverage=0.9995,
        input_sentence_size=args.input_sentence_size,
        shuffle_input_sentence=True,
        max_sentence_length=8192,
        split_digits=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        allow_whitespace_only_pieces=True,
        num_threads=args.threads,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return args.model_prefix + ".model"


def main(argv=None) -> int:
    args = parse_args(argv)
    model_path = train(args)
    print(f"wrote {model_path} (vocab size {args.vocab_size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
