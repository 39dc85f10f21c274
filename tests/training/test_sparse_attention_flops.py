"""MFU counts only the blocks block-sparse attention runs: a Fixed layout counted by hand."""

from megatron_ul.config import ModelConfig
from megatron_ul.training.metrics import flops_per_token


def test_fixed_pattern_flops_count_the_computed_blocks():
    # 16 blocks of 8 tokens; unidirectional Fixed, windows of 4, the last block of each
    # window global: 4 windows × 10 lower-triangle blocks, plus global column 4k+3 seen by
    # the 12, 8, 4, 0 rows of the later windows = 64 blocks per head.
    dense = ModelConfig(num_layers=3, hidden_size=64, num_attention_heads=4, seq_length=128)
    sparse = ModelConfig(**{**vars(dense), "sparse_attention": "fixed", "sparse_block_size": 8})
    heads, d, n, b = 4, 16, 128, 8
    per_layer_dense = 2 * 2 * n * heads * d
    per_layer_sparse = 2 * 2 * d * 64 * heads * b * b / n
    difference = flops_per_token(dense, 128) - flops_per_token(sparse, 128)
    assert difference == 3.0 * 3 * (per_layer_dense - per_layer_sparse)


def test_dry_run_reports_the_pattern_and_its_share_of_blocks():
    from megatron_ul.arguments import parse_args
    from megatron_ul.config import resolve
    from megatron_ul.training.dry_run import sparse_attention_plan

    cfg = resolve(
        parse_args(
            ["--mock-data", "--vocab-size", "100", "--attention-dropout", "0",
             "--seq-length", "128", "--sparse-attention", "fixed", "--sparse-block-size", "8"]
        )
    )  # fmt: skip
    # 64 of the 16·17/2 = 136 causal blocks (the count above)
    assert "block-sparse fixed attention, block 8: 47.1% of the causal blocks" in (
        sparse_attention_plan(cfg)
    )
    from megatron_ul.training.dry_run import describe

    # the backend table's block-sparse row, as the run selects it
    assert "attention kernel on a GPU: block-sparse fixed: sdpa-efficient" in describe(cfg)
