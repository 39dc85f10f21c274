#!/usr/bin/env python
"""Training throughput against Hugging Face GPT2LMHeadModel on the same configuration, in one
process: CPU, fp32, torch SDPA attention in both, dropout off, AdamW, same batch shapes.

Both models get the same GPT-2 architecture (learned positions, LayerNorm, exact GELU, biases,
tied embeddings; a vocabulary that needs no padding). Steps alternate between the two models
in rounds so that machine noise hits both alike; the median step time of each counts.

    pip install transformers      (optional dependency, only for this benchmark)
    python -m tools.bench.bench_vs_hf [--layers 4 --hidden 256 --heads 8 --seq 1024] [--write-docs]
"""

import argparse
import os
import statistics
import time

import torch

from megatron_ul.config import ResolvedModelConfig
from megatron_ul.initialize import free_port
from megatron_ul.model.gpt import GPTModel
from megatron_ul.mpu import parallel_state as ps
from megatron_ul.mpu.random import model_parallel_seed
from megatron_ul.training.step import train_step
from tools.bench.common import markdown_table, report


def build_ours(a):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    dims = ps.initialize_model_parallel(1, 1, 1)
    model_parallel_seed(1, dims, "cpu")
    cfg = ResolvedModelConfig(
        num_layers=a.layers,
        hidden_size=a.hidden,
        num_attention_heads=a.heads,
        seq_length=a.seq,
        vocab_size=a.vocab,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        max_position_embeddings=a.seq,
    )
    model = GPTModel(cfg, seed=1, dims=dims)
    assert model.padded_vocab_size == a.vocab, "pick a --vocab that needs no padding"
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)


def build_hf(a):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=a.vocab,
        n_positions=a.seq,
        n_embd=a.hidden,
        n_layer=a.layers,
        n_head=a.heads,
        activation_function="gelu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(config)
    assert model.config._attn_implementation == "sdpa"
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)


def step_ours(model, optimizer, tokens):
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    batch = {
        "tokens": inputs,
        "labels": labels,
        "loss_mask": torch.ones(labels.shape),
        "position_ids": torch.arange(inputs.shape[1]).expand_as(inputs),
    }
    train_step(model, optimizer, [batch], clip_grad=1.0)


def step_hf(model, optimizer, tokens):
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    logits = model(input_ids=inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps-per-round", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--write-docs", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1))
    runners = {
        "megatron_ul GPTModel": (step_ours, *build_ours(a)),
        "HF GPT2LMHeadModel": (step_hf, *build_hf(a)),
    }
    wall: dict[str, list[float]] = {name: [] for name in runners}
    cpu: dict[str, list[float]] = {name: [] for name in runners}
    for step, model, opt in runners.values():  # warm-up
        step(model, opt, tokens)
    for _ in range(a.rounds):
        for name, (step, model, opt) in runners.items():
            for _ in range(a.steps_per_round):
                start, start_cpu = time.perf_counter(), time.process_time()
                step(model, opt, tokens)
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    tokens_per_step = a.batch * a.seq
    median = {name: statistics.median(t) for name, t in wall.items()}
    median_cpu = {name: statistics.median(t) for name, t in cpu.items()}
    ours, hf = median["megatron_ul GPTModel"], median["HF GPT2LMHeadModel"]
    ours_cpu, hf_cpu = median_cpu["megatron_ul GPTModel"], median_cpu["HF GPT2LMHeadModel"]
    rows = [
        [
            name,
            f"{median[name] * 1e3:.0f}",
            f"{tokens_per_step / median[name]:.0f}",
            f"{median_cpu[name] * 1e3:.0f}",
            f"{tokens_per_step / median_cpu[name]:.0f}",
        ]
        for name in runners
    ]
    table = markdown_table(
        [
            "model",
            "median wall ms/step",
            "tokens/s (wall)",
            "median CPU ms/step",
            "tokens/s (CPU time)",
        ],
        rows,
    )
    report(
        "vs-hf",
        "Training throughput vs Hugging Face GPT-2",
        f"{a.layers} layers, hidden {a.hidden}, {a.heads} heads, sequence {a.seq}, batch "
        f"{a.batch}, vocab {a.vocab}; fp32, SDPA, dropout off, AdamW (foreach), clip 1.0; "
        f"{a.threads} thread(s); {a.rounds} alternating rounds of {a.steps_per_round} steps "
        f"after one warm-up step each.",
        table,
        f"**megatron_ul / HF tokens/s: {hf / ours:.2f}× by wall clock, "
        f"{hf_cpu / ours_cpu:.2f}× by process CPU time** (with one thread, CPU time is the "
        f"work done and is not inflated by other load on a shared machine)",
        a.write_docs,
    )


if __name__ == "__main__":
    main()
