#!/usr/bin/env python
"""Convert a megatron_ul checkpoint to another parallel layout.

    python -m tools.checkpoint.convert --load-dir A --save-dir B \
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1 [--no-optim] \
        [--target-num-layers-per-virtual-pipeline-stage N]

TP shards are merged by each parameter's partition dim/stride (recorded in metadata.json) and
re-split; pipeline stages (interleaved model chunks included) are re-cut by global layer name;
optimizer moments follow their parameters (the last stage's tied embedding copy gets the first
stage's table and moments). SP and DP targets only change metadata
(parameters and plain optimizer state are replicated over them). The source is never modified
and an existing iteration in B is never replaced. RNG states are not carried over: the new
layout's streams start from --seed.
"""

import argparse
import os
import sys

try:
    import megatron_ul  # noqa: F401
except ModuleNotFoundError:  # `python tools/NAME.py` from a checkout without the install
    sys.exit("megatron_ul is not installed: run `bash scripts/install.sh` (or pip install -e .)")

from megatron_ul.checkpoint.files import CheckpointError
from megatron_ul.checkpoint.layout.reshard import convert


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--target-tensor-parallel-size", type=int, required=True)
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    p.add_argument(
        "--target-num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="interleaved 1F1B target: layers per model chunk (default: none)",
    )
    p.add_argument(
        "--target-sequence-parallel-size",
        type=int,
        default=None,
        help="Ulysses degree recorded in the metadata (default: the source's)",
    )
    p.add_argument("--target-data-parallel-size", type=int, default=None)
    p.add_argument("--iteration", type=int, default=None, help="default: the latest")
    p.add_argument("--no-optim", action="store_true", help="convert the model weights only")
    a = p.parse_args(argv)
    if not os.path.isdir(a.load_dir):
        print(f"error: --load-dir {a.load_dir}: no such directory", file=sys.stderr)
        return 2
    for flag, value in [
        ("--target-tensor-parallel-size", a.target_tensor_parallel_size),
        ("--target-pipeline-parallel-size", a.target_pipeline_parallel_size),
        (
            "--target-num-layers-per-virtual-pipeline-stage",
            1
            if a.target_num_layers_per_virtual_pipeline_stage is None
            else a.target_num_layers_per_virtual_pipeline_stage,
        ),
    ]:
        if value < 1:
            print(f"error: {flag} must be >= 1", file=sys.stderr)
            return 2
    try:
        out = convert(
            a.load_dir,
            a.save_dir,
            a.target_tensor_parallel_size,
            a.target_pipeline_parallel_size,
            a.target_sequence_parallel_size,
            a.target_data_parallel_size,
            with_optim=not a.no_optim,
            iteration=a.iteration,
            vp=a.target_num_layers_per_virtual_pipeline_stage,
        )
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
