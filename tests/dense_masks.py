"""Megatron's dense [b, 1, N, N] attention masks: O(N²) references for tests at small N. The
package never builds one (documents travel as offsets, model/attention/documents.py)."""

import torch

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
