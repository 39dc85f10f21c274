"""Token dispatchers: bring each (token, expert) pair's row to the EP rank that holds the
expert, grouped by local expert, and bring the experts' outputs back, weighted by the router's
probabilities and summed per token (megatron-core's MoEAlltoAllTokenDispatcher and
MoEAllGatherTokenDispatcher, token_dispatcher.py).

Pairs are ordered expert-major, tokens ascending within an expert (one stable sort on the
device, no per-token Python). The experts need their row counts on the host (to split rows, and
for the all-to-all's split sizes): that is the ONE host sync of a layer's forward, a single
device-to-host copy of the counts (the all-to-all dispatcher first exchanges them with one
small all-to-all). Backward reuses them: no sync.

Both dispatchers take tokens [T, h], probs [T, E] and the routing map [T, E] of the ranks'
own tokens, and the EP group; `dispatch` returns (rows grouped by local expert, counts per local
expert, state for `combine`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...mpu.comm_stats import record
from ...mpu.mappings import (
    all_gather,
    gather_from_sequence_parallel_region,
    group_size,
    reduce_scatter_to_sequence_parallel_region,
)

DISPATCHERS = ("alltoall", "allgather")


def expert_major_pairs(routing_map: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token index, flat [E, T] index) of the `total` routed pairs, expert-major."""
    num_tokens = routing_map.shape[0]
    chosen = routing_map.t().reshape(-1)
    order = torch.argsort((~chosen).to(torch.int8), stable=True)[:total]
    return order % num_tokens, order


class _AllToAllV(torch.autograd.Function):
    """Rows to the ranks of `group` in `send` sized blocks; `recv` sized blocks come back.
    Backward: the same exchange with the sizes swapped."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.sizes, ctx.group = (send, recv), group
        return _all_to_all_v(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        send, recv = ctx.sizes
        return _all_to_all_v(grad, recv, send, ctx.group), None, None, None


def _all_to_all_v(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    x = x.contiguous()
    record("all_to_all", x, group)
    dist.all_to_all_single(out, x, recv, send, group=group)
    return out


def _regroup(rows: torch.Tensor, counts: list[list[int]]) -> torch.Tensor:
    """Blocks laid out [a][b] (counts[a][b] rows each) re-laid [b][a]: per-block Python, no
    per-row work."""
    blocks = rows.split([n for row in counts for n in row])
    width = len(counts[0]) if counts else 0
    order = [a * width + b for b in range(width) for a in range(len(counts))]
    return torch.cat([blocks[i] for i in order]) if order else rows


@dataclass
class _State:
    token_index: torch.Tensor  # [pairs]: which token each pair's row belongs to
    probs: torch.Tensor  # [pairs]: its routing probability
    num_tokens: int
    send: list[int]  # rows sent to each EP rank (all-to-all)
    recv: list[int]
    received: list[list[int]]  # [source][local expert] rows (all-to-all)


class AllToAllDispatcher:
    def __init__(self, num_experts: int, ep_group):
        self.num_experts, self.group = num_experts, ep_group
        self.ep = group_size(ep_group)
        self.num_local = num_experts // self.ep

    def dispatch(self, tokens, probs, routing_map):
        ep, local = self.ep, self.num_local
        per_expert = routing_map.sum(0)  # [E] on the device
        if ep > 1:
            # How many rows each source sends to each of my experts: [EP, local].
            incoming = torch.empty_like(per_expert)
            record("all_to_all", per_expert, self.group)
            dist.all_to_all_single(incoming, per_expert.contiguous(), group=self.group)
            counts = torch.cat([per_expert, incoming]).tolist()  # the one host sync
            mine, theirs = counts[: self.num_experts], counts[self.num_experts :]
        else:
            mine = theirs = per_expert.tolist()  # the one host sync
        send = [sum(mine[r * local : (r + 1) * local]) for r in range(ep)]
        received = [theirs[r * local : (r + 1) * local] for r in range(ep)]
        token_index, flat = expert_major_pairs(routing_map, sum(mine))
        pair_probs = probs.t().reshape(-1)[flat]
        rows = tokens[token_index]
        state = _State(token_index, pair_probs, tokens.shape[0], send, [], received)
        if ep > 1:
            state.recv = [sum(r) for r in received]
            rows = _AllToAllV.apply(rows, send, state.recv, self.group)
            rows = _regroup(rows, received)  # (source, expert) -> (expert, source)
        counts_local = [sum(r[i] for r in received) for i in range(local)]
        return rows, counts_local, state

    def combine(self, out: torch.Tensor, state: _State) -> torch.Tensor:
        if self.ep > 1:
            by_expert = [list(col) for col in zip(*state.received)]  # [expert][source]
            out = _regroup(out, by_expert)  # back to (source, expert)
            out = _AllToAllV.apply(out, state.recv, state.send, self.group)
        weighted = out * state.probs.unsqueeze(-1).to(out.dtype)
        result = out.new_zeros((state.num_tokens, out.shape[-1]))
        return result.index_add(0, state.token_index, weighted)


class AllGatherDispatcher:
    """Every EP rank gathers all EP ranks' tokens and keeps the pairs of its own experts;
    the outputs are reduce-scattered back (autograd duals of each other)."""

    def __init__(self, num_experts: int, ep_group):
        self.num_experts, self.group = num_experts, ep_group
        self.ep = group_size(ep_group)
        self.num_local = num_experts // self.ep
        self.first = (dist.get_rank(ep_group) if ep_group is not None else 0) * self.num_local

    def dispatch(self, tokens, probs, routing_map):
        if self.ep > 1:
            tokens = gather_from_sequence_parallel_region(tokens, True, group=self.group)
            probs = gather_from_sequence_parallel_region(probs, True, group=self.group)
            routing_map = all_gather(routing_map, 0, self.group)
        local = slice(self.first, self.first + self.num_local)
        local_map = routing_map[:, local]
        counts = local_map.sum(0).tolist()  # the one host sync
        token_index, flat = expert_major_pairs(local_map, sum(counts))
        pair_probs = probs[:, local].t().reshape(-1)[flat]
        state = _State(token_index, pair_probs, tokens.shape[0], [], [], [])
        return tokens[token_index], counts, state

    def combine(self, out: torch.Tensor, state: _State) -> torch.Tensor:
        weighted = out * state.probs.unsqueeze(-1).to(out.dtype)
        result = out.new_zeros((state.num_tokens, out.shape[-1]))
        result = result.index_add(0, state.token_index, weighted)
        if self.ep > 1:
            result = reduce_scatter_to_sequence_parallel_region(result, self.group)
        return result
