"""Legacy checkpoints against Megatron-LM's own code (tests/checkpoint/megatron_lm_reference.py).

Set MEGATRON_LM_DIR to a Megatron-LM checkout that still has the legacy model (the last
release with it is core_r0.17.0) and run with a Python that imports it (its megatron.core
needs triton and omegaconf installed; no GPU, no apex, no transformer_engine):
  - an export of ours, loaded by Megatron-LM with exactly the printed flags (its parse_args,
    validate_args, check_checkpoint_args and load_checkpoint), computes our logits;
  - a checkpoint Megatron-LM's save_checkpoint wrote (args with enums, numpy RNG state),
    saved with --rotary-base 500000 and NullTokenizer --vocab-size 199, imports without
    --trust-pickle and computes Megatron's logits over all its 200 tokens.
"""

import os
import subprocess
import sys

import pytest
import torch

from megatron_ul.checkpoint.interop.megatron_lm import export_megatron, import_megatron
from megatron_ul.checkpoint.layout import reshard
from megatron_ul.inference.generate import load_for_generation
from megatron_ul.training.pretrain import configure, setup
from tests.checkpoint.runs import NO_DROPOUT, TINY
from tests.checkpoint.test_megatron_lm import LLAMA

MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not MEGATRON_LM_DIR
        or not os.path.isdir(os.path.join(MEGATRON_LM_DIR or "", "megatron", "legacy", "model")),
        reason="MEGATRON_LM_DIR (a Megatron-LM checkout with megatron/legacy) not set",
    ),
]
# Megatron-LM's legacy attention views its query split as [sq, b, np, hn], which only works
# with one query group per TP rank (more groups raise in its forward, on any device).
LLAMA_ONE_GROUP = [x if x != "2" else "1" for x in LLAMA]
REFERENCE = os.path.join(os.path.dirname(__file__), "megatron_lm_reference.py")


def _megatron(command: str, positional: list, flags: list) -> None:
    env = dict(os.environ, PYTHONPATH=MEGATRON_LM_DIR, PYTHONWARNINGS="ignore")
    result = subprocess.run(
        [sys.executable, REFERENCE, command, *positional, "--", *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _tokens(tmp_path, vocab: int) -> tuple[torch.Tensor, str]:
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(3))
    path = str(tmp_path / "tokens.pt")
    torch.save(tokens, path)
    return tokens, path


def _our_logits(load_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    model = load_for_generation(load_dir)
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens)).transpose(0, 1)


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
def test_megatron_lm_loads_our_export_with_the_printed_flags(variant, tmp_path, single_rank):
    ours, meg = str(tmp_path / "ours"), str(tmp_path / "meg")
    argv = TINY + NO_DROPOUT + ["--train-iters", "1", "--lr-warmup-iters", "0", "--save", ours]
    setup(configure(argv + (LLAMA_ONE_GROUP if variant == "llama" else []), 1)).train()
    _, flags = export_megatron(ours, meg)
    tokens, tokens_file = _tokens(tmp_path, 200)
    _megatron("logits", [str(tmp_path / "theirs.pt"), tokens_file], flags + ["--load", meg])
    theirs = torch.load(tmp_path / "theirs.pt")
    assert theirs["padded_vocab_size"] == 208  # 200 rows padded to 16: exactly ours
    diff = float((_our_logits(ours, tokens)[..., :200] - theirs["logits"][..., :200]).abs().max())
    print(f"{variant}: ours vs Megatron-LM on our export: max |logit diff| {diff:.2e}")
    assert diff <= 1e-5


def test_megatron_lm_saved_checkpoint_imports_as_megatron_computes(tmp_path, single_rank):
    meg, ours = str(tmp_path / "meg"), str(tmp_path / "ours")
    flags = [
        "--use-legacy-models",
        "--ckpt-format",
        "torch",
        "--transformer-impl",
        "local",
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "8",
        "--group-query-attention",
        "--num-query-groups",
        "1",
        "--seq-length",
        "16",
        "--max-position-embeddings",
        "16",
        "--position-embedding-type",
        "rope",
        "--rotary-base",
        "500000",
        "--swiglu",
        "--normalization",
        "RMSNorm",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "199",
        "--make-vocab-size-divisible-by",
        "16",
    ]
    _megatron("save", [meg], flags)
    import_megatron(meg, ours)  # no trust_pickle: enums and numpy RNG state admitted
    meta = reshard.read_full(os.path.join(ours, "iter_0000003"), False).metadata["model"]
    assert meta["vocab_size"] == 200 and meta["rotary_base"] == 10000
    tokens, tokens_file = _tokens(tmp_path, 200)
    _megatron(
        "logits",
        [str(tmp_path / "theirs.pt"), tokens_file],
        flags + ["--load", meg, "--no-load-optim", "--no-load-rng"],
    )
    theirs = torch.load(tmp_path / "theirs.pt")["logits"]
    # softmax over 200 rows on both sides: the EOD row (id 199) is a real token
    diff = float((_our_logits(ours, tokens)[..., :200] - theirs[..., :200]).abs().max())
    print(f"Megatron-LM --rotary-base 500000 checkpoint imported: max |logit diff| {diff:.2e}")
    assert diff <= 1e-5
