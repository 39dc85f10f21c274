"""megatron-core checkpoints written by Megatron-LM's own save_checkpoint (of the release in
MEGATRON_LM_DIR, 0.16 or later; its own megatron/core is used, whatever is installed) import
without --trust-pickle with the logits that release's model computed
(tests/checkpoint/megatron_core_reference.py). Checked with core_v0.16.1 and core_v0.19.0,
both formats: the 0.19 args hold InferenceCudaGraphScope, its torch_dist keeps the common
state inside the DCP files, its NullTokenizer has --vocab-size rows (0.16: one more).
"""

import os
import subprocess
import sys

import pytest
import torch

from megatron_ul.checkpoint.interop.megatron_core import import_core
from tests.checkpoint.test_megatron_core import _model_of

MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not MEGATRON_LM_DIR
        or not os.path.isfile(os.path.join(MEGATRON_LM_DIR or "", "gpt_builders.py")),
        reason="MEGATRON_LM_DIR (a Megatron-LM checkout of 0.16 or later) not set",
    ),
]
REFERENCE = os.path.join(os.path.dirname(__file__), "megatron_core_reference.py")


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_megatron_lm_saved_checkpoint_imports_with_its_logits(fmt, tmp_path, single_rank):
    from megatron_ul.inference.generate import load_for_generation

    theirs, ours = str(tmp_path / "theirs"), str(tmp_path / "ours")
    env = dict(os.environ, PYTHONPATH=MEGATRON_LM_DIR, PYTHONWARNINGS="ignore")
    result = subprocess.run(
        [sys.executable, REFERENCE, MEGATRON_LM_DIR, theirs, fmt],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    registered = torch.serialization.get_safe_globals()  # megatron-core's, when imported
    torch.serialization.clear_safe_globals()
    try:
        import_core(theirs, ours)
    finally:
        torch.serialization.add_safe_globals(registered)
    m, ref = _model_of(ours), torch.load(os.path.join(theirs, "reference_logits.pt"))
    assert m["vocab_size"] == ref["vocab"]  # 0.16/0.17: 201 (EOD added), 0.18+: 200
    assert m["window_size"] == [4, 0]
    model = load_for_generation(ours)
    vocab = ref["vocab"]
    with torch.no_grad():
        logits = model(ref["tokens"], torch.arange(16).expand(2, 16))[..., :vocab]
    diff = float((logits.transpose(0, 1) - ref["logits"][..., :vocab]).abs().max())
    print(f"{fmt}: max |logit diff| ours vs Megatron-LM's saved model: {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_export_loads_in_megatron_lm_with_the_printed_flags(fmt, tmp_path, single_rank, capsys):
    """Our export (a window, GQA, RoPE, SwiGLU model; torch_dist written by the installed
    megatron-core) loads into the checkout's Megatron-LM with exactly the printed flags (the
    NullTokenizer size as the printed note says for 0.18+) and computes our logits."""
    from megatron_ul.training.pretrain import configure, setup
    from tests.checkpoint.runs import NO_DROPOUT, TINY
    from tests.checkpoint.test_megatron_core import LLAMA, _our_logits
    from tools.checkpoint import megatron_core as tool

    src, out = str(tmp_path / "src"), str(tmp_path / "core")
    argv = TINY + NO_DROPOUT + LLAMA + ["--window-size", "4", "0", "--train-iters", "1"]
    setup(configure(argv + ["--lr-warmup-iters", "0", "--save", src], 1)).train()
    capsys.readouterr()
    export = ["export", "--load-dir", src, "--save-dir", out, "--ckpt-format", fmt]
    assert tool.main(export + ["--transformer-impl", "local"]) == 0
    printed = capsys.readouterr().out
    flags = printed.split("Megatron-LM flags: ")[1].split()
    null = ["megatron", "core", "tokenizers", "text", "libraries", "null_tokenizer.py"]
    with open(os.path.join(MEGATRON_LM_DIR, *null)) as f:
        counts_eod = "_vocab_size_without_eod + 1" in f.read()  # up to 0.17: V ids + EOD
    if not counts_eod:  # 0.18+: the note's --vocab-size
        i = flags.index("--vocab-size") + 1
        flags[i] = str(int(flags[i]) + 1)
    logits = str(tmp_path / "logits.pt")
    result = subprocess.run(
        [sys.executable, REFERENCE, MEGATRON_LM_DIR, out, logits, "--", *flags],
        env=dict(os.environ, PYTHONPATH=MEGATRON_LM_DIR, PYTHONWARNINGS="ignore"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    theirs = torch.load(logits)["logits"][..., :200]
    diff = float((_our_logits(src) - theirs).abs().max())
    print(f"{fmt}: max |logit diff| Megatron-LM loading our export vs ours: {diff:.2e}")
    assert diff <= 1e-5
