"""The device's peak per phase against the layer backward's floor and the estimator, over a
matrix of shapes (hidden, documents or one causal sequence, the ring or not), two lengths
each for the marginal bytes per token.

    python -m tools.bench.bench_layer_floor --run 512 16384 [--cp 2] [--no-documents] \
        [--runs bf16:offload+tiles] --out /tmp/r.json      # one row, its own processes
    python -m tools.bench.bench_layer_floor --table /tmp/r*.json   # the rows, estimated anew

Each row is `bench_memory.measure_peak` (two iterations under the live-tensor tracker, the
device's storages apart from what a GPU run keeps in host memory: offloaded layer inputs,
and under --optimizer-cpu-offload the fp32 main parameters, main gradients and Adam's state).
The floor is what the layer's backward must hold at once, per token of the rank: q, k, v, the
attention output and its fp32 log-sum-exp, the layer's input (the residual checkpoint), dO,
dq, dk, dv and one residual-stream gradient.
"""

from __future__ import annotations

import argparse
import contextlib
import json

from tools.bench.bench_memory import OPTIONS, PRECISIONS, peak_argv, peak_worker
from tools.bench.common import run_ranks

MIB = 2**20
PHASES = ("forward", "loss backward", "layer backward", "clip", "optimizer")
ESTIMATED = ("forward", "loss backward", "layer backward", "optimizer")  # the estimator's phases
STATE = ("parameters", "optimizer state", "gradients")  # the tracker's classes of model state
TOP = 8  # live tensors listed at the layer-backward peak


def floor_bytes_per_token(hidden: int, heads: int, groups: int, precision: str) -> int:
    """The layer backward's floor per token of the rank (Ulysses moves heads, not bytes)."""
    act = 4 if precision == "fp32" else 2
    residual = 4 if precision in ("fp32", "autocast-bf16") else 2
    d = hidden // heads
    qkv, out = act * d * (heads + 2 * groups), act * d * heads
    return 2 * (qkv + out) + 4 * heads + 2 * residual * hidden


@contextlib.contextmanager
def sdpa_views_as_on_cuda():
    """SDPA given the permuted [b, h, N, d] views of q, k and v, as CUDA's kernels take them:
    on CPU `attention.local._sdpa_layout` copies half-precision inputs contiguous for the CPU
    kernel's speed, a copy of q, k and v that a GPU run never holds (at hidden 1024, one
    causal sequence of 16K: 96 MiB beside the QKV output, the forward's peak). CUDA's
    `_scaled_dot_product_flash_attention_cuda` (aten/src/ATen/native/transformers/cuda/
    attention.cu) hands `query.transpose(1, 2)` to `_flash_attention_forward`, whose `mha_fwd`
    (transformers/cuda/flash_attn/flash_api.cpp) asks only for a last dimension of stride 1;
    the CPU kernel (native/cpu/FlashAttentionKernel.cpp, `cpu_flash_attention`) reads any
    strides and returns the same values."""
    from megatron_ul.model.attention import local

    copy = local._sdpa_layout
    local._sdpa_layout = lambda t: t
    try:
        yield
    finally:
        local._sdpa_layout = copy


def device_peak_worker(rank, world, argv, precision: str):
    """`peak_worker` with SDPA as on CUDA (`sdpa_views_as_on_cuda`)."""
    with sdpa_views_as_on_cuda():
        return peak_worker(rank, world, argv, precision)


def measure_device_peak(hidden, seq_length, precision, sp, cp, extra, documents) -> dict:
    """The fullest rank's `device_peak_worker` result (bench_memory.measure_peak's shape)."""
    argv = peak_argv(hidden, seq_length, sp, cp, extra, documents)
    results = run_ranks(device_peak_worker, sp * cp, argv, precision, timeout=4 * 3600.0)
    return max(results, key=lambda r: r["peak"])


