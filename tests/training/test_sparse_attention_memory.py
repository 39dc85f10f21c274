"""The estimator's block-sparse terms against what the engine keeps: the tensors autograd saves
(q, k, v, its output and log-sum-exp), measured by storage, and its fp32 gradient accumulators."""

import torch

from megatron_ul.config import ModelConfig
from megatron_ul.model.attention.layer import LayerAttention, model_call
from megatron_ul.training.memory_estimator import Layout, Precision, layer_terms


def test_saved_bytes_match_the_estimators_attention_terms():
    m = ModelConfig(
        hidden_size=64, num_attention_heads=4, seq_length=256, sparse_attention="bigbird",
        sparse_block_size=16, attention_dropout=0.0,
    )  # fmt: skip
    n, heads, d = m.seq_length, m.num_attention_heads, m.head_dim
    q, k, v = (torch.randn(n, 1, heads, d, requires_grad=True) for _ in range(3))
    call = model_call(m, torch.device("cpu"), torch.float32, tp=1, sp=1, cp=1, documents=False)
    attention = LayerAttention(call)  # the table's block-sparse row
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attention(q, k, v, dropout_p=0.0)
    terms = layer_terms(m, Layout(), Precision())
    wanted = terms["q, k, v"] + terms["attention output"] + terms["block-sparse log-sum-exp"]
    assert sum(saved.values()) == wanted  # q, k, v stored apart here: one [n, b, 3h, d] there
    # no scores term: nothing of size N² is kept
    assert "attention scores (unfused kernel)" not in terms
