#!/usr/bin/env python
"""Overlays training runs read from TensorBoard event directories on one figure.

Each run is a directory of event files (ours: --tensorboard-dir; Megatron-LM's, or Hugging Face
Trainer's, read the same way), given as PATH or LABEL=PATH. Panels: loss (validation dashed),
learning rate, grad norm, throughput and memory, each drawn when at least one run has it.
Writes PNG, SVG or PDF by the output's extension, headless (matplotlib's Agg backend).

  python -m tools.plot_runs runs/sp4 runs/tp4 --output docs/results/loss.png
  python -m tools.plot_runs one=runs/a two=runs/b --x tokens --seq-length 2048 \\
      --output loss.svg --reference one --table loss.md

--table writes, per run, the largest |loss difference| from the --reference run at the steps
they share. TensorBoard stores scalars as float32, so differences below about 1e-7 of the loss
cannot be seen through event files.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import numpy as np

# Each panel's tags, ours first (Megatron-LM's names), then Megatron-LM's other spellings and
# Hugging Face Trainer's.
PANELS = {
    "loss": ("lm loss", "train/loss", "loss"),
    "learning rate": ("learning-rate", "train/learning_rate", "lr"),
    "grad norm": ("grad-norm", "train/grad_norm"),
    "throughput (tokens/s)": ("tokens-per-sec", "throughput/tokens-per-sec"),
    "TFLOP/s per GPU": ("tflops-per-rank", "throughput"),
    "peak memory (GiB)": ("peak-memory-gib",),
    "max allocated (bytes)": ("mem-max-allocated-bytes",),
}
VALIDATION = ("lm loss validation", "eval/loss")
DIFFERENCE = "difference"  # the panel of |loss − reference|, drawn with --reference
LOSS = PANELS["loss"]


class PlotError(Exception):
    """A run directory, tag or option that cannot be plotted; the message names it."""


@dataclass
class Run:
    label: str
    path: str
    scalars: dict[str, tuple[np.ndarray, np.ndarray]]  # tag -> (steps, values)

    def first(self, tags) -> tuple[str, np.ndarray, np.ndarray] | None:
        for tag in tags:
            if tag in self.scalars:
                return (tag, *self.scalars[tag])
        return None


def read_scalars(path: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """tag -> (steps, values) of every scalar in the event files under `path` (a later
    write at the same step wins, as TensorBoard shows a resumed run)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not os.path.isdir(path):
        raise PlotError(f"{path}: not a directory (give a TensorBoard event directory)")
    accumulator = EventAccumulator(path, size_guidance={"scalars": 0})
    accumulator.Reload()
    out = {}
    for tag in accumulator.Tags()["scalars"]:
        by_step = {event.step: event.value for event in accumulator.Scalars(tag)}
        steps = np.array(sorted(by_step), dtype=np.int64)
        out[tag] = (steps, np.array([by_step[s] for s in steps], dtype=np.float64))
    if not out:
        raise PlotError(f"{path}: no TensorBoard scalars (is it a --tensorboard-dir?)")
    return out


def load_runs(specs: list[str]) -> list[Run]:
    runs = []
    for spec in specs:
        label, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        label = label or os.path.basename(os.path.normpath(path))
        runs.append(Run(label, path, read_scalars(path)))
    labels = [r.label for r in runs]
    if len(set(labels)) != len(labels):
        raise PlotError(f"two runs share a label ({labels}); name them LABEL=PATH")
    return runs


def x_values(run: Run, tag: str, steps: np.ndarray, args) -> np.ndarray:
    """Iterations, or tokens: Megatron-LM's '<tag> vs samples' × --seq-length when the run
    logged it, else iterations × --tokens-per-iteration."""
    if args.x == "iterations":
        return steps
    by_samples = run.scalars.get(f"{tag} vs samples")
    if by_samples is not None and args.seq_length and len(by_samples[0]) == len(steps):
        return by_samples[0] * args.seq_length
    loss, loss_by_samples = run.scalars.get("lm loss"), run.scalars.get("lm loss vs samples")
    if loss is not None and loss_by_samples is not None and args.seq_length:
        # a constant batch: the loss's samples per iteration scale the other panels
        return steps * (loss_by_samples[0][-1] / loss[0][-1]) * args.seq_length
    if args.tokens_per_iteration:
        return steps * args.tokens_per_iteration
    raise PlotError(
        f"--x tokens: run {run.label} has no '{tag} vs samples' scalars to scale by "
        "--seq-length; give --tokens-per-iteration"
    )


