#!/usr/bin/env python
"""The paper's Figure 8 at CPU scale, on real text: one GPT trained as one process, as Ulysses
SP 4 with ZeRO-1, ZeRO-2 and ZeRO-3, and as TP 4 with Megatron-LM's sequence parallelism;
the loss curves overlaid and their largest differences from the one-process run tabulated.

Needs the README demo's corpus and tokenizer (bash scripts/demo_cpu.sh builds them in
data/demo). Each layout is a `torchrun pretrain_gpt.py` run with --tensorboard-dir; a layout
whose event directory already holds every iteration is not run again (--rerun to force).

  python -m tools.convergence_layouts            # about 15 minutes on 2 CPU cores
  python -m tools.convergence_layouts --layouts one-process sp4-zero2   # add one later
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from tools import plot_runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# label -> (processes, flags)
LAYOUTS = {
    "one-process": (1, []),
    "sp4-zero1": (4, ["--ds-sequence-parallel-size", "4", "--use-distributed-optimizer"]),
    "sp4-zero2": (4, ["--ds-sequence-parallel-size", "4", "--zero-stage", "2"]),
    "sp4-zero3": (4, ["--ds-sequence-parallel-size", "4", "--zero-stage", "3"]),
    "tp4-megatron-sp": (4, ["--tensor-model-parallel-size", "4", "--sequence-parallel"]),
}


def model_flags(args) -> list[str]:
    """A small GPT-2-shaped model on 2K-token sequences of packed documents (the dataset
    concatenates documents, EOD-separated, and cuts sequences of --seq-length)."""
    return [
        "--data-path", os.path.join(args.data_dir, "demo_text_document"),
        "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", os.path.join(args.data_dir, "tokenizer.model"),
        "--split", "98,2,0",
        "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length),
        "--micro-batch-size", "1", "--global-batch-size", "1",
        "--train-iters", str(args.iters), "--lr", "1e-3", "--min-lr", "1e-4",
        "--lr-warmup-iters", str(args.iters // 10), "--lr-decay-style", "cosine",
        "--clip-grad", "1.0", "--weight-decay", "0.01",
        # Adam's 1/eps gain on near-zero gradients turns fp32 rounding into visible updates
        # (tests/training/equivalence.py); 1e-5 keeps the comparison about layouts.
        "--adam-eps", "1e-5",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "1234",
        "--log-interval", "1", "--eval-interval", str(args.eval_interval), "--eval-iters", "2",
    ]  # fmt: skip


def complete(tb_dir: str, iters: int) -> bool:
    try:
        scalars = plot_runs.read_scalars(tb_dir)
    except plot_runs.PlotError:
        return False
    if "lm loss" not in scalars:
        return False
    steps = scalars["lm loss"][0]
    return len(steps) == iters and int(steps[-1]) == iters


def run_layout(label: str, args) -> float:
    """Trains one layout; returns its wall time in seconds."""
    processes, flags = LAYOUTS[label]
    tb_dir = os.path.join(args.out, label)
    if os.path.isdir(tb_dir):
        for name in os.listdir(tb_dir):  # a half-written run is replaced, not appended to
            os.remove(os.path.join(tb_dir, name))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(processes), os.path.join(ROOT, "pretrain_gpt.py"),
        *model_flags(args), *flags, "--tensorboard-dir", tb_dir,
    ]  # fmt: skip
    print(f"[{label}] {' '.join(command)}", flush=True)
    start = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(os.path.join(args.out, f"{label}.log"), "w") as log:
        result = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise SystemExit(f"[{label}] failed (exit {result.returncode}); see {log.name}")
    return time.time() - start


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--data-dir", default="data/demo", help="the demo's corpus and tokenizer")
    parser.add_argument("--out", default="runs/convergence_layouts", help="event directories")
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--eval-interval", type=int, default=25)
    parser.add_argument("--figure", default="docs/results/convergence_layouts.png")
    parser.add_argument("--table", default="docs/results/convergence_layouts.md")
    parser.add_argument("--rerun", action="store_true", help="train layouts already complete")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    for name in ("demo_text_document.idx", "tokenizer.model"):
        if not os.path.isfile(os.path.join(args.data_dir, name)):
            print(
                f"error: --data-dir {args.data_dir}: no {name}; run bash scripts/demo_cpu.sh "
                "once to build the demo corpus",
                file=sys.stderr,
            )
            return 2
    os.makedirs(args.out, exist_ok=True)
    for label in args.layouts:
        if not args.rerun and complete(os.path.join(args.out, label), args.iters):
            print(f"[{label}] complete, not rerun")
            continue
        print(f"[{label}] {run_layout(label, args):.0f} s", flush=True)
    done = [
        label for label in LAYOUTS if complete(os.path.join(args.out, label), args.iters)
    ]  # every complete layout, also those of earlier invocations
    if "one-process" not in done:
        print("error: the one-process reference has not run", file=sys.stderr)
        return 2
    return plot_runs.main(
        [
            *(f"{label}={os.path.join(args.out, label)}" for label in done),
            "--output", args.figure, "--reference", "one-process", "--table", args.table,
            "--panels", "loss", "learning rate", "grad norm",
            "--title", f"GPT h128 L2, {args.seq_length}-token packed sequences, demo corpus",
        ]
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
