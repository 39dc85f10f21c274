"""Forward-backward schedules over the micro-batches of one global batch.

The loss each rank backpropagates is sum(token losses · mask) / (tokens in the whole global
batch, over all DP and SP ranks), so gradients summed over dp_cp_sp give exactly the gradient of
the global token-mean loss, for every layout and every loss mask. Under pipelining the loss
exists only on the last stage; the other stages return a zero loss sum (step.py broadcasts the
last stage's value over the pp group).

Pipelined schedules are written as an ordered list of operations per rank, ("F" or "B",
model chunk, micro-batch), cut into communication steps: after each step one batched p2p call
sends what the step produced and receives what the next step needs, and completes before the
next step runs (p2p.py says why NCCL needs this). The orders and steps are Megatron's:
  1F1B: warm-up of min(PP - r - 1, m) forwards, then one forward / one backward, then the
    remaining backwards; every operation is a step (send_forward_recv_backward after a
    steady-state forward, send_backward_recv_forward after its backward).
  interleaved 1F1B: the same over m·v virtual micro-batches, with a warm-up of
    2·(PP - r - 1) + (v - 1)·PP, and virtual micro-batch k running on model chunk
    (k mod PP·v) div PP (reversed for backwards); a steady-state forward and the backward
    after it are one step (send_forward_backward_recv_forward_backward), the rest one each.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from ..model.attention.documents import document_mask_of
from ..model.chunks import activation_dtype, model_chunks, model_dims
from ..timers import NO_TIMERS, Timers
from .p2p import StageCommunicator


def micro_batch_loss_sum(model, batch: dict) -> torch.Tensor:
    """Sum over this rank's tokens of the masked per-token loss of one micro-batch."""
    losses = model(
        batch["tokens"], batch["position_ids"], document_mask_of(batch), labels=batch["labels"]
    )
    return (losses * batch["loss_mask"]).sum()


def forward_backward_no_pipelining(
    model,
    micro_batches: list[dict],
    num_tokens: torch.Tensor,
    forward_only: bool = False,
    timers: Timers = NO_TIMERS,
) -> torch.Tensor:
    """Run every micro-batch forward and backward on this rank; return the detached sum of
    masked token losses (not yet divided by num_tokens)."""
    total = torch.zeros((), dtype=torch.float32, device=num_tokens.device)
    for batch in micro_batches:
        with (
            timers("forward"),
            torch.no_grad() if forward_only else contextlib.nullcontext(),
        ):
            loss_sum = micro_batch_loss_sum(model, batch)
        if not forward_only:
            with timers("backward"):
                (loss_sum / num_tokens).backward()
        total += loss_sum.detach().float()
    return total


