#!/usr/bin/env python
"""Generate text from a megatron_ul checkpoint of any layout (merged to TP1/PP1 on load).

    python -m tools.generate --load CKPT --prompt "def " --max-new-tokens 50 --top-k 5 \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt

Greedy unless --top-k or --top-p is given. Without --tokenizer-type the tokenizer recorded in
the checkpoint's arguments is used; NullTokenizer prompts are whitespace-separated ids.
"""

import argparse
import os
import sys

import torch

try:
    import megatron_ul  # noqa: F401
except ModuleNotFoundError:  # `python tools/NAME.py` from a checkout without the install
    sys.exit("megatron_ul is not installed: run `bash scripts/install.sh` (or pip install -e .)")

from megatron_ul.checkpoint import files
from megatron_ul.checkpoint.files import CheckpointError
from megatron_ul.data.tokenizers import TOKENIZER_TYPES, build_tokenizer
from megatron_ul.inference.generate import generate, load_for_generation


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--load", required=True)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=50)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None)
    p.add_argument("--vocab-file", default=None)
    p.add_argument("--merge-file", default=None)
    p.add_argument("--tokenizer-model", default=None)
    return p.parse_args(argv)


def _saved_data_args(load_dir: str) -> dict:
    """The data flags (tokenizer) recorded with the latest checkpoint, if any."""
    iteration = files.read_tracker(load_dir)
    if iteration is None:  # load_for_generation refused it already; nothing recorded
        return {}
    iter_dir = files.find_iteration_dir(load_dir, iteration)
    meta = files.read_metadata(iter_dir)
    # torch_dist keeps the arguments in its common file, the torch format in every shard.
    path = (
        os.path.join(iter_dir, files.COMMON_FILE)
        if meta.get("storage") == "torch_dist"
        else files.model_file(iter_dir, 0, 0, meta["layout"]["pp"])
    )
    payload = files.load_torch(path, "saved arguments", files.expected_record(meta, iter_dir, path))
    return payload.get("args", {}).get("data", {})


def _tokenizer(a, model):
    saved = _saved_data_args(a.load) if a.tokenizer_type is None else {}
    kind = a.tokenizer_type or saved.get("tokenizer_type") or "NullTokenizer"
    return build_tokenizer(
        kind,
        vocab_file=a.vocab_file or saved.get("vocab_file"),
        merge_file=a.merge_file or saved.get("merge_file"),
        tokenizer_model=a.tokenizer_model or saved.get("tokenizer_model"),
        # NullTokenizer --vocab-size N trains a vocabulary of N + 1 (EOD = N).
        vocab_size=model.cfg.vocab_size - (kind == "NullTokenizer"),
    )


def main(argv=None) -> int:
    a = parse(argv)
    from megatron_ul.config import Config
    from megatron_ul.initialize import initialize_distributed

    try:
        initialize_distributed(Config())  # one process: TP1 / PP1 parallel state
        model = load_for_generation(a.load)
        tokenizer = _tokenizer(a, model)
        prompt = tokenizer.tokenize(a.prompt)
        new = generate(
            model,
            prompt,
            a.max_new_tokens,
            top_k=a.top_k,
            top_p=a.top_p,
            temperature=a.temperature,
            eod=tokenizer.eod,
            generator=torch.Generator().manual_seed(a.seed),
        )
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(tokenizer.detokenize(prompt + new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
