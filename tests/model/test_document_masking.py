"""--reset-attention-mask in O(N) and --window-size through the whole model: equal to the dense
[b, 1, N, N] mask path (fp32, 1e-6) on one process and under Ulysses/TP; training with document
masking on TP2×SP2 and SP2×PP2 reproduces the single-process loss curve."""

import functools

import pytest
import torch

from megatron_ul.model.attention.documents import DocumentMask
from tests.dense_masks import dense_document_mask
from tests.distributed import run_distributed
from tests.model.long_context_harness import LLAMA, MODEL, compare_runs, slow_except
from tests.training.equivalence import BASE, compare, run_layout

OFFSETS = [0, 5, 6, 20, 32, 40, 64]  # two samples of 32 tokens; a 1-token document


def documents(cfg):
    return DocumentMask(torch.tensor(OFFSETS, dtype=torch.int32), 2)


def dense(cfg, window=None):
    """The O(N²) reference: Megatron's document mask, and keys more than `window` back."""
    masked = dense_document_mask(documents(cfg))
    if window is not None:
        i = torch.arange(cfg.model.seq_length)
        masked = masked | ((i.unsqueeze(1) - i.unsqueeze(0)) > window)
    return masked


LAYOUTS = {
    "single": ([], (1, 1), 1),
    "SP2": (["--ds-sequence-parallel-size", "2"], (1, 2), 2),
    "TP2-SP2": (
        ["--tensor-model-parallel-size", "2", "--ds-sequence-parallel-size", "2"],
        (2, 2),
        4,
    ),
}


def _cases(rank, world, layout):
    flags, sizes, _ = LAYOUTS[layout]
    out = {}
    for name, extra in {"gpt": [], "llama-gqa-rope": LLAMA}.items():
        out[name] = compare_runs(
            rank,
            world,
            MODEL + flags + extra,
            [],
            sizes,
            attention_mask_fn=dense,
            option_mask_fn=documents,
        )
    # the window: written into the dense reference mask, a flag on the O(N) path
    out["window"] = compare_runs(
        rank,
        world,
        MODEL + flags + LLAMA,
        ["--window-size", "4", "0"],
        sizes,
        attention_mask_fn=functools.partial(dense, window=4),
        option_mask_fn=documents,
    )
    return out


@pytest.mark.parametrize("layout", slow_except({"single"}, LAYOUTS))
def test_documents_equal_dense_mask(layout):
    for rank_result in run_distributed(_cases, LAYOUTS[layout][2], layout):
        for name, (loss_diff, grad_diff) in rank_result.items():
            assert loss_diff <= 1e-6 and grad_diff <= 1e-6, (layout, name, loss_diff, grad_diff)


# Training: NullTokenizer's EOD is vocab-1, so a 16-token vocabulary puts ~2 EODs in a sample.
DOCS = (
    BASE
    + LLAMA
    + [
        "--num-attention-heads",
        "8",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "16",
        "--make-vocab-size-divisible-by",
        "8",
        "--reset-attention-mask",
        "--reset-position-ids",
    ]
)
TRAIN_LAYOUTS = {
    "TP2-SP2": (["--tensor-model-parallel-size", "2", "--ds-sequence-parallel-size", "2"], 4),
    "SP2-PP2": (["--ds-sequence-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 4),
    "SP2-window": (["--ds-sequence-parallel-size", "2", "--window-size", "6", "0"], 2),
}


@functools.cache
def single_process(window: bool):
    return run_layout(DOCS + (["--window-size", "6", "0"] if window else []), 1)


@pytest.mark.parametrize("layout", slow_except(set(), TRAIN_LAYOUTS))
def test_document_masking_training_matches_single_process(layout):
    flags, world = TRAIN_LAYOUTS[layout]
    ref = single_process("window" in layout)
    loss_diff, param_diff = compare(ref, run_layout(DOCS + flags, world), 8, 2)
    print(f"{layout}: loss diff {loss_diff:.2e}, param diff {param_diff:.2e}")
    assert loss_diff < 1e-5 and param_diff < 1e-5


def _flash_cases(rank, world):
    import flash_attn  # the stand-in (fixture): counts its calls in this rank

    diffs = compare_runs(
        rank,
        world,
        MODEL + LLAMA + ["--ds-sequence-parallel-size", "2", "--window-size", "6", "0"],
        ["--use-flash-attn"],
        (1, 2),
        autocast_dtype=torch.bfloat16,
        attention_mask_fn=documents,
    )
    return diffs, flash_attn.calls["flash_attn_varlen_func"]


def test_flash_varlen_path_under_ulysses(flash_attn_stand_in):
    """SP2, bf16, documents + window: flash_attn_varlen_func (strict stand-in) after the
    all-to-all gives the memory-linear SDPA path's losses and gradients (bf16 rounding)."""
    for (loss_diff, grad_diff), calls in run_distributed(_flash_cases, 2):
        assert calls == 2  # one varlen call per layer (the backward differentiates it)
        assert loss_diff < 2e-2 and grad_diff < 5e-2, (loss_diff, grad_diff)
