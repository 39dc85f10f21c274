"""Run the real pipeline schedules on a tiny GPT, one thread per stage, under the NCCL p2p
stand-in (tests/stand_ins/nccl_p2p.py), and compare the loss and gradients with one process."""

from __future__ import annotations

import dataclasses
import functools

import torch

from megatron_ul.model.gpt import GPTModel
from megatron_ul.mpu.parallel_state import single_rank_dims
from megatron_ul.mpu.random import model_parallel_seed
from megatron_ul.pipeline.model import (
    PipelineStageModel,
    build_stage_chunks,
    global_named_parameters,
    replicated_name,
)
from megatron_ul.pipeline.schedules import forward_backward_no_pipelining, get_forward_backward_func
from megatron_ul.training.pretrain import configure
from tests.stand_ins.nccl_p2p import Group, run_ranks

SEQ, MICRO_BATCH, VOCAB, SEED = 8, 2, 64, 5


@functools.cache
def model_config(layers: int):
    return configure(
        [
            "--mock-data",
            "--vocab-size",
            str(VOCAB),
            "--num-layers",
            str(layers),
            "--hidden-size",
            "16",
            "--num-attention-heads",
            "2",
            "--seq-length",
            str(SEQ),
            "--attention-dropout",
            "0",
            "--hidden-dropout",
            "0",
        ],
        1,
    ).model


def micro_batches(count: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)
        out.append(
            {
                "tokens": tokens[:, :-1],
                "labels": tokens[:, 1:],
                "position_ids": torch.arange(SEQ).expand(MICRO_BATCH, SEQ),
                "loss_mask": torch.ones(MICRO_BATCH, SEQ),
            }
        )
    return out


def stage_dims(pp: int, rank: int, group: Group):
    base = single_rank_dims()
    return dataclasses.replace(
        base,
        pp=pp,
        coords={**base.coords, "pp": rank},
        groups=dataclasses.replace(base.groups, pp=group),
        group_ranks=dataclasses.replace(base.group_ranks, pp=list(group.ranks)),
        embedding_ranks=sorted({0, pp - 1}),
    )


def summed_grads(models) -> dict[str, torch.Tensor]:
    """Gradient per global parameter name, the tied embedding's copies summed (what the
    embedding all-reduce does)."""
    grads: dict[str, torch.Tensor] = {}
    for model in models:
        for name, p in global_named_parameters(model):
            name = replicated_name(name)
            grads[name] = grads.get(name, 0) + p.grad
    return grads


def run_pipeline(
    pp: int,
    chunks: int,
    num_micro_batches: int,
    forward_only: bool = False,
    eager_bytes: int = 0,
    layers_per_chunk: int = 1,
):
    """(loss sum, gradients) of one global batch through the schedule of PP `pp` with `chunks`
    model chunks per stage, under NCCL p2p semantics."""
    cfg = model_config(pp * chunks * layers_per_chunk)
    group = Group(tuple(range(pp)))
    model_parallel_seed(SEED, single_rank_dims())  # dropout is off: the streams draw nothing
    models = []
    for rank in range(pp):  # built here, not in the threads: initialisation is seeded
        models.append(
            PipelineStageModel(
                build_stage_chunks(
                    cfg, SEED, False, pp, rank, chunks, "cpu", dims=stage_dims(pp, rank, group)
                )
            )
        )
    batches = micro_batches(num_micro_batches)
    num_tokens = torch.tensor(float(num_micro_batches * MICRO_BATCH * SEQ))
    schedule = get_forward_backward_func(pp, chunks)

    def stage(rank: int):
        return schedule(models[rank], batches, num_tokens, forward_only=forward_only)

    losses = run_ranks(stage, pp, eager_bytes=eager_bytes)
    return losses[-1], (None if forward_only else summed_grads(models))


@functools.cache
def run_reference(layers: int, num_micro_batches: int):
    """(loss sum, gradients) of the same batch in one process, without pipelining."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend on a loaded machine
    try:
        model_parallel_seed(SEED, single_rank_dims())
        model = GPTModel(model_config(layers), seed=SEED, dims=single_rank_dims())
        num_tokens = torch.tensor(float(num_micro_batches * MICRO_BATCH * SEQ))
        loss = forward_backward_no_pipelining(model, micro_batches(num_micro_batches), num_tokens)
    finally:
        torch.set_num_threads(threads)
    return loss, {name: p.grad for name, p in model.named_parameters()}
