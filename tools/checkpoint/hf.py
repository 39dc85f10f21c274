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

from megatron_ul.checkpoint.files import CheckpointError
from megatron_ul.checkpoint.interop.hf import export_checkpoint, import_checkpoint, model_flags  # noqa


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
    exp.add_argument(
        "--model-type",
        choices=["gpt2", "llama"],
        default=None,
        help="default: llama for SwiGLU models (Mistral when the model has a --window-size), "
        "else gpt2",
    )
    exp.add_argument(
        "--bos-token-id",
        type=int,
        default=None,
        help="default: as recorded in the checkpoint (its tokenizer or import)",
    )
    exp.add_argument("--eos-token-id", type=int, default=None)
    a = p.parse_args(argv)
    try:
        if a.command == "import":
            out, fields = import_checkpoint(
                a.hf_dir, a.save_dir, a.target_tensor_parallel_size, a.target_pipeline_parallel_size
            )
            print(f"wrote {out}\nmodel flags: {' '.join(model_flags(fields))}")
        else:
            if not os.path.isdir(a.load_dir):
                raise CheckpointError(f"--load-dir {a.load_dir}: no such directory")
            ids = {"bos_token_id": a.bos_token_id, "eos_token_id": a.eos_token_id}
            print(f"wrote {export_checkpoint(a.load_dir, a.hf_dir, a.model_type, ids)}")
    except (CheckpointError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