# ---- operation orders ---------------------------------------------------------------------------
def one_f_one_b_order(
    pipeline_size: int, pp_rank: int, num_micro_batches: int, forward_only: bool = False
) -> list[tuple[str, int, int]]:
    """Megatron's non-interleaved 1F1B order on one rank: [(op, chunk=0, micro-batch)]."""
    m = num_micro_batches
    if forward_only:
        return [("F", 0, i) for i in range(m)]
    warmup = min(pipeline_size - pp_rank - 1, m)
    order = [("F", 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", 0, warmup + i), ("B", 0, i)]
    return order + [("B", 0, i) for i in range(m - warmup, m)]


def interleaved_order(
    pipeline_size: int,
    pp_rank: int,
    num_micro_batches: int,
    chunks: int,
    forward_only: bool = False,
) -> list[tuple[str, int, int]]:
    """Megatron's interleaved 1F1B order on one rank: [(op, model chunk, micro-batch)]."""
    return [
        op
        for step in interleaved_steps(
            pipeline_size, pp_rank, num_micro_batches, chunks, forward_only
        )
        for op in step
    ]


def interleaved_steps(
    pipeline_size: int,
    pp_rank: int,
    num_micro_batches: int,
    chunks: int,
    forward_only: bool = False,
) -> list[tuple]:
    """The interleaved order cut into communication steps, as Megatron communicates it: each
    warm-up forward and each cool-down backward is a step, and in the steady state a forward
    and the backward after it form one step (both run, then one batch sends both results)."""
    p, v = pipeline_size, chunks
    total = num_micro_batches * v

    def chunk_and_micro_batch(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k % (p * v)) // p
        micro_batch = (k // (p * v)) * p + k % p
        return (chunk if forward else v - 1 - chunk), micro_batch

    if forward_only or num_micro_batches == p:  # Megatron: all forwards, then all backwards
        warmup = total
    else:
        warmup = min(2 * (p - pp_rank - 1) + (v - 1) * p, total)
    forward = [("F", *chunk_and_micro_batch(k, True)) for k in range(total)]
    if forward_only:
        return [(op,) for op in forward]
    backward = [("B", *chunk_and_micro_batch(k, False)) for k in range(total)]
    steps: list[tuple] = [(op,) for op in forward[:warmup]]
    steps += [(forward[warmup + k], backward[k]) for k in range(total - warmup)]
    return steps + [(op,) for op in backward[total - warmup :]]


# ---- execution ---------------------------------------------------------------------------
def activation_shape(chunk, batch: dict) -> tuple[int, int, int]:
    """[N/SP (÷TP under Megatron-SP), b, h] of the hidden states between stages."""
    b, local_seq = batch["tokens"].shape
    if chunk.sequence_parallel:
        local_seq //= chunk.dims.tp
    return local_seq, b, chunk.cfg.hidden_size


def _messages(chunk, op: str) -> tuple[bool, bool]:
    """(receives, sends) of one operation: a forward receives an activation unless its chunk
    is the first virtual stage and sends one unless it is the last; a backward receives and
    sends the gradients the other way round."""
    first, last = chunk.pre_process, chunk.post_process
    return (not first, not last) if op == "F" else (not last, not first)


def run_pipeline_steps(
    model,
    micro_batches: list[dict],
    num_tokens: torch.Tensor,
    steps: list[tuple],
    forward_only: bool = False,
    timers: Timers = NO_TIMERS,
) -> torch.Tensor:
    """Execute one rank's operations, step by step; returns the detached loss sum (zero off
    the last stage). After each step ONE batch (p2p.py) sends what the step produced and
    receives what the next step needs, so every batch pairs with the neighbours' batches."""
    chunks = model_chunks(model)
    device = num_tokens.device
    dtype = activation_dtype(model)  # half precision, or fp32 (residual or fp32 model)
    comm = StageCommunicator(
        activation_shape(chunks[0], micro_batches[0]), dtype, device, model_dims(model)
    )
    total = torch.zeros((), dtype=torch.float32, device=device)
    saved: dict[tuple[int, int], tuple] = {}  # (chunk, micro-batch) -> (input, output)
    received = _exchange(comm, {}, steps[0], chunks)
    for s, step in enumerate(steps):
        outgoing: dict[str, torch.Tensor] = {}  # "F": activation, "B": gradient to send
        for op, c, i in step:
            chunk, batch = chunks[c], micro_batches[i]
            if op == "F":
                inp = received["F"]
                if inp is not None:
                    inp.requires_grad_(not forward_only)
                with (
                    timers("forward"),
                    torch.no_grad() if forward_only else contextlib.nullcontext(),
                ):
                    out = chunk(
                        batch["tokens"],
                        batch["position_ids"],
                        document_mask_of(batch),
                        labels=batch["labels"] if chunk.post_process else None,
                        hidden_states=inp,
                    )
                if chunk.post_process:
                    out = (out * batch["loss_mask"]).sum()
                    total += out.detach().float()
                    out = out / num_tokens
                else:
                    out = outgoing["F"] = out.to(dtype)
                if not forward_only:
                    saved[(c, i)] = (inp, out)
            else:
                inp, out = saved.pop((c, i))
                with timers("backward"):
                    torch.autograd.backward(out, grad_tensors=received["B"])
                if not chunk.pre_process:
                    outgoing["B"] = inp.grad
        received = _exchange(comm, outgoing, steps[s + 1] if s + 1 < len(steps) else (), chunks)
    return total


def _exchange(
    comm: StageCommunicator, outgoing: dict, following: tuple, chunks
) -> dict[str, torch.Tensor | None]:
    """Send a step's results and receive the `following` step's inputs in one batch; returns
    {"F": activation or None, "B": gradient or None} for the following step."""
    needs = {op: _messages(chunks[c], op)[0] for op, c, _ in following}
    activation, gradient = comm.communicate(
        send_forward=outgoing.get("F"),
        send_backward=outgoing.get("B"),
        recv_forward=needs.get("F", False),
        recv_backward=needs.get("B", False),
    )
    return {"F": activation, "B": gradient}


def forward_backward_pipelining_without_interleaving(
    model,
    micro_batches,
    num_tokens,
    forward_only=False,
    timers: Timers = NO_TIMERS,
):
    dims = model_dims(model)
    steps = [
        (op,) for op in one_f_one_b_order(dims.pp, dims.pp_rank, len(micro_batches), forward_only)
    ]
    return run_pipeline_steps(model, micro_batches, num_tokens, steps, forward_only, timers)


def forward_backward_pipelining_with_interleaving(
    model,
    micro_batches,
    num_tokens,
    forward_only=False,
    timers: Timers = NO_TIMERS,
):
    dims = model_dims(model)
    steps = interleaved_steps(
        dims.pp, dims.pp_rank, len(micro_batches), len(model_chunks(model)), forward_only
    )
    return run_pipeline_steps(model, micro_batches, num_tokens, steps, forward_only, timers)


def get_forward_backward_func(pipeline_size: int, chunks: int = 1) -> Callable:
    """The schedule for a layout: no pipelining, 1F1B, or interleaved 1F1B."""
    if pipeline_size == 1:
        return forward_backward_no_pipelining
    if chunks == 1:
        return forward_backward_pipelining_without_interleaving
    return forward_backward_pipelining_with_interleaving
