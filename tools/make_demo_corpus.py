#!/usr/bin/env python
"""Turns a folder of text files into a JSONL corpus, one {"text": ...} per file.

With no --input-dir it uses the Python standard library's own sources, which
exist wherever Python does, so a newcomer can train on real text offline.
"""

import argparse
import glob
import json
import os
import sys


def default_input_dir() -> str:
    # os.py sits at the top of the standard library on every platform.
    return os.path.dirname(os.path.abspath(os.__file__))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--input-dir",
        default=None,
        help="folder to read (default: the Python standard library sources)",
    )
    parser.add_argument("--glob", default="**/*.py", help="file pattern, relative to --input-dir")
    parser.add_argument("--output", default="data/demo_corpus.jsonl", help="JSONL file to write")
    parser.add_argument(
        "--max-mb", type=float, default=None, help="stop after this many MB of text"
    )
    parser.add_argument(
        "--exclude",
        nargs="*",
        default=["site-packages", "dist-packages", "__pycache__"],
        help="skip files whose path contains one of these folder names",
    )
    return parser.parse_args(argv)


def list_files(input_dir, pattern, exclude):
    paths = sorted(glob.glob(os.path.join(input_dir, pattern), recursive=True))
    excluded = set(exclude)
    for path in paths:
        parts = os.path.relpath(path, input_dir).split(os.sep)
        if os.path.isfile(path) and not excluded.intersection(parts):
            yield path


def read_text(path):
    """Returns the file's text, or None for binary or undecodable files."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
        if b"\x00" in raw:
            return None
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def write_corpus(args) -> tuple:
    input_dir = args.input_dir or default_input_dir()
    if not os.path.isdir(input_dir):
        raise SystemExit(f"error: --input-dir {input_dir}: not a directory")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    max_bytes = None if args.max_mb is None else int(args.max_mb * 1e6)
    num_documents = num_bytes = 0
    temporary = args.output + ".tmp"
    with open(temporary, "w", encoding="utf-8") as out:
        for path in list_files(input_dir, args.glob, args.exclude):
            text = read_text(path)
            if not text or not text.strip():
                continue
            out.write(json.dumps({"text": text, "source": os.path.relpath(path, input_dir)}) + "\n")
            num_documents += 1
            num_bytes += len(text.encode("utf-8"))
            if max_bytes is not None and num_bytes >= max_bytes:
                break
    os.replace(temporary, args.output)
    return input_dir, num_documents, num_bytes


def main(argv=None) -> int:
    args = parse_args(argv)
    input_dir, num_documents, num_bytes = write_corpus(args)
    if num_documents == 0:
        print(f"error: no text files matched {args.glob!r} under {input_dir}", file=sys.stderr)
        return 1
    print(
        f"wrote {args.output}: {num_documents} documents, {num_bytes / 1e6:.1f} MB of text "
        f"from {input_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
