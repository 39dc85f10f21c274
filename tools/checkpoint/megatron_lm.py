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
from megatron_ul.checkpoint.megatron_lm import export_megatron, import_megatron


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="legacy Megatron-LM checkpoint -> megatron_ul")
    exp = sub.add_parser("export", help="megatron_ul checkpoint -> legacy Megatron-LM")
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
        help="unpickle args objects torch's weights_only loader refuses",
    )
    a = p.parse_args(argv)
    try:
        if not os.path.isdir(a.load_dir):
            raise CheckpointError(f"--load-dir {a.load_dir}: no such directory")
        if a.command == "import":
            out = import_megatron(
                a.load_dir,
                a.save_dir,
                a.target_tensor_parallel_size or 1,
                a.target_pipeline_parallel_size or 1,
                iteration=a.iteration,
                true_vocab_size=a.true_vocab_size,
                trust_pickle=a.trust_pickle,
            )
            model = files.read_metadata(out)["model"]
            print(f"wrote {out}\nmodel flags: {' '.join(model_flags(model))}")
        else:
            out, flags = export_megatron(
                a.load_dir,
                a.save_dir,
                a.target_tensor_parallel_size,
                a.target_pipeline_parallel_size,
            )
            print(f"wrote {out}\nMegatron-LM flags: {' '.join(flags)}")
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