def plot(runs: list[Run], args) -> list[str]:
    """Draws the figure into args.output; returns the panels drawn."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    wanted = args.panels or list(PANELS)
    panels = [n for n in wanted if n in PANELS and any(r.first(PANELS[n]) for r in runs)]
    if "loss" not in panels:
        raise PlotError(f"no run has a loss scalar (one of {LOSS + VALIDATION})")
    if args.reference:
        reference = differences(runs, args.reference)  # checks the label
        panels.insert(panels.index("loss") + 1, DIFFERENCE)
    columns = 2 if len(panels) == 4 else min(len(panels), 3)
    rows = -(-len(panels) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 3.8 * rows), squeeze=False)
    for axis, name in zip(axes.flat, panels):
        if name == DIFFERENCE:
            _plot_differences(axis, runs, reference, args)
            continue
        for index, run in enumerate(runs):
            color = f"C{index % 10}"
            found = run.first(PANELS[name])
            if found:
                tag, steps, values = found
                axis.plot(
                    x_values(run, tag, steps, args), values, color=color, lw=1.2,
                    label=run.label, alpha=0.85,
                )  # fmt: skip
            valid = run.first(VALIDATION) if name == "loss" else None
            if valid:
                tag, steps, values = valid
                axis.plot(
                    x_values(run, tag, steps, args), values, color=color, ls="--",
                    marker="o", ms=3, lw=1, label=f"{run.label} (validation)",
                )  # fmt: skip
        axis.set_title(name)
        axis.set_xlabel(args.x)
        axis.grid(alpha=0.3)
        if name == "loss" and args.log_loss:
            axis.set_yscale("log")
    axes.flat[0].legend(fontsize=8)
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_visible(False)
    if args.title:
        figure.suptitle(args.title)
    figure.tight_layout()
    directory = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(directory, exist_ok=True)
    figure.savefig(args.output, dpi=args.dpi)
    plt.close(figure)
    return panels


def _plot_differences(axis, runs: list[Run], rows: list[dict], args) -> None:
    """|training loss − the reference's| at each shared step, one line per run."""
    for index, run in enumerate(runs):
        row = next((r for r in rows if r["run"] == run.label), None)
        if row is None or row["train"] is None:
            continue
        steps, diff = row["train"]["shared"], row["train"]["abs"]
        axis.plot(
            x_values(run, LOSS[0], steps, args) if args.x == "tokens" else steps, diff,
            color=f"C{index % 10}", lw=1, label=run.label,
        )  # fmt: skip
    axis.set_title(f"|loss − {args.reference}|")
    axis.set_xlabel(args.x)
    axis.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)


def differences(runs: list[Run], reference: str) -> list[dict]:
    """Per run: steps shared with the reference and the largest |Δ| of training and validation
    loss there."""
    by_label = {r.label: r for r in runs}
    if reference not in by_label:
        raise PlotError(f"--reference {reference}: no such run (runs: {sorted(by_label)})")
    ref = by_label[reference]
    rows = []
    for run in runs:
        if run.label == reference:
            continue
        row: dict = {"run": run.label}
        for kind, tags in (("train", LOSS), ("validation", VALIDATION)):
            mine, theirs = run.first(tags), ref.first(tags)
            if not mine or not theirs:
                row[kind] = None
                continue
            shared, i, j = np.intersect1d(mine[1], theirs[1], return_indices=True)
            diff = np.abs(mine[2][i] - theirs[2][j])
            row[kind] = {
                "shared": shared,
                "abs": diff,
                "steps": len(shared),
                "max_abs": float(diff.max()) if len(diff) else float("nan"),
                "at_step": int(shared[diff.argmax()]) if len(diff) else None,
                "max_rel": float((diff / np.abs(theirs[2][j])).max()) if len(diff) else 0.0,
            }
        rows.append(row)
    return rows


def table_markdown(rows: list[dict], reference: str) -> str:
    lines = [
        f"| run | steps compared | max \\|Δ train loss\\| vs {reference} (at step) | "
        "max relative | validation points | max \\|Δ validation loss\\| |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        t, v = row["train"], row["validation"]
        train = (
            ("—",) * 3
            if t is None
            else (str(t["steps"]), f"{t['max_abs']:.3g} ({t['at_step']})", f"{t['max_rel']:.2g}")
        )
        valid = ("—", "—") if v is None else (str(v["steps"]), f"{v['max_abs']:.3g}")
        lines.append(f"| {row['run']} | " + " | ".join(train + valid) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", help="TensorBoard event directories: PATH or LABEL=PATH")
    parser.add_argument("--output", required=True, help="figure file: .png, .svg or .pdf")
    parser.add_argument("--x", choices=("iterations", "tokens"), default="iterations")
    parser.add_argument(
        "--seq-length", type=int, default=None, help="--x tokens: tokens per sample"
    )
    parser.add_argument(
        "--tokens-per-iteration",
        type=int,
        default=None,
        help="--x tokens for runs without '<tag> vs samples' scalars",
    )
    parser.add_argument(
        "--panels", nargs="+", choices=list(PANELS), default=None, help="default: all present"
    )
    parser.add_argument("--title", default=None)
    parser.add_argument("--log-loss", action="store_true", help="loss on a log axis")
    parser.add_argument("--dpi", type=int, default=120)
    parser.add_argument(
        "--reference",
        default=None,
        help="label of the run the others are compared with: a |Δ loss| panel, and --table",
    )
    parser.add_argument("--table", default=None, help="write the loss differences (Markdown)")
    args = parser.parse_args(argv)
    extension = os.path.splitext(args.output)[1].lower()
    if extension not in (".png", ".svg", ".pdf"):
        parser.error(f"--output {args.output}: choose a .png, .svg or .pdf file")
    if args.table and not args.reference:
        parser.error("--table needs --reference (the run the others are compared with)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        print(
            "error: tools/plot_runs.py needs matplotlib (pip install matplotlib)", file=sys.stderr
        )
        return 2
    try:
        runs = load_runs(args.runs)
        panels = plot(runs, args)
        if args.table:
            text = table_markdown(differences(runs, args.reference), args.reference)
            with open(args.table, "w") as f:
                f.write(text)
            print(text, end="")
    except PlotError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {len(runs)} runs, panels: {', '.join(panels)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
