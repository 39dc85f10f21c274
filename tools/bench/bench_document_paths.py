#!/usr/bin/env python
"""Documents without flash-attn: the per-document loop against the document tiles (CPU).

Attention forward + backward over packed documents, fp32, 2 heads of 64, micro-batch 1, one
thread, thread CPU seconds (robust to other load on a shared machine): the per-document SDPA
loop (model/attention/documents.py, what the CPU runs) against the tiled path
(model/attention/document_tiles.py, what CUDA without flash-attn runs, on torch's efficient
kernel there and on its CPU flash kernel here).

    python -m tools.bench.bench_document_paths [--write-docs]
"""

import argparse
import time

import torch

from megatron_ul.model.attention import lse_kernels
from megatron_ul.model.attention.document_tiles import tiled_document_attention
from megatron_ul.model.attention.documents import BlockwiseAttention, DocumentMask, document_blocks
from tools.bench.common import markdown_table, report


def _seconds(fn, n, heads, head_dim) -> float:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 1, heads, head_dim, generator=g).requires_grad_() for _ in range(3))
    start = time.thread_time()
    fn(q, k, v).sum().backward()
    return time.thread_time() - start


def table(cases, heads, head_dim) -> str:
    rows = []
    for docs, n in cases:
        documents = DocumentMask(torch.arange(0, n + 1, n // docs, dtype=torch.int32), 1)
        blocks = document_blocks(documents.offsets, n, None)
        loop = _seconds(
            lambda q, k, v, b=blocks: BlockwiseAttention.apply(q, k, v, b, None, 0.0, None),
            n,
            heads,
            head_dim,
        )
        tiles = _seconds(
            lambda q, k, v, d=documents: tiled_document_attention(
                q, k, v, d, None, None, lse_kernels.CPU_FLASH
            ),
            n,
            heads,
            head_dim,
        )
        rows.append(
            [
                docs,
                n,
                n // docs,
                f"{loop:.2f}",
                f"{1e3 * loop / docs:.3f}",
                f"{tiles:.2f}",
                f"{loop / tiles:.1f}",
            ]
        )
    return markdown_table(
        [
            "documents",
            "N",
            "tokens per document",
            "loop s",
            "loop ms per document",
            "tiles s",
            "loop / tiles",
        ],
        rows,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    report(
        "document-paths",
        "Documents without flash-attn: per-document loop vs tiles (CPU)",
        "Attention forward + backward, fp32, 2 heads of 64, micro-batch 1, one thread, "
        "thread CPU seconds. Loop: SDPA once per document (document_attention.py, the "
        "CPU's path). Tiles: query tiles of 512 with a few fused calls each, whatever the "
        "number of documents (tiled_document_attention.py, the path of CUDA without "
        "flash-attn, here on torch's CPU flash kernel).",
        table([(64, 8192), (10240, 20480)], 2, 64),
        "The loop costs about 0.9 ms per document on this machine: 10K documents make a "
        "layer's attention take seconds. The tiles' cost follows the tokens, not the "
        "documents.",
        write_docs=args.write_docs,
    )


if __name__ == "__main__":
    main()
