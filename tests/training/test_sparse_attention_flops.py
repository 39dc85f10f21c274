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
