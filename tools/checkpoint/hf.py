#!/usr/bin/env python
"""Import Hugging Face GPT-2 / Llama models into megatron_ul checkpoints, and export back.

    python -m tools.checkpoint.hf import --hf-dir gpt2-small --save-dir ckpt \
        [--target-tensor-parallel-size 2]
    python -m tools.checkpoint.hf export --load-dir ckpt --hf-dir out [--model-type llama]

Import writes iteration 0 (weights only) and prints the model flags to train or generate with
(fine-tune with --finetune). Export reads any layout and writes config.json + model.safetensors
that transformers' from_pretrained loads. Needs the safetensors package (pip install
safetensors); transformers itself is only needed to use the exported model.
"""

import argparse
import os
import sys

try:
    import megatron_ul  # noqa: F401
except ModuleNotFoundError:  # `python tools/NAME.py` from a checkout without the install
    sys.exit("megatron_ul is not installed: run `bash scripts/install.sh` (or pip install -e .)")

from megatron_ul.checkpoint.interop.cli import add_hf_write_flags, options, run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face directory -> megatron_ul checkpoint")
    imp.add_argument("--hf-dir", required=True)
    imp.add_argument("--save-dir", required=True)
    imp.add_argument("--target-tensor-parallel-size", type=int, default=1)
    imp.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    exp = sub.add_parser("export", help="megatron_ul checkpoint -> Hugging Face directory")
    exp.add_argument("--load-dir", required=True)
    exp.add_argument("--hf-dir", required=True)
    add_hf_write_flags(exp)
    a = p.parse_args(argv)
    if a.command == "import":
        if not os.path.isdir(a.hf_dir):
            print(f"error: --hf-dir {a.hf_dir}: no such directory", file=sys.stderr)
            return 2
        return run("hf", "megatron_ul", a.hf_dir, a.save_dir, options(a))
    return run("megatron_ul", "hf", a.load_dir, a.hf_dir, options(a))


if __name__ == "__main__":
    sys.exit(main())
