#!/usr/bin/env python
"""Per-GPU memory for a GPT × sequence length × layout, and the fewest GPUs that fit.

Takes pretrain_gpt.py's flags (model, parallel sizes, --zero-stage, --bf16, batch sizes) plus:

    python -m tools.memory_estimator --num-layers 32 --hidden-size 4096 \
        --num-attention-heads 32 --seq-length 131072 --max-position-embeddings 131072 \
        --vocab-size 50257 --mock-data --bf16 --world-size 32 \
        --ds-sequence-parallel-size 32 --zero-stage 3 --recompute full --gpu-memory-gb 80

Prints a Markdown table of the estimate for the given layout and, with --gpu-memory-gb, the
smallest world size (raising the Ulysses degree, then data parallelism under ZeRO) whose
estimate fits. Formulas and what they leave out: megatron_ul/training/memory_estimator.py.
"""

import argparse
import sys

try:
    import megatron_ul  # noqa: F401
except ModuleNotFoundError:  # `python tools/NAME.py` from a checkout without the install
    sys.exit("megatron_ul is not installed: run `bash scripts/install.sh` (or pip install -e .)")

from megatron_ul.arguments import parse_args
from megatron_ul.config import ConfigError, resolve
from megatron_ul.config_rules import validate
from megatron_ul.training import memory_estimator as me


def own_flags() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, add_help=False, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--gpu-memory-gb",
        type=float,
        default=None,
        help="GPU memory to fit in; prints the smallest GPU count that does",
    )
    p.add_argument(
        "--reserve-gb",
        type=float,
        default=2.0,
        help="kept free for the CUDA context and fragmentation (default 2)",
    )
    p.add_argument(
        "--recompute",
        choices=me.RECOMPUTE_CHOICES,
        default=None,
        help="activation recomputation (default: --recompute-granularity or none)",
    )
    p.add_argument(
        "--no-fused-attention",
        action="store_true",
        help="estimate an attention kernel that keeps the N×N scores",
    )
    p.add_argument("-h", "--help", action="store_true")
    return p


def load_config(rest: list[str]):
    """The resolved, validated Config of pretrain_gpt.py's flags (mock data unless data given)."""
    extra = [] if "--mock-data" in rest or "--data-path" in rest else ["--mock-data"]
    if "--world-size" in rest and "--dry-run" not in rest:
        extra.append("--dry-run")  # pretrain accepts --world-size only when not launching
    cfg = parse_args(rest + extra)
    if not cfg.model.vocab_size:
        cfg.model.vocab_size = 50257
    return validate(resolve(cfg))


def table(rows) -> str:
    out = ["| | GiB per GPU |", "|---|---:|"]
    out += [f"| {name} | {value / me.GiB:.2f} |" for name, value in rows]
    return "\n".join(out)


def main(argv=None) -> int:
    ours, rest = own_flags().parse_known_args(argv)
    if ours.help:
        print(__doc__)
        return 0
    try:
        cfg = load_config(rest)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    recompute = ours.recompute or me.recompute_of(cfg)
    zero = cfg.parallel.zero_stage or (1 if cfg.parallel.use_distributed_optimizer else 0)
    precision = me.Precision(
        bf16=cfg.train.bf16 or cfg.train.fp16, fused_attention=not ours.no_fused_attention
    )
    layout = me.layout_from_config(cfg)
    est = me.estimate(cfg.model, layout, zero_stage=zero, recompute=recompute, precision=precision)
    ring = f" × CP {layout.cp}" if layout.cp > 1 else ""
    print(
        f"world {layout.world} = TP {layout.tp} × SP {layout.sp}{ring} × PP {layout.pp} × DP "
        f"{layout.dp}; ZeRO {zero}; recompute {recompute}; "
        f"{est.params_per_rank / 1e6:.1f} M parameters per rank\n"
    )
    print(table(est.rows()))
    print(
        f"\ninitialisation peak: {me.init_peak_bytes(cfg.model, layout, zero) / me.GiB:.2f} "
        f"GiB per GPU (each rank computes only the parameters it holds)"
    )
    if ours.gpu_memory_gb is not None:
        found = me.smallest_fitting_layout(
            cfg.model,
            layout,
            ours.gpu_memory_gb,
            zero_stage=zero,
            recompute=recompute,
            precision=precision,
            reserve_gb=ours.reserve_gb,
        )
        if found is None:
            print(
                f"\nnothing fits in {ours.gpu_memory_gb} GB per GPU with TP {layout.tp}, "
                f"PP {layout.pp}: raise TP/PP, use --zero-stage 3 or --recompute full"
            )
            return 1
        fit, fit_est = found
        print(
            f"\nsmallest fit in {ours.gpu_memory_gb} GB: {fit.world} GPUs = TP {fit.tp} × "
            f"SP {fit.sp}{ring} × PP {fit.pp} × DP {fit.dp} "
            f"({fit_est.total_bytes / me.GiB:.1f} GiB per GPU)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
