#!/usr/bin/env python
"""Per-GPU memory for a GPT × sequence length × layout, and the fewest GPUs that fit.

Takes pretrain_gpt.py's flags, parsed and checked as `--dry-run` does, and prints the same
estimate as a table (mock data when no data flag is given: the data does not change it):

    python -m tools.memory_estimator --num-layers 32 --hidden-size 4096 \\
        --num-attention-heads 32 --seq-length 131072 --max-position-embeddings 131072 \\
        --vocab-size 50257 --bf16 --world-size 32 --ds-sequence-parallel-size 32 \\
        --zero-stage 3 --recompute-granularity full --gpu-memory-gb 80

With --gpu-memory-gb (GiB per GPU, 2 GiB of it kept for the CUDA context), also the fewest
GPUs whose estimate fits: the Ulysses degree raised, then data parallelism under ZeRO, each
data-parallel replica keeping its micro-batches; printed as the flags to launch it with.
Formulas and what they leave out: megatron_ul/training/memory_estimator.py.
"""

import sys

try:
    import megatron_ul  # noqa: F401
except ModuleNotFoundError:  # `python tools/NAME.py` from a checkout without the install
    sys.exit("megatron_ul is not installed: run `bash scripts/install.sh` (or pip install -e .)")

from megatron_ul.config import ConfigError, ResolvedConfig
from megatron_ul.training import memory_estimator as me
from megatron_ul.training.configure import configure


def planning_argv(argv: list[str]) -> list[str]:
    """The flags as `--dry-run` takes them: --dry-run (which admits --world-size) and mock
    data unless a data flag is given."""
    extra = [] if "--dry-run" in argv else ["--dry-run"]
    if not {"--mock-data", "--data-path"} & set(argv):
        extra.append("--mock-data")
    return argv + extra


def table(rows) -> str:
    out = ["| | GiB per GPU |", "|---|---:|"]
    out += [f"| {name} | {value / me.GiB:.2f} |" for name, value in rows]
    return "\n".join(out)


def layout_line(cfg: ResolvedConfig) -> str:
    layout = me.layout_from_config(cfg)
    ring = f" × CP {layout.cp}" if layout.cp > 1 else ""
    return (
        f"{layout.world} GPUs = TP {layout.tp} × SP {layout.sp}{ring} × PP {layout.pp} × DP "
        f"{layout.dp}"
    )


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    try:
        cfg = configure(planning_argv(argv))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    est = me.estimate_config(cfg)
    layout = me.layout_from_config(cfg)
    print(
        f"world {layout_line(cfg)}; ZeRO {cfg.parallel.zero_stage}; recompute "
        f"{me.recompute_of(cfg)}; {est.params_per_rank / 1e6:.1f} M parameters per rank\n"
    )
    print(table(est.rows()))
    print(
        f"\ninitialisation peak: "
        f"{me.init_peak_bytes(cfg.model, layout, cfg.parallel.zero_stage) / me.GiB:.2f} "
        f"GiB per GPU (each rank computes only the parameters it holds)"
    )
    gpu_gb = cfg.train.gpu_memory_gb
    if gpu_gb is None:
        return 0
    budget = me.memory_budget_bytes(gpu_gb) / me.GiB
    verdict = "fits" if est.total_bytes <= me.memory_budget_bytes(gpu_gb) else "does not fit"
    print(f"\nthis layout {verdict} in {gpu_gb:g} GiB ({budget:g} GiB after the reserve)")
    found = me.smallest_fitting_layout(cfg, gpu_gb)
    if found is None:
        print(
            f"nothing fits in {gpu_gb:g} GiB per GPU with TP {layout.tp}, CP {layout.cp}, "
            f"PP {layout.pp}: raise TP/PP, use --zero-stage 3 or --recompute-granularity full"
        )
        return 1
    fit, fit_est = found
    print(
        f"smallest fit in {gpu_gb:g} GiB: {layout_line(fit)} "
        f"({fit_est.total_bytes / me.GiB:.2f} GiB per GPU): {me.layout_flags(fit)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
