"""Ring attention (load-balanced chunks r and 2R-1-r) equals plain causal attention on the full
sequence, forward and backward, for MHA and GQA, with and without a document mask and a sliding
window; it computes only the chunk × chunk units that the masks do not exclude; and it composes
with Ulysses (hybrid U×R) inside DistributedAttention."""

import math

import torch

from megatron_ul.data.sequence_layout import rank_positions, ring_local_positions
from megatron_ul.model.attention.documents import DocumentMask
from megatron_ul.model.attention.layer import LayerAttention, ring_attention
from megatron_ul.model.attention.ring import Ring, measure_ring_time
from megatron_ul.model.attention.ulysses import DistributedAttention
from megatron_ul.mpu import comm_stats
from megatron_ul.mpu import parallel_state as ps
from megatron_ul.mpu.random import model_parallel_seed
from tests.dense_masks import dense_document_mask
from tests.distributed import run_distributed

N, B, D = 32, 2, 4
CASES = [(4, 4), (4, 2), (4, 1)]  # (query heads, kv heads)
# At R = 4 (chunks of 4 tokens): window 1 excludes whole ring steps for some ranks (rank 0's
# chunks 0 and 7 see nothing of rank 2's chunks 2 and 5); window 5 cuts units and skips others.
WINDOWS = (None, 1, 5)


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


def window_mask(window, mask=None):
    """`mask` (default: causal), and no query sees a key more than `window` tokens back."""
    if mask is None:
        mask = ~torch.ones(N, N, dtype=torch.bool).tril()
    if window is None:
        return mask
    distance = torch.arange(N).unsqueeze(1) - torch.arange(N).unsqueeze(0)
    return mask | (distance > window)


def needed_units(mask, ring_rank, ring_size):
    """How many chunk × chunk units of the full score matrix hold at least one visible pair
    for this ring rank's queries (its two chunks against all 2R chunks)."""
    c = N // (2 * ring_size)
    visible = ~mask
    return sum(
        bool(visible[..., i * c : (i + 1) * c, j * c : (j + 1) * c].any())
        for i in (ring_rank, 2 * ring_size - 1 - ring_rank)
        for j in range(2 * ring_size)
    )


def documents(starts=(5, 19), batch_rows=(0,)):
    """Documents starting at `starts` in the batch rows given (the other rows hold one
    document), as the data pipeline gives them: offsets over the flattened batch."""
    offsets = [
        row * N + s for row in range(B) for s in ((0, *starts) if row in batch_rows else (0,))
    ]
    return DocumentMask(torch.tensor(offsets + [B * N], dtype=torch.int32), B)


def document_mask(starts=(5, 19), batch_rows=(0,)):
    """The dense reference mask of documents(starts, batch_rows): causal, and no attention
    across documents."""
    return dense_document_mask(documents(starts, batch_rows))


def _inputs(hq, hk):
    g = torch.Generator().manual_seed(hq * 100 + hk)
    return [torch.randn(N, B, h, D, generator=g, dtype=torch.float64) for h in (hq, hk, hk)]


def _compare(attend, positions, hq, hk, mask, label):
    full = [t.requires_grad_() for t in _inputs(hq, hk)]
    mine = [t.detach()[positions].clone().requires_grad_() for t in full]
    out = attend(*mine)
    ref = reference_attention(*full, mask=mask)
    torch.testing.assert_close(out, ref.detach()[positions], msg=f"forward {label}")
    weights = torch.randn(
        ref.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64
    )
    (out * weights[positions]).sum().backward()
    (ref * weights).sum().backward()
    for name, a, b in zip("qkv", mine, full):
        torch.testing.assert_close(a.grad, b.grad[positions], msg=f"grad {name} {label}")


def _check_ring(rank, world):
    ring = Ring.from_dims(ps.initialize_model_parallel(1, 1, 1, context_parallel_size=world))
    positions = ring_local_positions(ring.rank, ring.size, N)
    computed = {}
    for docs in (None, documents()):
        for window in WINDOWS:
            mask = window_mask(window, None if docs is None else dense_document_mask(docs))
            for hq, hk in CASES:
                with measure_ring_time() as times:
                    _compare(
                        lambda q, k, v, d=docs, w=window: ring_attention(
                            q, k, v, ring, documents=d, window=w
                        ),
                        positions,
                        hq,
                        hk,
                        mask,
                        f"R={world} hq={hq} hk={hk} documents={docs is not None} window={window}",
                    )
                computed[docs is not None, window] = (
                    times["forward_blocks"],
                    needed_units(mask, ring.rank, world),
                )
    if world == 2:
        _check_half_precision(ring, positions)
        return computed, _count_skipped_blocks(ring)
    sent = _count_ring_bytes(ring, world)
    return computed, sent, _check_hybrid(rank, world)


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
    full_weights[positions] = weights  # the other ranks' outputs do not enter this loss...
    (ref * full_weights).sum().backward()
    # ...so only this rank's dq is comparable (dk, dv also collect the other ranks' queries)
    torch.testing.assert_close(mine[0].grad.float(), full[0].grad[positions], atol=2e-2, rtol=2e-2)


