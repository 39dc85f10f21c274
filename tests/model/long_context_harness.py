"""Run one GPTModel forward+backward on fixed data with and without a long-context option on
the same ranks, and report the largest loss and gradient differences (shard by shard)."""

from __future__ import annotations

import pytest
import torch

from megatron_ul.arguments import parse_args
from megatron_ul.config import resolve
from megatron_ul.config_rules import validate
from megatron_ul.model.gpt import GPTModel
from megatron_ul.mpu import parallel_state as ps
from megatron_ul.mpu.random import model_parallel_seed
from tests.dense_masks import use_dense_masks

MODEL = [
    "--mock-data",
    "--vocab-size",
    "1000",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
]
LLAMA = [
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--position-embedding-type",
    "rope",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
]


def _batch(cfg, dims, seed: int = 0):
    """This SP rank's tokens, positions, labels and a loss mask with some zeros."""
    m, sp = cfg.model, dims.sp
    g = torch.Generator().manual_seed(seed)
    b, n = cfg.train.micro_batch_size, m.seq_length
    text = torch.randint(0, m.vocab_size, (b, n + 1), generator=g)
    mask = (torch.rand(b, n, generator=g) > 0.2).float()
    shard = slice(dims.sp_rank * n // sp, (dims.sp_rank + 1) * n // sp)
    positions = torch.arange(n).expand(b, n)
    return text[:, :-1][:, shard], positions[:, shard], text[:, 1:][:, shard], mask[:, shard]


def loss_and_grads(cfg, dims, autocast_dtype=None, attention_mask_fn=None):
    model_parallel_seed(cfg.train.seed, dims)
    model = GPTModel(
        cfg.model, seed=cfg.train.seed, sequence_parallel=cfg.parallel.sequence_parallel, dims=dims
    )
    tokens, positions, labels, mask = _batch(cfg, dims)
    mask_arg = attention_mask_fn(cfg) if attention_mask_fn else None
    if isinstance(mask_arg, torch.Tensor):  # a dense reference mask: the tests' own attention
        use_dense_masks(model)
    with (
        torch.autocast("cpu", dtype=autocast_dtype)
        if autocast_dtype
        else torch.autocast("cpu", enabled=False)
    ):
        losses = model(tokens, positions, mask_arg, labels=labels)
    (losses * mask).sum().backward()
    return losses.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def compare_runs(
    rank,
    world,
    base_argv,
    option_argv,
    sizes,
    autocast_dtype=None,
    attention_mask_fn=None,
    option_mask_fn=None,
):
    """(max |loss diff| / max |loss|, max over params of max|grad diff| / max|grad|) between
    base_argv and base_argv + option_argv (each with its own attention mask function)."""
    tp, sp = sizes
    dims = ps.initialize_model_parallel(tp, sp, 1)
    base = validate(resolve(parse_args(base_argv, world)))
    option = validate(resolve(parse_args(base_argv + option_argv, world)))
    ref_loss, ref_grads = loss_and_grads(base, dims, autocast_dtype, attention_mask_fn)
    loss, grads = loss_and_grads(option, dims, autocast_dtype, option_mask_fn or attention_mask_fn)
    loss_diff = float((loss - ref_loss).abs().max() / ref_loss.abs().max())
    grad_diff = max(
        float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30))
        for n, g in ref_grads.items()
    )
    return loss_diff, grad_diff


def slow_except(default: set, names) -> list:
    """Parameter names, those outside `default` marked slow (run with --run-slow)."""
    return [n if n in default else pytest.param(n, marks=pytest.mark.slow) for n in names]
