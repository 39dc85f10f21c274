"""Megatron's dense [b, 1, N, N] attention masks: O(N²) references for tests at small N. The
package never builds one (documents travel as offsets, model/attention/documents.py)."""

import torch
import torch.nn.functional as F

from megatron_ul.model.attention.documents import DocumentMask


def dense_document_mask(documents: DocumentMask) -> torch.Tensor:
    """Megatron's dense [b, 1, N, N] bool mask (True = masked) for the same documents: the
    O(N²) reference that tests compare against at small N. Never used for training."""
    b, n = documents.batch_size, documents.seq_length
    doc_id = torch.zeros(b * n, dtype=torch.long)
    doc_id[torch.tensor(documents.offsets[1:-1], dtype=torch.long)] = 1
    doc_id = doc_id.cumsum(0).view(b, n)
    same = doc_id.unsqueeze(2) == doc_id.unsqueeze(1)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return (~(same & causal)).unsqueeze(1)


class DenseMaskAttention:
    """A layer's attention on whole heads with Megatron's dense mask (True = masked), handed
    over where the model takes its documents: the O(N²) reference path, swapped into a test
    model's layers (`use_dense_masks`) in place of the package's LayerAttention."""

    def __call__(self, q, k, v, *, dropout_p: float, documents=None) -> torch.Tensor:
        assert isinstance(documents, torch.Tensor), "a dense mask, [b, 1, N, N] bool"
        q_, k_, v_ = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [N, b, h, d] -> [b, h, N, d]
        out = F.scaled_dot_product_attention(
            q_,
            k_,
            v_,
            attn_mask=~documents,
            dropout_p=dropout_p,
            enable_gqa=q.shape[2] != k.shape[2],
        )
        return out.permute(2, 0, 1, 3)


def use_dense_masks(model) -> None:
    """Every transformer layer of `model` attends with DenseMaskAttention (the mask travels
    where the documents do)."""
    for module in model.modules():
        core = getattr(module, "core", None)
        if core is not None and hasattr(core, "attention"):
            core.attention = DenseMaskAttention()
