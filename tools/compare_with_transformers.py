#!/usr/bin/env python
"""Our trainer against an independent one: the same small GPT-2- or Llama-shaped model, from the
same initial weights (ours, exported to Hugging Face transformers with our checkpoint
converter's mapping), on the same batches in the same order, with the same schedule, trained
once by megatron_ul and once by transformers' model with torch.optim.AdamW, a plain loop and
torch's gradient clipping. Both write TensorBoard scalars under Megatron-LM's tags; the table
gives the largest loss differences at every logged step.

The transformers side shares only the inputs with ours: the batches (token ids, labels, loss
mask, positions from our data pipeline), the initial weights and the hyperparameters. The
learning-rate schedule (Megatron-LM's linear warm-up and cosine decay), the weight-decay
groups (none on biases and norms), the loss and the evaluation are written here.

  python -m tools.compare_with_transformers            # both shapes, 500 steps each
  python -m tools.compare_with_transformers --shapes gpt2 --iters 50 --out /tmp/quick
Needs transformers (pip install -e .[hf]), matplotlib and the README demo's corpus.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAPES = {
    "gpt2": ["--num-attention-heads", "4"],
    "llama": [
        "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    ],
}  # fmt: skip


def our_flags(args, shape: str, tb_dir: str) -> list[str]:
    return [
        "--data-path", os.path.join(args.data_dir, "demo_text_document"),
        "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", os.path.join(args.data_dir, "tokenizer.model"),
        "--split", "98,2,0",
        "--num-layers", "2", "--hidden-size", "128", *SHAPES[shape],
        "--seq-length", "128", "--micro-batch-size", "4", "--global-batch-size", "8",
        "--train-iters", str(args.iters), "--lr", "1e-3", "--min-lr", "1e-4",
        "--lr-warmup-iters", str(max(args.iters // 20, 1)), "--lr-decay-style", "cosine",
        "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta2", "0.95",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "1234",
        "--log-interval", "1", "--eval-interval", str(args.eval_interval), "--eval-iters", "2",
        "--tensorboard-dir", tb_dir,
    ]  # fmt: skip


# ---- the transformers side ---------------------------------------------------------------------
def megatron_lr(step: int, max_lr: float, min_lr: float, warmup: int, decay: int) -> float:
    """Megatron-LM's schedule after `step` optimizer steps: linear warm-up from 0, cosine
    decay to min_lr at `decay`, min_lr after."""
    if warmup > 0 and step <= warmup:
        return max_lr * step / warmup
    if step > decay:
        return min_lr
    ratio = (step - warmup) / (decay - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (max_lr - min_lr)


def hf_model_from_ours(model, cfg, shape: str, eod: int):
    """A transformers model holding our model's current weights (our exporter's mapping)."""
    import torch
    import transformers

    from megatron_ul.checkpoint.interop.hf import to_hf
    from megatron_ul.pipeline.model import global_named_parameters

    vocab = cfg.model.vocab_size
    params = {}
    for name, p in global_named_parameters(model):
        tensor = p.detach().clone()
        if name in ("word_embeddings.weight", "output_layer.weight"):
            tensor = tensor[:vocab]  # the exporter takes the unpadded vocabulary
        params[name] = tensor
    state, config = to_hf(shape, params, dataclasses.asdict(cfg.model))
    config = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    config.update(bos_token_id=eod, eos_token_id=eod)  # unused by the loss; the tokenizer's
    if shape == "gpt2":
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    hf = hf.float()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"exported weights do not fit: missing {missing}, extra {unexpected}")
    with torch.no_grad():  # every parameter came from ours (tied heads share the table)
        for name, p in hf.named_parameters():
            assert torch.equal(p, state[name]), name
    return hf


def hf_loss(hf, micro_batches):
    """Token-weighted mean cross-entropy over the global batch (backward per micro-batch)."""
    import torch
    import torch.nn.functional as F

    tokens = sum(mb["loss_mask"].sum() for mb in micro_batches)
    total = torch.zeros((), dtype=torch.float64)
    for mb in micro_batches:
        logits = hf(input_ids=mb["tokens"], position_ids=mb["position_ids"]).logits.float()
        per_token = F.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten(), reduction="none")
        loss = (per_token * mb["loss_mask"].flatten()).sum() / tokens
        if torch.is_grad_enabled():
            loss.backward()
        total += loss.detach().double()
    return total


def train_transformers(hf, cfg, train_batches, valid_batches, tb_dir: str) -> None:
    import torch
    from torch.utils.tensorboard import SummaryWriter

    t = cfg.train
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, p in hf.named_parameters():  # named_parameters() lists a tied table once
        (no_decay if p.ndim < 2 or name.endswith(".bias") else decay).append(p)
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": t.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=0.0,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_eps,
    )
    writer = SummaryWriter(log_dir=tb_dir)
    hf.train()
    for iteration in range(1, t.train_iters + 1):
        lr = megatron_lr(iteration - 1, t.lr, t.min_lr, t.lr_warmup_iters, t.lr_decay_iters)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss = hf_loss(hf, next(train_batches))
        grad_norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), t.clip_grad)
        optimizer.step()
        for tag, value in (("lm loss", loss), ("learning-rate", lr), ("grad-norm", grad_norm)):
            writer.add_scalar(tag, float(value), iteration)
        if t.eval_interval and iteration % t.eval_interval == 0:
            hf.eval()
            with torch.no_grad():
                losses = [float(hf_loss(hf, next(valid_batches))) for _ in range(t.eval_iters)]
            hf.train()
            writer.add_scalar("lm loss validation", sum(losses) / len(losses), iteration)
    writer.close()


# ---- one shape, both trainers ------------------------------------------------------------------
def run_shape(args, shape: str) -> None:
    import torch

    from megatron_ul.initialize import shutdown
    from megatron_ul.model.chunks import model_dims
    from megatron_ul.training.data import build_datasets, eod_token_for, global_batches
    from megatron_ul.training.pretrain import configure, setup

    torch.set_num_threads(1)
    out = os.path.join(args.out, shape)
    for name in ("megatron_ul", "transformers"):
        directory = os.path.join(out, name)
        if os.path.isdir(directory):
            for file in os.listdir(directory):
                os.remove(os.path.join(directory, file))
    cfg = configure(our_flags(args, shape, os.path.join(out, "megatron_ul")), world_size=1)
    trainer = setup(cfg)
    try:
        eod = eod_token_for(cfg)
        hf = hf_model_from_ours(trainer.model, cfg, shape, eod)
        # the same batches in the same order: a second pass of our pipeline over the data
        device = torch.device("cpu")
        dims = model_dims(trainer.model)
        train_ds, valid_ds, _ = build_datasets(cfg)
        train_batches = global_batches(cfg, dims, train_ds, device, eod)
        valid_batches = global_batches(cfg, dims, valid_ds, device, eod)
        start = time.time()
        trainer.train()
        ours = time.time() - start
        start = time.time()
        train_transformers(hf, cfg, train_batches, valid_batches, os.path.join(out, "transformers"))
        print(f"[{shape}] megatron_ul {ours:.0f} s, transformers {time.time() - start:.0f} s")
    finally:
        shutdown()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--eval-interval", type=int, default=50)
    parser.add_argument("--data-dir", default="data/demo")
    parser.add_argument("--out", default="runs/vs_transformers")
    parser.add_argument("--results", default="docs/results", help="figures and tables")
    parser.add_argument("--one-shape", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.one_shape:
        run_shape(args, args.shapes[0])
        return 0
    try:
        import transformers  # noqa: F401
    except ModuleNotFoundError:
        print("error: needs transformers (pip install -e .[hf])", file=sys.stderr)
        return 2
    for name in ("demo_text_document.idx", "tokenizer.model"):
        if not os.path.isfile(os.path.join(args.data_dir, name)):
            print(
                f"error: --data-dir {args.data_dir}: no {name}; run bash scripts/demo_cpu.sh "
                "once to build the demo corpus",
                file=sys.stderr,
            )
            return 2
    from tools import plot_runs

    for shape in args.shapes:  # a process per shape: each starts its own process group
        command = [sys.executable, "-m", "tools.compare_with_transformers", "--one-shape"]
        command += ["--shapes", shape, "--iters", str(args.iters), "--out", args.out]
        command += ["--eval-interval", str(args.eval_interval), "--data-dir", args.data_dir]
        subprocess.run(command, cwd=ROOT, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        out = os.path.join(args.out, shape)
        status = plot_runs.main(
            [
                f"megatron_ul={os.path.join(out, 'megatron_ul')}",
                f"transformers={os.path.join(out, 'transformers')}",
                "--output", os.path.join(args.results, f"vs_transformers_{shape}.png"),
                "--reference", "transformers", "--panels", "loss", "learning rate", "grad norm",
                "--table", os.path.join(args.results, f"vs_transformers_{shape}.md"),
                "--title", f"{shape}-shaped GPT h128 L2: megatron_ul against transformers",
            ]
        )  # fmt: skip
        if status:
            return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
