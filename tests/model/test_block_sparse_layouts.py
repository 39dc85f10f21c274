"""Block-sparse layouts: the deterministic patterns equal DeepSpeed's `make_layout` over a grid
of parameters (DeepSpeed 0.18.9, test-only), the random blocks are ours (seeded, the same in
any band of rows, per layer and head), and the flags are refused naming themselves."""

import itertools

import pytest
import torch

from megatron_ul.arguments import parse_args
from megatron_ul.config import resolve
from megatron_ul.config_rules import problems
from megatron_ul.model.attention.block_sparse_layouts import (
    RANDOM_ROWS,
    block_layout,
    computed_blocks,
    make_layout,
)
from megatron_ul.sparsity_config import SparsityPattern

HEADS = 4


def _deepspeed():
    return pytest.importorskip("deepspeed.ops.sparse_attention.sparsity_config")


def _same(ours: SparsityPattern, theirs, seq_length: int) -> None:
    expected = theirs.make_layout(seq_length).bool()
    got = make_layout(ours, HEADS, seq_length)
    assert got.shape == expected.shape
    assert torch.equal(got, expected), (ours, (got != expected).nonzero()[:5])


FIXED = [
    # (local, global, direction, horizontal, patterns, per head)
    (4, 1, "unidirectional", False, 1, False),
    (4, 2, "unidirectional", False, 2, True),
    (4, 1, "bidirectional", True, 4, True),
    (3, 3, "bidirectional", False, 1, False),
    (6, 2, "bidirectional", True, 3, True),
    (5, 1, "unidirectional", False, 5, True),
]


@pytest.mark.parametrize("local,glob,direction,horizontal,patterns,per_head", FIXED)
@pytest.mark.parametrize("blocks", [8, 11, 13])  # whole windows, and short last windows
def test_fixed_equals_deepspeed(local, glob, direction, horizontal, patterns, per_head, blocks):
    sc = _deepspeed()
    block = 16
    kwargs = dict(
        num_local_blocks=local,
        num_global_blocks=glob,
        attention=direction,
        horizontal_global_attention=horizontal,
        num_different_global_patterns=patterns,
    )
    theirs = sc.FixedSparsityConfig(HEADS, block, per_head, **kwargs)
    ours = SparsityPattern.create(
        "fixed", block=block, different_layout_per_head=per_head, **kwargs
    )
    _same(ours, theirs, blocks * block)


@pytest.mark.parametrize("direction", ["unidirectional", "bidirectional"])
@pytest.mark.parametrize("window,glob", [(3, 1), (5, 2), (1, 3), (8, 1)])
def test_bigbird_without_random_blocks_equals_deepspeed(direction, window, glob):
    sc = _deepspeed()
    kwargs = dict(num_random_blocks=0, num_sliding_window_blocks=window, num_global_blocks=glob)
    theirs = sc.BigBirdSparsityConfig(HEADS, 8, False, attention=direction, **kwargs)
    ours = SparsityPattern.create("bigbird", block=8, attention=direction, **kwargs)
    _same(ours, theirs, 10 * 8)


@pytest.mark.parametrize("direction", ["unidirectional", "bidirectional"])
@pytest.mark.parametrize(
    "window,starts,ends",
    [(3, [0], None), (5, [0, 4, 20], None), (3, [1, 6], [3, 9]), (1, [7], [50])],
)
def test_bslongformer_equals_deepspeed(direction, window, starts, ends):
    sc = _deepspeed()
    kwargs = dict(
        num_sliding_window_blocks=window, global_block_indices=starts, global_block_end_indices=ends
    )
    theirs = sc.BSLongformerSparsityConfig(HEADS, 8, True, attention=direction, **kwargs)
    ours = SparsityPattern.create(
        "bslongformer", block=8, different_layout_per_head=True, attention=direction, **kwargs
    )
    _same(ours, theirs, 12 * 8)


VARIABLE = [
    # (local windows, starts, ends, direction, horizontal)
    ([4], [0], None, "unidirectional", False),
    ([2, 3, 1], [0, 5], None, "unidirectional", False),
    ([3, 5], [1, 7], [3, 9], "unidirectional", False),
    ([2, 4], [0, 6], [2, 30], "bidirectional", True),
    ([20], [2], None, "bidirectional", False),
]


@pytest.mark.parametrize("windows,starts,ends,direction,horizontal", VARIABLE)
def test_variable_without_random_blocks_equals_deepspeed(
    windows, starts, ends, direction, horizontal
):
    sc = _deepspeed()
    kwargs = dict(
        num_random_blocks=0,
        local_window_blocks=windows,
        global_block_indices=starts,
        global_block_end_indices=ends,
        attention=direction,
        horizontal_global_attention=horizontal,
    )
    theirs = sc.VariableSparsityConfig(HEADS, 8, False, **kwargs)
    ours = SparsityPattern.create("variable", block=8, **kwargs)
    _same(ours, theirs, 13 * 8)


