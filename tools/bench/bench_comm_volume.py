#!/usr/bin/env python
"""Communication volume of one transformer layer, forward and backward: Ulysses (SP = P)
against Megatron-SP (TP = P with --sequence-parallel), for P = 2, 4, 8 at fixed N and h.

Counts the bytes every collective sends per rank (mpu/comm_stats.py: the bytes a rank puts on
the wire under the usual ring / pairwise algorithms) and prints them next to the formulas:
  Ulysses forward: all-to-all of q, k, v (3Nh/P per rank) and of the output (Nh/P): the
    paper's 4Nh/P message per rank, of which (P-1)/P leaves the rank;
  Megatron-SP forward: two all-gathers and two reduce-scatters of [N, h]: the paper's 4Nh,
    of which (P-1)/P leaves each rank.
Backward mirrors forward (inverse all-to-all; all-gather <-> reduce-scatter); Megatron-SP's
column-parallel linears also re-gather their saved input shard (as Megatron-LM does), so its
backward is 1.5x its forward. The forward ratio Megatron-SP / Ulysses should be P.

    python -m tools.bench.bench_comm_volume [--seq-length 4096 --hidden-size 512] [--write-docs]
"""

import argparse

import torch

from megatron_ul.config import ModelConfig
from megatron_ul.model.layer_spec import layer_spec
from megatron_ul.model.transformer import TransformerLayer
from megatron_ul.mpu import comm_stats
from megatron_ul.mpu import parallel_state as ps
from megatron_ul.mpu.random import model_parallel_seed
from tools.bench.common import markdown_table, report, run_ranks


def one_layer(rank, world, seq, hidden, heads, layout):
    """Bytes this rank sends in one layer's forward and in its backward."""
    tp, sp = (1, world) if layout == "ulysses" else (world, 1)
    megatron_sp = layout == "megatron-sp"
    return layer_bytes(
        ps.initialize_model_parallel(tp, sp, 1), world, seq, hidden, heads, megatron_sp
    )


def layer_bytes(dims, world, seq, hidden, heads, megatron_sp=False):
    """Bytes this rank sends in the forward and in the backward of one transformer layer built
    on `dims` (fed this rank's seq/world tokens): per collective, {op: bytes}."""
    model_parallel_seed(1, dims, "cpu")
    cfg = ModelConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=heads,
        seq_length=seq,
        vocab_size=128,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    layer = TransformerLayer(
        cfg, 1, seed=1, sequence_parallel=megatron_sp, dims=dims, spec=layer_spec(cfg)
    )
    x = torch.randn(seq // world, 1, hidden, requires_grad=True)  # this rank's tokens
    with comm_stats.count_communication() as forward:
        y = layer(x)
    with comm_stats.count_communication() as backward:
        y.sum().backward()
    return (
        {op: v["bytes"] for op, v in forward.items()},
        {op: v["bytes"] for op, v in backward.items()},
    )


def formula_bytes(layout: str, seq: int, hidden: int, p: int, elem: int = 4) -> float:
    """Bytes one rank sends in the forward of one layer, by the paper's formulas."""
    message = 4 * seq * hidden * elem / (p if layout == "ulysses" else 1)
    return message * (p - 1) / p


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq-length", type=int, default=4096)
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args(argv)
    n, h, mib = args.seq_length, args.hidden_size, 2**20
    rows = []
    for p in args.sizes:
        measured = {}
        for layout in ("ulysses", "megatron-sp"):
            fwd, bwd = run_ranks(one_layer, p, n, h, args.heads, layout)[0]
            measured[layout] = (sum(fwd.values()), sum(bwd.values()), sorted(fwd))
        (uf, ub, uops), (mf, mb, mops) = measured["ulysses"], measured["megatron-sp"]
        rows.append(
            [
                p,
                f"{uf / mib:.2f}",
                f"{formula_bytes('ulysses', n, h, p) / mib:.2f}",
                f"{ub / mib:.2f}",
                f"{mf / mib:.2f}",
                f"{formula_bytes('megatron', n, h, p) / mib:.2f}",
                f"{mb / mib:.2f}",
                f"{(mf + mb) / (uf + ub):.2f}",
                "+".join(uops),
                "+".join(mops),
            ]
        )
    table = markdown_table(
        [
            "P",
            "Ulysses fwd MiB",
            "formula 4Nh/P·(P-1)/P",
            "Ulysses bwd MiB",
            "Megatron-SP fwd MiB",
            "formula 4Nh·(P-1)/P",
            "Megatron-SP bwd MiB",
            "ratio (fwd+bwd)",
            "Ulysses ops",
            "Megatron-SP ops",
        ],
        rows,
    )
    report(
        "comm-volume",
        "Communication volume per layer (Ulysses vs Megatron-SP)",
        f"Bytes sent per rank by every collective in one transformer layer (fp32, N = {n}, "
        f"h = {h}, {args.heads} heads, micro-batch 1), counted by `mpu/comm_stats.py`.",
        table,
        write_docs=args.write_docs,
    )


if __name__ == "__main__":
    main()
