"""Greedy and top-k / top-p (nucleus) sampling on one process.

The model is loaded from a checkpoint of any layout, merged to TP1/PP1 in memory (see
checkpoint/layout/reshard.py). No KV cache: each new token re-runs the (cropped) context, which is
plenty for a quick look at what a model learned.
"""

from __future__ import annotations

import os

import torch

from ..checkpoint import files
from ..checkpoint.files import CheckpointError
from ..checkpoint.layout import reshard
from ..checkpoint.layout.zero import load_model_state
from ..checkpoint.state import named_parameters
from ..model.gpt import GPTModel
from ..mpu.parallel_state import single_rank_dims


def sample_next(
    logits: torch.Tensor,
    *,
    top_k: int = 0,
    top_p: float = 0.0,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> int:
    """One token id from logits [vocab]. top_k == 0 and top_p == 0 means greedy."""
    if top_k <= 0 and top_p <= 0.0:
        return int(logits.argmax())
    logits = logits.float() / max(temperature, 1e-6)
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p > 0.0:
        ordered, order = torch.sort(logits, descending=True)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative - ordered.softmax(-1) >= top_p  # keep the smallest set reaching top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


def load_for_generation(load_dir: str, device="cpu") -> GPTModel:
    """The latest checkpoint in `load_dir` as a TP1/PP1 model in eval mode (parallel state for
    world 1 must be initialised)."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load {load_dir}: no such directory")
    iteration = files.read_tracker(load_dir)
    if iteration is None:
        raise CheckpointError(
            f"{os.path.join(load_dir, files.TRACKER)}: missing; no complete "
            f"checkpoint in {load_dir}"
        )
    full = reshard.read_full(files.find_iteration_dir(load_dir, iteration), with_optim=False)
    cfg = reshard.model_config(full.metadata)
    cfg.attention_dropout = cfg.hidden_dropout = 0.0
    cfg.attention_block_tiles = 1  # a training memory option; contexts here have any length
    model = GPTModel(cfg, seed=0, device=device, dims=single_rank_dims())  # no communication
    table = reshard.layout_table(full.metadata, 1, 1, None)
    state, _ = reshard.shard_for(full, table, list(named_parameters(model)), 0, 1)
    load_model_state(model, state, files.find_iteration_dir(load_dir, iteration))
    return model.eval()


@torch.no_grad()
def generate(
    model: GPTModel,
    prompt: list[int],
    max_new_tokens: int,
    *,
    top_k: int = 0,
    top_p: float = 0.0,
    temperature: float = 1.0,
    eod: int | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The prompt's continuation (new token ids only)."""
    if not prompt:
        raise ValueError("the prompt is empty after tokenization; give at least one token")
    ids, window = list(prompt), model.cfg.max_position_embeddings
    device = next(model.parameters()).device
    new = []
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-window:]], device=device)
        positions = torch.arange(context.shape[1], device=device).unsqueeze(0)
        logits = model(context, positions)[-1, 0, : model.cfg.vocab_size]
        token = sample_next(
            logits, top_k=top_k, top_p=top_p, temperature=temperature, generator=generator
        )
        ids.append(token)
        new.append(token)
        if eod is not None and token == eod:
            break
    return new