@pytest.mark.parametrize("mode", ["bigbird", "variable"])
@pytest.mark.parametrize("direction", ["unidirectional", "bidirectional"])
def test_random_blocks_are_seeded_per_layer_and_head_and_add_to_the_pattern(mode, direction):
    count, nb = 3, 2 * RANDOM_ROWS + 7
    pattern = SparsityPattern.create(
        mode, block=2, num_random_blocks=count, different_layout_per_head=True, attention=direction
    )
    without = make_layout(SparsityPattern.create(mode, block=2, num_random_blocks=0,
                                                 attention=direction), HEADS, 2 * nb)  # fmt: skip
    layout = make_layout(pattern, HEADS, 2 * nb, seed=7, layer=3)
    assert torch.equal(layout, make_layout(pattern, HEADS, 2 * nb, seed=7, layer=3))
    assert not torch.equal(layout, make_layout(pattern, HEADS, 2 * nb, seed=7, layer=4))
    assert not torch.equal(layout, make_layout(pattern, HEADS, 2 * nb, seed=8, layer=3))
    assert not torch.equal(layout[0], layout[1])  # per head
    assert (layout | without).equal(layout)  # the deterministic blocks are all there
    added = (layout & ~without).sum(-1)
    rows = torch.arange(nb)
    # at most `count` more per row (fewer where they fall on deterministic blocks); the
    # unidirectional draws never land in the future
    assert int(added.max()) <= count and int(added.sum()) > 0
    if direction == "unidirectional":
        assert not (layout & (rows.unsqueeze(0) > rows.unsqueeze(1))).any()
    # any band of rows, any subset of heads: the same blocks
    band = block_layout(pattern, HEADS, 2 * nb, seed=7, layer=3, heads=[2, 1], rows=(50, 130))
    assert torch.equal(band, layout[[2, 1], 50:130])


def test_random_rows_draw_distinct_blocks_in_range():
    pattern = SparsityPattern.create("bigbird", block=1, num_random_blocks=4,
                                     num_sliding_window_blocks=1, num_global_blocks=1,
                                     attention="bidirectional")  # fmt: skip
    layout = make_layout(pattern, 1, 300, seed=1)[0]
    base = make_layout(SparsityPattern.create("bigbird", block=1, num_random_blocks=0,
                                              num_sliding_window_blocks=1, num_global_blocks=1,
                                              attention="bidirectional"), 1, 300)[0]  # fmt: skip
    added = (layout & ~base).sum(-1)
    assert int(added.max()) <= 4 and float(added.float().mean()) > 3.8  # mostly off-pattern


def test_computed_blocks_count_what_causality_leaves():
    pattern = SparsityPattern.create("fixed", block=4, attention="bidirectional")
    layout = make_layout(pattern, HEADS, 4 * 24)
    lower = torch.ones(24, 24, dtype=torch.bool).tril()
    expected = int((layout & lower).sum())
    assert computed_blocks(pattern, HEADS, 4 * 24, layers=range(3), band=5) == 3 * expected
    random = SparsityPattern.create("bigbird", block=4, different_layout_per_head=True)
    by_layer = sum(
        int((make_layout(random, HEADS, 4 * 24, seed=2, layer=n) & lower).sum()) for n in range(3)
    )
    assert computed_blocks(random, HEADS, 4 * 24, seed=2, layers=range(3), band=7) == by_layer


def _problems(*flags):
    cfg = parse_args([*flags, "--mock-data", "--vocab-size", "100", "--attention-dropout", "0"])
    return [p for p in problems(resolve(cfg)) if "sparse" in p]


@pytest.mark.parametrize(
    "flags,expected",
    [
        (["--sparse-num-random-blocks", "2"], "--sparse-num-random-blocks given without"),
        (
            ["--sparse-attention", "bigbird", "--sparse-num-local-blocks", "2"],
            "--sparse-num-local-blocks does not apply to --sparse-attention bigbird",
        ),
        (
            ["--sparse-attention", "fixed", "--sparse-block-size", "48"],
            "--seq-length 128 is not a multiple of --sparse-block-size 48",
        ),
        (
            ["--sparse-attention", "bigbird", "--sparse-num-global-blocks", "9"],
            "--sparse-num-global-blocks 9 is more than the 8 blocks",
        ),
        (
            ["--sparse-attention", "fixed", "--sparse-num-global-blocks", "3"],
            "--sparse-num-local-blocks 4 is not divisible by --sparse-num-global-blocks 3",
        ),
        (
            ["--sparse-attention", "fixed", "--sparse-horizontal-global-attention"],
            "--sparse-horizontal-global-attention needs --sparse-attention-direction",
        ),
        (
            ["--sparse-attention", "fixed", "--sparse-num-different-global-patterns", "2"],
            "needs --sparse-different-layout-per-head",
        ),
        (
            ["--sparse-attention", "variable", "--sparse-global-block-end-indices", "1", "2"],
            "--sparse-global-block-end-indices has 2 entries",
        ),
        (
            [
                "--sparse-attention",
                "fixed",
                "--context-parallel-size",
                "4",
                "--sparse-block-size",
                "32",
                "--dry-run",
                "--world-size",
                "4",
            ],  # fmt: skip
            "--sparse-block-size 32 does not divide the ring's chunks of 16 tokens",
        ),
    ],
)
def test_bad_sparse_flags_are_refused_naming_them(flags, expected):
    found = _problems(*flags)
    assert any(expected in p for p in found), found


def test_sparse_attention_refuses_attention_dropout_and_takes_good_flags():
    cfg = parse_args(["--sparse-attention", "bigbird", "--mock-data", "--vocab-size", "100"])
    assert any(
        "--attention-dropout 0.1 with --sparse-attention" in p for p in problems(resolve(cfg))
    )
    for mode, extra in itertools.product(
        ["fixed", "bigbird", "bslongformer", "variable"], [[], ["--sparse-block-size", "8"]]
    ):
        assert _problems("--sparse-attention", mode, *extra) == []
