#!/usr/bin/env python
"""Concatenates several MMIDIDX datasets (same token dtype) into one prefix.

    python -m tools.merge_datasets --input a_text_document b_text_document \\
        --output-prefix ab_text_document

Like preprocess_data.py, output goes to temporary files renamed at the end (the .idx last).
"""

import argparse
import os
import signal
import sys

try:
    import megatron_ul  # noqa: F401
except ModuleNotFoundError:  # `python tools/NAME.py` from a checkout without the install
    sys.exit("megatron_ul is not installed: run `bash scripts/install.sh` (or pip install -e .)")

from megatron_ul.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    data_file_path,
    index_file_path,
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--input", nargs="+", required=True, help="dataset prefixes (without .bin/.idx)"
    )
    parser.add_argument(
        "--output-prefix", required=True, help="writes {prefix}.bin and {prefix}.idx"
    )
    return parser.parse_args(argv)


def merge(prefixes, output_prefix) -> int:
    """Merges the datasets; returns the number of documents written."""
    datasets = [IndexedDataset(prefix) for prefix in prefixes]  # validates every input first
    dtypes = {dataset.dtype for dataset in datasets}
    if len(dtypes) > 1:
        raise IndexedDatasetError(
            f"--input datasets have different token dtypes: {sorted(map(str, dtypes))}"
        )
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    suffix = f".tmp-{os.getpid()}"
    bin_path, idx_path = data_file_path(output_prefix), index_file_path(output_prefix)
    builder = IndexedDatasetBuilder(bin_path + suffix, dtype=datasets[0].dtype)
    try:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(idx_path + suffix)
        if os.path.exists(idx_path):
            os.remove(idx_path)
        os.replace(bin_path + suffix, bin_path)
        os.replace(idx_path + suffix, idx_path)
    except BaseException:
        builder.abort()
        for path in (bin_path + suffix, idx_path + suffix):
            if os.path.exists(path):
                os.remove(path)
        raise
    return sum(dataset.num_documents for dataset in datasets)


class Terminated(BaseException):
    """SIGTERM arrived: leave no partial output (merge removes its temporary files)."""


def _raise_terminated(signum, frame):
    raise Terminated()


def main(argv=None) -> int:
    args = parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        num_documents = merge(args.input, args.output_prefix)
    except (IndexedDatasetError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except Terminated:
        print("terminated (SIGTERM); no output written", file=sys.stderr)
        return 143
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(
        f"wrote {data_file_path(args.output_prefix)} and {index_file_path(args.output_prefix)}: "
        f"{num_documents} documents from {len(args.input)} datasets"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
