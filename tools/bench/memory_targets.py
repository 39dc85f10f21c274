"""The long-context memory targets carried to GPUs by the estimator
(training/memory_estimator.py): a 1.2B GPT at 1M tokens on one 141 GiB GPU, Llama-3-8B at 500K
on one 80 GiB GPU (with and without optimizer offload), at 4M on 8 and at 16M on 32, each
estimated from its flags as `--dry-run` estimates them. No measurement here;
the estimator's own validation against the live-tensor tracker is
tests/training/test_memory_estimator_measured.py. Printed by
`python -m tools.bench.bench_memory --targets`."""

from __future__ import annotations

TARGET_GPT = [
    "--num-layers",
    "24",
    "--hidden-size",
    "2048",
    "--num-attention-heads",
    "32",
    "--vocab-size",
    "50257",
]
TARGET_LLAMA = [
    "--num-layers",
    "32",
    "--hidden-size",
    "4096",
    "--num-attention-heads",
    "32",
    "--group-query-attention",
    "--num-query-groups",
    "8",
    "--ffn-hidden-size",
    "14336",
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--vocab-size",
    "128256",
]
TARGET_COMMON = [
    "--mock-data",
    "--micro-batch-size",
    "1",
    "--position-embedding-type",
    "rope",
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--bf16",
    "--use-flash-attn",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--tiled-loss-chunk-size",
    "8192",
    "--tiled-mlp-chunk-size",
    "16384",
    "--activation-checkpoint-cpu-offload",
]
TARGETS = [  # (name, model, N, SP, GPU GiB, ZeRO stage, optimizer offload)
    ("GPT 1.2B", TARGET_GPT, 1 << 20, 1, 141, 0, False),
    ("Llama-3-8B", TARGET_LLAMA, 500 * 1024, 1, 80, 0, True),
    ("Llama-3-8B", TARGET_LLAMA, 500 * 1024, 1, 80, 0, False),
    ("Llama-3-8B", TARGET_LLAMA, 4 << 20, 8, 80, 3, False),
    ("Llama-3-8B", TARGET_LLAMA, 16 << 20, 32, 80, 3, False),
]


def target_argv(model: list[str], n: int, sp: int, zero: int, offload: bool) -> list[str]:
    """pretrain_gpt.py's flags for one target (--dry-run --world-size SP plans it)."""
    return (
        TARGET_COMMON
        + model
        + ["--seq-length", str(n), "--max-position-embeddings", str(n)]
        + ["--global-batch-size", "1", "--ds-sequence-parallel-size", str(sp)]
        + ["--zero-stage", str(zero)]
        + (["--optimizer-cpu-offload"] if offload else [])
    )


def table_targets() -> str:
    from megatron_ul.training import memory_estimator as me
    from megatron_ul.training.pretrain import configure

    rows = [
        "| model | N | GPUs | options | estimate GiB/GPU | budget GiB | | peak phase and "
        "its terms (GiB) | host GiB/GPU |",
        "|---|---:|---|---|---:|---:|---|---|---:|",
    ]
    for name, model, n, sp, gpu_gb, zero, offload in TARGETS:
        cfg = configure(target_argv(model, n, sp, zero, offload), sp)
        est = me.estimate_config(cfg)
        budget = me.memory_budget_bytes(gpu_gb)
        terms = "; ".join(
            f"{k} {v / me.GiB:.1f}"
            for k, v in sorted(est.terms.items(), key=lambda kv: -kv[1])
            if v > 0.5 * me.GiB
        )
        fits = "fits" if est.total_bytes <= budget else "does not fit"
        rows.append(
            f"| {name} | {n // 1024}K | {sp} × {gpu_gb} GiB | bf16"
            f"{', optimizer offload' if offload else ''}, ZeRO-{zero} | "
            f"{est.total_bytes / me.GiB:.1f} | {budget / me.GiB:.0f} | {fits} | "
            f"{est.peak_phase}: params {est.parameter_bytes / me.GiB:.1f}, optimizer "
            f"{est.optimizer_bytes / me.GiB:.1f}; {terms} | "
            f"{est.host_bytes / me.GiB:.0f} |"
        )
    return "\n".join(rows)
