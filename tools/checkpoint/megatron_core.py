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

from megatron_ul.checkpoint.interop.cli import (
    add_core_write_flags,
    conversion_parser,
    run_subcommand,
)


def _parser():
    p, _, exp = conversion_parser(__doc__.split("\n\n")[0], "megatron-core GPTModel checkpoint")
    add_core_write_flags(exp)
    return p


def main(argv=None) -> int:
    return run_subcommand(_parser().parse_args(argv), "megatron_core")


if __name__ == "__main__":
    sys.exit(main())
