#!/usr/bin/env python
"""Import legacy Megatron-LM / Megatron-DeepSpeed checkpoints into megatron_ul, and export back.

    python -m tools.checkpoint.megatron_lm import --load-dir MEGATRON_CKPT --save-dir OURS \
        [--target-tensor-parallel-size T] [--target-pipeline-parallel-size P] \
        [--true-vocab-size V] [--trust-pickle]
    python -m tools.checkpoint.megatron_lm export --load-dir OURS --save-dir MEGATRON_CKPT \
        [--target-tensor-parallel-size T] [--target-pipeline-parallel-size P]

Reads and writes Megatron-LM's legacy GPT checkpoints (iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt,
language_model.* names, checkpoint_version 3.0), weights only; see docs/checkpointing.md for
the name mapping; megatron-core GPTModel checkpoints (torch or torch_dist) are
tools.checkpoint.megatron_core's. Import prints the model flags to train on with (--finetune);
export prints the Megatron-LM flags to load with.
"""

import sys

try:
    import megatron_ul  # noqa: F401
except ModuleNotFoundError:  # `python tools/NAME.py` from a checkout without the install
    sys.exit("megatron_ul is not installed: run `bash scripts/install.sh` (or pip install -e .)")

from megatron_ul.checkpoint.interop.cli import conversion_parser, run_subcommand


def main(argv=None) -> int:
    p, _, _ = conversion_parser(__doc__.split("\n\n")[0], "legacy Megatron-LM checkpoint")
    return run_subcommand(p.parse_args(argv), "megatron_lm")


if __name__ == "__main__":
    sys.exit(main())