def estimate_phases(cfg, precision: str, documents: bool) -> dict[str, float]:
    """The estimator's device bytes per phase (model state + the phase), as a GPU holds them."""
    from megatron_ul.training import memory_estimator as me

    t = cfg.train
    kernels = me.Kernels(
        documents=documents,
        document_kernel="in-place",
        optimizer_offload=t.optimizer_offload_fraction if t.optimizer_cpu_offload else 0.0,
    )
    est = me.estimate(
        cfg.model,
        me.layout_from_config(cfg),
        recompute="full",
        precision=me.Precision(half_model=precision == "bf16", dropout_mask_bytes=4),
        kernels=kernels,
    )
    state = est.parameter_bytes + est.optimizer_bytes
    phases = {phase: state + est.phases[phase] for phase in ESTIMATED}
    # The tracker's layer-backward phase lasts until clipping: the gradient reduction after
    # backward (its host-held gradients' staging bucket) is in it.
    if "gradient reduction" in est.phases:
        reduction = state + est.phases["gradient reduction"]
        phases["layer backward"] = max(phases["layer backward"], reduction)
    return phases


def _config(hidden, seq_length, run: str, sp: int, cp: int, documents: bool):
    """(precision, the bench's option flags, the row's resolved config)."""
    from megatron_ul.training.pretrain import configure

    precision, _, names = run.partition(":")
    if precision not in PRECISIONS or any(n not in OPTIONS for n in names.split("+")):
        raise SystemExit(f"--runs {run}: want PRECISION:OPTION[+OPTION] from {list(OPTIONS)}")
    extra = tuple(f for n in names.split("+") for f in OPTIONS[n])
    argv = peak_argv(hidden, seq_length, sp, cp, extra, documents)
    cfg = configure(argv + (["--bf16"] if precision == "bf16" else []), sp * cp)
    return precision, extra, cfg


def reestimated(row: dict) -> dict:
    """A measured row with this tree's estimate (a stored row keeps its measurement)."""
    precision, _, cfg = _config(
        row["hidden"], row["seq_length"], row["run"], row["sp"], row["cp"], row["documents"]
    )
    return {**row, "estimated": estimate_phases(cfg, precision, row["documents"])}


def run_row(hidden, seq_length, run: str, sp: int, cp: int, documents: bool) -> dict:
    precision, extra, cfg = _config(hidden, seq_length, run, sp, cp, documents)
    got = measure_device_peak(hidden, seq_length, precision, sp, cp, extra, documents)
    m = cfg.model
    phases = {}
    for phase in PHASES:
        p = got["phases"].get(f"iteration 2 {phase}")
        if p is None:
            continue
        state = sum(p["breakdown"].get(c, 0) for c in STATE)
        phases[phase] = {
            "device": p["device_peak"],
            "total": p["peak"],
            "state": state,
            "where": p["where"],
            "top": list(p["breakdown"].items())[:TOP],
        }
    return {
        "hidden": hidden,
        "seq_length": seq_length,
        "run": run,
        "sp": sp,
        "cp": cp,
        "documents": documents,
        "tokens": got["tokens_per_rank"],
        "floor": floor_bytes_per_token(hidden, m.num_attention_heads, m.query_groups, precision),
        "phases": phases,
        "estimated": estimate_phases(cfg, precision, documents),
        "rss_peak": got["rss_peak"],
    }


def _key(r: dict) -> tuple:
    return (r["hidden"], r["run"], r["sp"], r["cp"], r["documents"])


def _name(r: dict) -> str:
    docs = "one document" if r["documents"] else "causal, no documents"
    ring = f", CP {r['cp']}" if r["cp"] > 1 else ""
    sp = f", SP {r['sp']}" if r["sp"] > 1 else ""
    return f"{r['hidden']}, {r['run']}, {docs}{sp}{ring}"


