"""DeepSpeed-Ulysses attention: all-to-all ∘ local attention ∘ all-to-all.

Every SP rank holds N/SP tokens of q, k and v for all of its (TP-local) heads. All-to-alls
of q, k and v (the paper's 3Nh, one exchange per tensor) leave each rank the full sequence
for heads/SP heads; attention runs locally; a second all-to-all (Nh) brings the output back
to sequence shards. Sequence-first tensors make the gathered sequence land in global order.

GQA: each SP rank needs the kv heads of its query heads. When the TP-local kv heads cannot be
split evenly over SP, each kv head is replicated (repeat_interleave: head j's copies stay
adjacent, so query head i still meets kv head i // group) by the smallest factor r that makes
kv_heads·r divisible by SP. Each rank attends lcm(kv_heads, SP)/SP kv heads, but receives only
the distinct ones among them (kv_heads_to_send; 12 q / 6 kv heads at SP 4: 2 instead of 3) and
rebuilds the replicated layout locally after the all-to-all.

Hybrid Ulysses × ring (--context-parallel-size R): the all-to-all gathers this ring rank's
local sequence (N/R tokens) instead of the whole one, and ring attention (ring.py) runs across
the R ring ranks in place of local attention.

This module is communication only: which kernel attends the gathered heads is the layer's
LayerAttention's (backends.py) decision.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ...mpu.mappings import ulysses_all_to_all
from ...timers import NO_TIMERS, Timers
from .documents import DocumentMask
from .layer import LayerAttention
from .local import require_one_dtype


def kv_replication_factor(kv_heads: int, sp: int) -> int:
    """Smallest r such that kv_heads * r is divisible by sp."""
    return sp // math.gcd(kv_heads, sp)


def kv_heads_to_send(kv_heads: int, sp: int, r: int, rank: int, device=None):
    """(send, unpack) index tensors when replicated kv heads would put one head on a rank
    twice, else (None, None). With kv heads replicated r-fold, rank j attends replicated heads
    [j·c, (j+1)·c) (c = kv_heads·r/SP), i.e. original heads (j·c + t) // r, often fewer than c
    distinct ones (12 q / 6 kv heads at SP 4: c = 3, 2 distinct). send [SP, m] picks each
    rank's m distinct heads (padded by repeating the last one); unpack [c] rebuilds this rank's
    replicated layout from them after the all-to-all, so the bytes on the wire fall by m/c."""
    if r == 1:
        return None, None
    c = kv_heads * r // sp
    needed = [sorted({(j * c + t) // r for t in range(c)}) for j in range(sp)]
    m = max(len(n) for n in needed)
    if m == c:
        return None, None
    send = torch.tensor([n + n[-1:] * (m - len(n)) for n in needed], device=device)
    unpack = torch.tensor(
        [needed[rank].index((rank * c + t) // r) for t in range(c)], device=device
    )
    return send, unpack


class DistributedAttention:
    """Callable: (q [N/SP, b, hq, d], k, v [N/SP, b, hk, d]) -> [N/SP, b, hq, d]."""

    def __init__(self, sp_size: int, attention: LayerAttention, group, timers: Timers = NO_TIMERS):
        self.sp, self.attention, self.group = sp_size, attention, group
        self.timers = timers  # times the all-to-alls (--timing-log-level)
        self._kv_index_cache: dict = {}

    def _kv_indices(self, kv_heads: int, r: int, device):
        """kv_heads_to_send's index tensors, made on the device once (not per call: a host
        list copied to a GPU every layer and micro-batch would make the host wait)."""
        key = (kv_heads, r, device)
        if key not in self._kv_index_cache:
            rank = dist.get_rank(self.group)
            self._kv_index_cache[key] = kv_heads_to_send(kv_heads, self.sp, r, rank, device)
        return self._kv_index_cache[key]

    def _to_heads(self, x, send=None, unpack=None):
        """x [N/SP, b, h, d] -> [N, b, h/SP, d] through one all-to-all; with kv_heads_to_send's
        `send`, each rank receives only its distinct heads and `unpack` rebuilds its
        replicated layout."""
        if send is None:
            return ulysses_all_to_all(
                x, scatter_dim=2, gather_dim=0, group=self.group, timers=self.timers
            )
        s, b, _, d = x.shape
        sp, m = send.shape
        # [SP·m, s, b, d]: rank j's distinct heads, contiguous per rank, picked and laid out
        # for the send in one copy.
        picked = x.permute(2, 0, 1, 3)[send.flatten()]
        del x
        got = ulysses_all_to_all(
            picked, scatter_dim=0, gather_dim=0, group=self.group, timers=self.timers
        )
        del picked
        # [SP (source rank), s, b, c, d]: the replicated layout rebuilt in sequence order in
        # one copy, then [N, b, c, d] as a view.
        heads = got.view(sp, m, s, b, d).permute(0, 2, 3, 1, 4)[:, :, :, unpack]
        return heads.reshape(sp * s, b, -1, d)

    def __call__(
        self,
        q,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        *,
        dropout_p: float,
        documents: DocumentMask | None = None,
    ) -> torch.Tensor:
        """(q, k, v), or one list [q, k, v] that is emptied: a caller handing over its only
        references lets each of q, k and v die once copied into its send buffer."""
        if isinstance(q, list):
            handed_over = q
            q, k, v = handed_over
            handed_over.clear()
        assert k is not None and v is not None
        sp = self.sp
        require_one_dtype(q, k, v)
        if sp == 1:
            return self.attention(q, k, v, dropout_p=dropout_p, documents=documents)
        r = kv_replication_factor(k.shape[2], sp)
        send_kv, unpack_kv = self._kv_indices(k.shape[2], r, k.device)
        if send_kv is None and r > 1:
            k, v = k.repeat_interleave(r, dim=2), v.repeat_interleave(r, dim=2)
        # all-to-all #1, one per tensor: scatter heads (dim 2), gather sequence (dim 0) ->
        # [N, b, h/SP, d] each. Each is popped before its exchange so that, handed over, it
        # dies once copied into its send buffer, and the send buffer once sent; the backward
        # exchanges each gradient straight from the kernel's dq, dk, dv (one copy each, where
        # one packed exchange for all three would first concatenate them).
        pending = [q, k, v]
        del q, k, v
        q_full = self._to_heads(pending.pop(0))
        k_full = self._to_heads(pending.pop(0), send_kv, unpack_kv)
        v_full = self._to_heads(pending.pop(0), send_kv, unpack_kv)
        out = self.attention(q_full, k_full, v_full, dropout_p=dropout_p, documents=documents)
        del q_full, k_full, v_full
        # all-to-all #2: scatter sequence (dim 0), gather heads (dim 2) -> [N/SP, b, hq, d]
        return ulysses_all_to_all(
            out, scatter_dim=0, gather_dim=2, group=self.group, timers=self.timers
        )
