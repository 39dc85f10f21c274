#!/usr/bin/env python
"""Import megatron-core GPTModel checkpoints (Megatron-LM's today) into megatron_ul, and export.

    python -m tools.checkpoint.megatron_core import --load-dir MEGATRON_CKPT --save-dir OURS \
        [--target-tensor-parallel-size T] [--target-pipeline-parallel-size P] \
        [--iteration N] [--true-vocab-size V] [--trust-pickle]
    python -m tools.checkpoint.megatron_core export --load-dir OURS --save-dir MEGATRON_CKPT \
        [--ckpt-format torch_dist|torch] [--transformer-impl transformer_engine|local] \
        [--target-tensor-parallel-size T] [--target-pipeline-parallel-size P]

Import reads either format (--ckpt-format torch stage files or torch_dist, told apart by the
iteration directory; no megatron package needed). Export writes torch_dist (default; layout-free,
needs megatron-core installed) or torch stage files for TP × PP with the layer names of
--transformer-impl. Only weights travel; see docs/checkpointing.md.
"""

import argparse
import os
import sys

try:
    import megatron_ul  # noqa: F401
except ModuleNotFoundError:  # `python tools/NAME.py` from a checkout without the install
    sys.exit("megatron_ul is not installed: run `bash scripts/install.sh` (or pip install -e .)")

from megatron_ul.checkpoint import files
from megatron_ul.checkpoint.files import CheckpointError
from megatron_ul.checkpoint.hf import model_flags
from megatron_ul.checkpoint.megatron_core import (
    FORMATS,
    SPECS,
    WEIGHTS_ONLY,
    export_core,
    import_core,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="megatron-core GPTModel checkpoint -> megatron_ul")
    exp = sub.add_parser("export", help="megatron_ul checkpoint -> megatron-core GPTModel")
    for s in (imp, exp):
        s.add_argument("--load-dir", required=True)
        s.add_argument("--save-dir", required=True)
        s.add_argument("--target-tensor-parallel-size", type=int, default=None)
        s.add_argument("--target-pipeline-parallel-size", type=int, default=None)
    imp.add_argument("--iteration", type=int, default=None, help="default: the tracker's")
    imp.add_argument(
        "--true-vocab-size",
        type=int,
        default=None,
        help="drop the padded vocabulary rows (default: args.vocab_size when "
        "recorded, else keep the padded size as Megatron computed with it)",
    )
    imp.add_argument(
        "--trust-pickle",
        action="store_true",
        help="unpickle args objects the restricted loader refuses",
    )
    exp.add_argument(
        "--ckpt-format",
        choices=FORMATS,
        default="torch_dist",
        help="torch_dist (Megatron-LM's default; TP1/PP1 on disk, Megatron "
        "reshards on load) or torch (one file per TP × PP rank)",
    )
    exp.add_argument(
        "--transformer-impl",
        choices=SPECS,
        default="transformer_engine",
        help="the layer spec Megatron-LM will build (torch format names differ)",
    )
    return p


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    try:
        if not os.path.isdir(a.load_dir):
            raise CheckpointError(f"--load-dir {a.load_dir}: no such directory")
        if a.command == "import":
            out = import_core(
                a.load_dir,
                a.save_dir,
                a.target_tensor_parallel_size or 1,
                a.target_pipeline_parallel_size or 1,
                iteration=a.iteration,
                true_vocab_size=a.true_vocab_size,
                trust_pickle=a.trust_pickle,
            )
            model = files.read_metadata(out)["model"]
            print(f"wrote {out}\nnote: {WEIGHTS_ONLY}\nmodel flags: {' '.join(model_flags(model))}")
        else:
            if a.ckpt_format == "torch_dist" and (
                a.target_tensor_parallel_size or a.target_pipeline_parallel_size
            ):
                raise CheckpointError(
                    "--ckpt-format torch_dist is layout-free (Megatron "
                    "reshards it on load); --target-*-parallel-size applies "
                    "to --ckpt-format torch"
                )
            out, flags = export_core(
                a.load_dir,
                a.save_dir,
                a.ckpt_format,
                a.transformer_impl,
                a.target_tensor_parallel_size,
                a.target_pipeline_parallel_size,
            )
            print(f"wrote {out}\nnote: {WEIGHTS_ONLY}\nMegatron-LM flags: {' '.join(flags)}")
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
