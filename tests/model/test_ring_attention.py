"""Ring attention (load-balanced chunks r and 2R-1-r) equals plain causal attention on the full
sequence, forward and backward, for MHA and GQA, with and without a document mask; and it
composes with Ulysses (hybrid U×R) inside DistributedAttention."""
import math

import torch

from megatron_ul.model.ring_attention import Ring, measure_ring_time, ring_attention
from megatron_ul.model.ulysses import DistributedAttention
from megatron_ul.mpu import comm_stats
from megatron_ul.mpu import parallel_state as ps
from megatron_ul.mpu.random import model_parallel_seed
from megatron_ul.data.sequence_layout import rank_positions, ring_local_positions
from tests.distributed import run_distributed

N, B, D = 32, 2, 4
CASES = [(4, 4), (4, 2), (4, 1)]  # (query heads, kv heads)


def reference_attention(q, k, v, mask=None):
    """Causal softmax attention written out; mask [b, 1, N, N] True = masked (incl. causal)."""
    hq, hk = q.shape[2], k.shape[2]
    kv_of = torch.arange(hq) // (hq // hk)
    k, v = k[:, :, kv_of], v[:, :, kv_of]
    scores = torch.einsum("nbhd,mbhd->bhnm", q, k) / math.sqrt(q.shape[-1])
    if mask is None:
        mask = ~torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("bhnm,mbhd->nbhd", probs, v)


def document_mask(starts=(5, 19), batch_rows=(0,)):
    """Causal, and no attention across documents starting at `starts` (in the batch rows
    given; the other rows hold one document)."""
    doc = torch.zeros(B, N, dtype=torch.long)
    for row in batch_rows:
        for start in starts:
            doc[row, start:] += 1
    same = doc.unsqueeze(2) == doc.unsqueeze(1)
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    return (~(same & causal)).unsqueeze(1)


def _inputs(hq, hk):
    g = torch.Generator().manual_seed(hq * 100 + hk)
    return [torch.randn(N, B, h, D, generator=g, dtype=torch.float64) for h in (hq, hk, hk)]


def _compare(attend, positions, hq, hk, mask, label):
    full = [t.requires_grad_() for t in _inputs(hq, hk)]
    mine = [t.detach()[positions].clone().requires_grad_() for t in full]
    out = attend(*mine)
    ref = reference_attention(*full, mask=mask)
    torch.testing.assert_close(out, ref.detach()[positions], msg=f"forward {label}")
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7),
                          dtype=torch.float64)
    (out * weights[positions]).sum().backward()
    (ref * weights).sum().backward()
    for name, a, b in zip("qkv", mine, full):
        torch.testing.assert_close(a.grad, b.grad[positions], msg=f"grad {name} {label}")


def _check_ring(rank, world):
    ps.initialize_model_parallel(1, 1, 1, context_parallel_size=world)
    ring = Ring.from_dims(ps.get_parallel_dims())
    positions = ring_local_positions(ring.rank, ring.size, N)
    for mask in (None, document_mask()):
        for hq, hk in CASES:
            _compare(lambda q, k, v, m=mask: ring_attention(q, k, v, ring, attention_mask=m),
                     positions, hq, hk, mask, f"R={world} hq={hq} hk={hk} mask={mask is not None}")
    if world == 2:
        _check_half_precision(ring, positions)
        return _count_skipped_blocks(ring)
    sent = _count_ring_bytes(ring, world)
    ps.destroy_model_parallel()      # the same ranks again as Ulysses 2 × ring R/2
    return sent, _check_hybrid(rank, world)


def _check_half_precision(ring, positions):
    """bf16 inputs under autocast: bf16 output and gradients, fp32-accurate up to bf16
    rounding (the kernel accumulates in fp32 whatever autocast says)."""
    full = [t.float().bfloat16().float().requires_grad_() for t in _inputs(4, 2)]
    mine = [t.detach()[positions].bfloat16().requires_grad_() for t in full]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ring_attention(*mine, ring)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out.float() * weights).sum().backward()
    ref = reference_attention(*full)
    assert out.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in mine)
    torch.testing.assert_close(out.float(), ref.detach()[positions], atol=2e-2, rtol=2e-2)
    full_weights = torch.zeros(ref.shape)
    full_weights[positions] = weights   # the other ranks' outputs do not enter this loss...
    (ref * full_weights).sum().backward()
    # ...so only this rank's dq is comparable (dk, dv also collect the other ranks' queries)
    torch.testing.assert_close(mine[0].grad.float(), full[0].grad[positions], atol=2e-2,
                               rtol=2e-2)


def _count_skipped_blocks(ring):
    """R = 2, chunks of 8: documents [0, 8), [8, 24), [24, 32) exclude both ranks' second
    block (rank 0's tokens 24.. never see 8..23; rank 1's 8..23 never see 0..7)."""
    mask = document_mask(starts=(8, 24), batch_rows=range(B))
    positions = ring_local_positions(ring.rank, ring.size, N)
    with measure_ring_time() as times:
        _compare(lambda q, k, v: ring_attention(q, k, v, ring, attention_mask=mask),
                 positions, 4, 2, mask, "R=2 document-aligned mask")
    return times["forward_blocks"]


def _count_ring_bytes(ring, world):
    q, k, v = (t[:N // world].clone().requires_grad_() for t in _inputs(4, 2))
    with comm_stats.count_communication() as counts:
        out = ring_attention(q, k, v, ring)
        forward = counts["p2p"]["bytes"]
        out.sum().backward()
    return forward, counts["p2p"]["bytes"] - forward


def test_ring_attention_skips_blocks_a_document_mask_excludes_r2():
    assert run_distributed(_check_ring, 2) == [1, 1]


def test_ring_r4_and_hybrid_u2r2_match_full_attention_and_send_what_they_should():
    """Also: each k/v block is sent R-1 times forward; backward sends it R-1 times again plus
    its dk/dv accumulator R times (one last hop home)."""
    world = 4
    kv_bytes = 2 * (N // world) * B * 2 * D * 8     # k and v, float64
    for (forward, backward), hybrid_ok in run_distributed(_check_ring, world):
        assert forward == (world - 1) * kv_bytes
        assert backward == (world - 1) * kv_bytes + world * kv_bytes
        assert hybrid_ok


def _check_hybrid(rank, world):
    ulysses = 2
    dims = ps.initialize_model_parallel(1, ulysses, 1, context_parallel_size=world // ulysses)
    model_parallel_seed(0, dims)
    ring = Ring.from_dims(ps.get_parallel_dims())
    attention = DistributedAttention(ulysses, "sdpa", ps.get_sequence_parallel_group(), ring=ring)
    positions = rank_positions(N, ps.get_sequence_parallel_rank(), ulysses, ring.rank, ring.size)
    for hq, hk in CASES:   # kv heads 1 < U: replicated before the all-to-all
        _compare(lambda q, k, v: attention(q, k, v, dropout_p=0.0), positions, hq, hk, None,
                 f"U2xR{world // ulysses} hq={hq} hk={hk}")
    return True