def _count_skipped_blocks(ring):
    """R = 2, chunks of 8: documents [0, 8), [8, 24), [24, 32) exclude both ranks' second
    block (rank 0's tokens 24.. never see 8..23; rank 1's 8..23 never see 0..7)."""
    docs = documents(starts=(8, 24), batch_rows=range(B))
    mask = dense_document_mask(docs)
    positions = ring_local_positions(ring.rank, ring.size, N)
    with measure_ring_time() as times:
        _compare(
            lambda q, k, v: ring_attention(q, k, v, ring, documents=docs),
            positions,
            4,
            2,
            mask,
            "R=2 document-aligned mask",
        )
    return times["forward_blocks"]


def _count_ring_bytes(ring, world):
    """p2p bytes of one forward and backward, with the narrowest window (the ring still
    carries every block: a rank with nothing to compute passes k/v and dk/dv on)."""
    q, k, v = (t[: N // world].clone().requires_grad_() for t in _inputs(4, 2))
    with comm_stats.count_communication() as counts:
        out = ring_attention(q, k, v, ring, window=1)
        forward = counts["p2p"]["bytes"]
        out.sum().backward()
    return forward, counts["p2p"]["bytes"] - forward


def _assert_only_needed_units(computed):
    """Each forward computed exactly the units that hold a visible pair."""
    for (documents, window), (done, needed) in computed.items():
        assert done == needed, (documents, window, done, needed)


def test_ring_attention_skips_blocks_a_document_mask_excludes_r2():
    """R = 2, chunks of 8: documents [0, 8), [8, 24), [24, 32) leave rank 0 (chunks 0 and 3)
    two of its four causal units and rank 1 (chunks 1 and 2) three."""
    results = run_distributed(_check_ring, 2)
    for computed, _ in results:
        _assert_only_needed_units(computed)
    assert [units for _, units in results] == [2, 3]


def test_ring_r4_and_hybrid_u2r2_match_full_attention_and_send_what_they_should():
    """Also: each k/v block is sent R-1 times forward; backward sends it R-1 times again plus
    its dk/dv accumulator R times (one last hop home), whatever the window skips; only the
    units a window or document mask leaves visible are computed (window 1 leaves some ranks
    whole steps with nothing to compute)."""
    world = 4
    kv_bytes = 2 * (N // world) * B * 2 * D * 8  # k and v, float64
    for computed, (forward, backward), hybrid_ok in run_distributed(_check_ring, world):
        _assert_only_needed_units(computed)
        assert computed[False, None][1] == 2 * world + 1  # causal: 3 + 2(R-1) units
        assert computed[False, 1][1] < computed[False, 5][1] < computed[False, None][1]
        assert forward == (world - 1) * kv_bytes
        assert backward == (world - 1) * kv_bytes + world * kv_bytes
        assert hybrid_ok


def _check_hybrid(rank, world):
    ulysses = 2
    dims = ps.initialize_model_parallel(1, ulysses, 1, context_parallel_size=world // ulysses)
    model_parallel_seed(0, dims)
    ring = Ring.from_dims(dims)
    positions = rank_positions(N, dims.sp_rank, ulysses, ring.rank, ring.size)
    for window in (None, 5):
        attention = DistributedAttention(
            ulysses, LayerAttention(window=window, ring=ring), dims.sp_group
        )
        for hq, hk in CASES:  # kv heads 1 < U: replicated before the all-to-all
            _compare(
                lambda q, k, v, a=attention: a(q, k, v, dropout_p=0.0),
                positions,
                hq,
                hk,
                window_mask(window),
                f"U2xR{world // ulysses} hq={hq} hk={hk} window={window}",
            )
    return True


def _check_flash_ring(rank, world):
    """bf16, head dim 16, documents: the ring's unmasked units run flash-attn's private
    functions (the stand-in of the release the fixture chose), the masked ones the CPU flash
    kernel; forward and this rank's dq equal fp32 attention up to bf16 rounding."""
    import flash_attn  # the stand-in (fixture): counts its calls in this rank

    ring = Ring.from_dims(ps.initialize_model_parallel(1, 1, 1, context_parallel_size=world))
    positions = ring_local_positions(ring.rank, ring.size, N)
    g = torch.Generator().manual_seed(11)
    full = [
        torch.randn(N, B, h, 16, generator=g).bfloat16().float().requires_grad_() for h in (4, 2, 2)
    ]
    mine = [t.detach()[positions].bfloat16().requires_grad_() for t in full]
    docs = documents()
    out = ring_attention(*mine, ring, documents=docs, backend="flash")
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out.float() * weights).sum().backward()
    ref = reference_attention(*full, mask=dense_document_mask(docs))
    torch.testing.assert_close(out.float(), ref.detach()[positions], atol=2e-2, rtol=2e-2)
    full_weights = torch.zeros(ref.shape)
    full_weights[positions] = weights
    (ref * full_weights).sum().backward()
    torch.testing.assert_close(mine[0].grad.float(), full[0].grad[positions], atol=2e-2, rtol=2e-2)
    return flash_attn.calls["_flash_attn_forward"], flash_attn.calls["_flash_attn_backward"]


def test_ring_flash_path_under_each_flash_attn_release_r2(flash_attn_stand_in):
    for forward_calls, backward_calls in run_distributed(_check_flash_ring, 2):
        assert forward_calls > 0 and backward_calls > 0
