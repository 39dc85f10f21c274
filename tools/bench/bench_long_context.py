"""Peak memory per rank against sequence length, with each long-context feature off and on,
next to the memory estimator's figure.

    flock /tmp/heavy.lock python -m tools.bench.bench_long_context [--write-docs]

Model: 1 layer, hidden 64, 4 heads, vocabulary 32000, fp32, full recompute, dropout
off, micro-batch 1. Each cell is one training iteration in freshly spawned gloo ranks; "peak RSS"
is the largest ru_maxrss over the ranks; "above start" subtracts each rank's RSS after
`import torch` and process-group start (the interpreter, torch and gloo), which is what the
estimator (training/memory_estimator.py, with the CPU's fp32 dropout-mask size) predicts.
"""

from __future__ import annotations

import argparse
import resource

from tools.bench.common import markdown_table, report, run_ranks

GIB = 2**30
MODEL = [
    "--num-layers",
    "1",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--vocab-size",
    "32000",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "1",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--train-iters",
    "1",
    "--log-interval",
    "100",
    "--mock-data",
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--distributed-timeout-minutes",
    "30",
    "--position-embedding-type",
    "rope",
]
FEATURES = {  # name -> flags
    "full recompute only": [],
    "+ tiled loss": ["--tiled-loss-chunk-size", "1024"],
    "+ tiled loss + tiled MLP": [
        "--tiled-loss-chunk-size",
        "1024",
        "--tiled-mlp-chunk-size",
        "8192",
    ],
    "+ tiled loss + MLP + documents": [
        "--tiled-loss-chunk-size",
        "1024",
        "--tiled-mlp-chunk-size",
        "8192",
        "--tokenizer-type",
        "NullTokenizer",
        "--reset-attention-mask",
        "--reset-position-ids",
    ],
    "+ tiled + documents + window 4096": [
        "--tiled-loss-chunk-size",
        "1024",
        "--tiled-mlp-chunk-size",
        "8192",
        "--tokenizer-type",
        "NullTokenizer",
        "--reset-attention-mask",
        "--window-size",
        "4096",
        "0",
    ],
}


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def one_iteration(rank, world, argv):
    import torch.distributed as dist

    from megatron_ul.training import memory_estimator as me
    from megatron_ul.training.pretrain import configure, setup

    cfg = configure(argv, world)
    start = _rss_bytes()
    trainer = setup(cfg)
    trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    est = me.estimate(
        cfg.model,
        me.layout_from_config(cfg),
        recompute="full",
        precision=me.Precision(dropout_mask_bytes=4),
    )
    dist.barrier()
    return {"peak": peak, "start": start, "estimate": est.total_bytes}


def measure(seq: int, sp: int, flags: list[str]) -> dict:
    argv = MODEL + flags + ["--seq-length", str(seq), "--ds-sequence-parallel-size", str(sp)]
    per_rank = run_ranks(one_iteration, sp, argv)
    worst = max(per_rank, key=lambda r: r["peak"])
    above = max(r["peak"] - r["start"] for r in per_rank)
    return {"peak": worst["peak"], "above": above, "estimate": per_rank[0]["estimate"]}


# ---- the estimator's plans for 1M-4M tokens (no measurement) ------------------------------
PLAN_COMMON = [
    "--mock-data",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "1",
    "--position-embedding-type",
    "rope",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--bf16",
    "--use-flash-attn",
    "--zero-stage",
    "3",
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
]
PLAN_FEATURES = {
    "full recompute only": [],
    "+ tiled loss 8K, tiled MLP 16K, offload": [
        "--tiled-loss-chunk-size",
        "8192",
        "--tiled-mlp-chunk-size",
        "16384",
        "--activation-checkpoint-cpu-offload",
    ],
}


def estimate_tables() -> str:
    """Fewest 80 GiB / 141 GiB GPUs for a 1.2B GPT and Llama-3-8B at 1M-4M tokens, without and
    with the long-context features, planned from their flags as --dry-run plans them."""
    from megatron_ul.training import memory_estimator as me
    from megatron_ul.training.configure import configure
    from tools.bench.memory_targets import TARGET_GPT, TARGET_LLAMA

    models = {
        "GPT 1.2B (24 × 2048, 32 heads, vocab 50257)": TARGET_GPT,
        "Llama-3-8B (32 × 4096, 32 q / 8 kv heads, ffn 14336, vocab 128256)": TARGET_LLAMA,
    }

    def fit(cfg, gpu_gb):
        found = me.smallest_fitting_layout(cfg, gpu_gb)
        if found is None:
            return "does not fit (SP ≤ heads)"
        planned, est = found
        layout = me.layout_from_config(planned)
        return (
            f"{layout.world} (SP {layout.sp} × DP {layout.dp}): {est.total_bytes / GIB:.0f} "
            f"GiB/GPU, host {est.host_bytes / GIB:.0f} GiB/GPU"
        )

    rows = []
    for model_name, model in models.items():
        for n in (2**20, 2**21, 2**22):
            for feature_name, extra in PLAN_FEATURES.items():
                length = ["--seq-length", str(n), "--max-position-embeddings", str(n)]
                cfg = configure(PLAN_COMMON + model + length + extra, 1)
                one = me.estimate_config(cfg)
                rows.append(
                    [
                        model_name,
                        f"{n // 2**20}M",
                        feature_name,
                        f"{one.total_bytes / GIB:.0f}",
                        fit(cfg, 80),
                        fit(cfg, 141),
                    ]
                )
    return markdown_table(
        ["model", "N", "features", "1 GPU GiB", "fewest 80 GiB GPUs", "fewest 141 GiB GPUs"], rows
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--quick", action="store_true", help="small lengths only (a smoke run)")
    parser.add_argument(
        "--estimates",
        action="store_true",
        help="print only the estimator's 1M-4M token tables (no measurement)",
    )
    args = parser.parse_args()
    if args.estimates:
        print(estimate_tables())
        return
    if args.quick:
        plan = [(name, sp, seq) for name in FEATURES for sp, seq in ((1, 2048), (2, 4096))]
    else:
        names = list(FEATURES)
        plan = (
            [(names[0], 1, n) for n in (4096, 8192, 16384)]
            + [(names[1], 1, 65536), (names[2], 1, 16384)]
            + [(name, 1, 65536) for name in names[2:]]
            + [(name, 2, 131072) for name in names[2:]]
        )
    rows = []
    for name, sp, seq in plan:
        got = measure(seq, sp, FEATURES[name])
        error = got["estimate"] / got["above"] - 1
        rows.append(
            [
                name,
                sp,
                seq,
                seq // sp,
                f"{got['peak'] / GIB:.2f}",
                f"{got['above'] / GIB:.2f}",
                f"{got['estimate'] / GIB:.2f}",
                f"{error:+.0%}",
            ]
        )
        print(rows[-1], flush=True)
    table = markdown_table(
        [
            "features (all with full recompute)",
            "SP",
            "N",
            "tokens per rank",
            "peak RSS per rank GiB",
            "above start GiB",
            "estimate GiB",
            "estimate vs measured",
        ],
        rows,
    )
    report(
        "long-context",
        "Long sequences: peak memory per rank against N",
        __doc__.split("\n\n", 2)[2].strip(),
        table,
        write_docs=args.write_docs,
    )


if __name__ == "__main__":
    main()
