"""The model takes its process groups from the ParallelDims it is handed, not from globals."""

import dataclasses

import torch
import torch.distributed as dist

from megatron_ul.config import ModelConfig
from megatron_ul.model.gpt import GPTModel
from megatron_ul.mpu import parallel_state as ps
from megatron_ul.mpu.random import model_parallel_seed
from tests.distributed import run_distributed

CFG = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    vocab_size=100,
    make_vocab_size_divisible_by=8,
    attention_dropout=0.0,
    hidden_dropout=0.0,
    max_position_embeddings=16,
)


def _build_with_own_groups(rank, world):
    run_dims = ps.initialize_model_parallel(2, 2, 1)  # TP2 × SP2
    model_parallel_seed(1, run_dims)
    # The same ranks as fresh group objects: a model handed these must use them everywhere.
    # (new_group is collective over the world: every rank creates every group, in order.)
    fresh = {tuple(ranks): dist.new_group(ranks) for ranks in ([0, 1], [2, 3], [0, 2], [1, 3])}
    tp_group = fresh[tuple(run_dims.group_ranks.tp)]  # rank = tp + 2·sp
    sp_group = fresh[tuple(run_dims.group_ranks.sp)]
    own = dataclasses.replace(
        run_dims, groups=dataclasses.replace(run_dims.groups, tp=tp_group, sp=sp_group)
    )
    model = GPTModel(CFG, seed=3, dims=own)
    reference = GPTModel(CFG, seed=3, dims=run_dims)  # the run's groups
    groups = {m.tp_group for m in model.modules() if hasattr(m, "tp_group")}
    cores = {m.core.group for m in model.modules() if hasattr(m, "core")}
    tokens = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    positions = (torch.arange(8) + 8 * run_dims.sp_rank).expand(2, 8)
    loss = model(tokens, positions, labels=tokens).sum()
    loss_ref = reference(tokens, positions, labels=tokens).sum()
    loss.backward()
    return {
        "tp_is_own": groups == {tp_group},
        "sp_is_own": cores == {sp_group},
        "same_loss": torch.equal(loss.detach(), loss_ref.detach()),
    }


def test_model_uses_the_groups_it_is_handed():
    for result in run_distributed(_build_with_own_groups, 4):
        assert result == {"tp_is_own": True, "sp_is_own": True, "same_loss": True}
