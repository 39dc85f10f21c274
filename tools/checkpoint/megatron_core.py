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

import sys

try:
    import megatron_ul  # noqa: F401
except ModuleNotFoundError:  # `python tools/NAME.py` from a checkout without the install
    sys.exit("megatron_ul is not installed: run `bash scripts/install.sh` (or pip install -e .)")

from megatron_ul.checkpoint.files import CheckpointError
from megatron_ul.checkpoint.interop.cli import conversion_parser, run_conversion
from megatron_ul.checkpoint.interop.megatron_core import (
    FORMATS,
    SPECS,
    WEIGHTS_ONLY,
    dist_layout,
    export_core,
    import_core,
    null_tokenizer_note,
)


def _parser():
    p, _, exp = conversion_parser(__doc__.split("\n\n")[0], "megatron-core GPTModel checkpoint")
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


def _export(a) -> str:
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
    notes = [WEIGHTS_ONLY]
    if a.ckpt_format == "torch_dist":
        notes.append(dist_layout())
    notes += null_tokenizer_note(flags)
    text = "".join(f"note: {n}\n" for n in notes)
    return f"wrote {out}\n{text}Megatron-LM flags: {' '.join(flags)}"


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    return run_conversion(a, import_core, _export, note=f"note: {WEIGHTS_ONLY}\n")


if __name__ == "__main__":
    sys.exit(main())