def table(rows: list[dict]) -> str:
    """Per row: the device peak of each phase, the layer backward above the model state
    against the floor, and the estimate; per pair of lengths: the marginal bytes per token."""
    rows = sorted(rows, key=lambda r: (_key(r), r["seq_length"]))
    out = [
        "| case (hidden, precision:options, attention) | N | tokens/rank | forward | loss bwd "
        "| layer bwd | clip | layer bwd above state, B/token | floor B/token | ratio "
        "| estimated fwd / loss / layer / optimizer (error) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ph = r["phases"]

        def mib(phase, ph=ph):
            v = ph.get(phase, {}).get("device")
            return "–" if v is None else f"{v / MIB:.1f}"

        layer = ph["layer backward"]
        above = (layer["device"] - layer["state"]) / r["tokens"]
        errors = []
        for phase in ESTIMATED:
            measured = ph.get(phase, {}).get("device")
            est = r["estimated"][phase]
            errors.append(
                f"{est / MIB:.1f}" + ("" if measured is None else f" ({est / measured - 1:+.1%})")
            )
        out.append(
            f"| {_name(r)} | {r['seq_length'] // 1024}K | {r['tokens']} | {mib('forward')} | "
            f"{mib('loss backward')} | {mib('layer backward')} | {mib('clip')} | {above:.0f} | "
            f"{r['floor']} | {above / r['floor']:.2f} | {' / '.join(errors)} |"
        )
    out += [
        "",
        "Marginal device bytes per token of the rank between the two lengths, per phase "
        "(measured, estimated):",
        "",
        "| case | N | forward | loss bwd | layer bwd | layer bwd / floor | estimated layer bwd "
        "(error) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    by_key: dict = {}
    for r in rows:
        by_key.setdefault(_key(r), []).append(r)
    for group in by_key.values():
        for a, b in zip(group, group[1:]):
            dn = b["tokens"] - a["tokens"]

            def slope(phase, a=a, b=b, dn=dn):
                return (b["phases"][phase]["device"] - a["phases"][phase]["device"]) / dn

            layer = slope("layer backward")
            est = (b["estimated"]["layer backward"] - a["estimated"]["layer backward"]) / dn
            out.append(
                f"| {_name(a)} | {a['seq_length'] // 1024}K → {b['seq_length'] // 1024}K | "
                f"{slope('forward'):.0f} | {slope('loss backward'):.0f} | {layer:.0f} | "
                f"{layer / a['floor']:.2f} | {est:.0f} ({est / layer - 1:+.1%}) |"
            )
    out += ["", "Alive at the layer-backward device peak (largest first), MiB:", ""]
    for r in rows:
        layer = r["phases"]["layer backward"]
        terms = "; ".join(f"{_short(label)} {nbytes / MIB:.1f}" for label, nbytes in layer["top"])
        where = _short(layer["where"])
        out.append(f"- {_name(r)}, {r['seq_length'] // 1024}K (at `{where}`): {terms}")
    return "\n".join(out)


def _short(label: str) -> str:
    """A tracker label as a table cell: 'phase backward | node | op' without the iteration."""
    return label.replace("iteration 2 ", "").replace("iteration 1 ", "").replace(" | ", " / ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", nargs=2, type=int, metavar=("HIDDEN", "N"))
    parser.add_argument("--runs", default="bf16:offload+tiles", metavar="PRECISION:OPTIONS")
    parser.add_argument("--sp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--no-documents", action="store_true")
    parser.add_argument("--out", help="with --run: write the row here (JSON)")
    parser.add_argument("--table", nargs="+", metavar="JSON", help="print the rows' tables")
    args = parser.parse_args()
    if args.run:
        hidden, n = args.run
        row = run_row(hidden, n, args.runs, args.sp, args.cp, not args.no_documents)
        text = json.dumps(row, indent=1)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        print(table([row]))
    if args.table:
        rows = []
        for path in args.table:
            with open(path) as f:
                rows.append(reestimated(json.load(f)))
        print(table(rows))
    if not args.run and not args.table:
        parser.error("give --run HIDDEN N or --table JSON...")


if __name__ == "__main__":
    main()
