"""TP layers, Megatron-SP mappings and vocab-parallel cross entropy against plain PyTorch
(fp64), forward and backward, on 2 TP ranks."""

import torch
import torch.nn.functional as F

from megatron_ul.mpu import parallel_state as ps
from megatron_ul.mpu.cross_entropy import vocab_parallel_cross_entropy
from megatron_ul.mpu.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron_ul.mpu.param_init import FromFull
from tests.distributed import run_distributed

S, B, H_IN, H_OUT, VOCAB, PADDED = 8, 3, 6, 10, 13, 16


def _fill(seed):
    def init(w):
        w.copy_(_full(seed, *w.shape))

    return FromFull(init)


def _full(seed, *shape):
    # Layers initialise their master weight in fp32: draw values that fp32 represents exactly.
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).double()


def _check_mlp(rank, world, dims, sequence_parallel):
    """Column -> Row parallel MLP equals the dense computation; grads match their slices."""
    tp_rank = dims.tp_rank
    x_full = _full(0, S, B, H_IN).requires_grad_()
    col = ColumnParallelLinear(
        H_IN,
        H_OUT,
        _fill(1),
        sequence_parallel=sequence_parallel,
        dtype=torch.float64,
        tp_group=dims.tp_group,
    )
    row = RowParallelLinear(
        H_OUT,
        H_IN,
        _fill(2),
        sequence_parallel=sequence_parallel,
        dtype=torch.float64,
        tp_group=dims.tp_group,
    )
    with torch.no_grad():
        col.bias.copy_(_full(3, H_OUT).chunk(world)[tp_rank])
        row.bias.copy_(_full(4, H_IN))
    x = (
        (x_full.detach().chunk(world, 0)[tp_rank] if sequence_parallel else x_full.detach())
        .clone()
        .requires_grad_()
    )
    y = row(torch.tanh(col(x)))
    y.pow(2).sum().backward()

    w1r, b1r = _full(1, H_OUT, H_IN).requires_grad_(), _full(3, H_OUT).requires_grad_()
    w2r, b2r = _full(2, H_IN, H_OUT).requires_grad_(), _full(4, H_IN).requires_grad_()
    y_ref = F.linear(torch.tanh(F.linear(x_full, w1r, b1r)), w2r, b2r)
    y_ref.pow(2).sum().backward()

    mine = (lambda t: t.chunk(world, 0)[tp_rank]) if sequence_parallel else (lambda t: t)
    torch.testing.assert_close(y, mine(y_ref.detach()))
    torch.testing.assert_close(x.grad, mine(x_full.grad))
    torch.testing.assert_close(col.weight.grad, w1r.grad.chunk(world, 0)[tp_rank])
    torch.testing.assert_close(col.bias.grad, b1r.grad.chunk(world, 0)[tp_rank])
    torch.testing.assert_close(row.weight.grad, w2r.grad.chunk(world, 1)[tp_rank])
    # Under Megatron-SP the replicated row bias sees only this rank's tokens: the partial
    # gradients must sum (over TP) to the dense one.
    bias_grad = row.bias.grad.clone()
    if sequence_parallel:
        torch.distributed.all_reduce(bias_grad, group=dims.tp_group)
    torch.testing.assert_close(bias_grad, b2r.grad)
    return True


def _check_swiglu_stride(rank, world, dims):
    """stride=2 gives each rank matching chunks of both halves ([gate; up]) of the weight."""
    tp_rank = dims.tp_rank
    col = ColumnParallelLinear(
        H_IN, 2 * H_OUT, _fill(1), stride=2, dtype=torch.float64, tp_group=dims.tp_group
    )
    gate, up = _full(1, 2 * H_OUT, H_IN).chunk(2, 0)
    expected = torch.cat([gate.chunk(world, 0)[tp_rank], up.chunk(world, 0)[tp_rank]])
    torch.testing.assert_close(col.weight.detach(), expected)
    return True


def _check_embedding_and_cross_entropy(rank, world, dims):
    tp_rank = dims.tp_rank
    ids = torch.randint(0, VOCAB, (S, B), generator=torch.Generator().manual_seed(5))
    emb = VocabParallelEmbedding(
        PADDED, H_IN, _fill(6), dtype=torch.float64, tp_group=dims.tp_group
    )
    out = emb(ids)
    table = _full(6, PADDED, H_IN).requires_grad_()
    ref = F.embedding(ids, table)
    torch.testing.assert_close(out, ref.detach())
    out.pow(3).sum().backward()
    ref.pow(3).sum().backward()
    torch.testing.assert_close(emb.weight.grad, table.grad.chunk(world, 0)[tp_rank])

    logits_full = _full(7, S, B, PADDED).requires_grad_()
    local = logits_full.detach().chunk(world, -1)[tp_rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, ids, VOCAB, dims.tp_group)
    # reference: padded rows (ids >= VOCAB) take no part in the softmax
    ref_loss = F.cross_entropy(
        logits_full[..., :VOCAB].reshape(-1, VOCAB), ids.reshape(-1), reduction="none"
    ).view(S, B)
    torch.testing.assert_close(loss, ref_loss.detach())
    weights = _full(8, S, B)
    (loss * weights).sum().backward()
    (ref_loss * weights).sum().backward()
    torch.testing.assert_close(local.grad, logits_full.grad.chunk(world, -1)[tp_rank])
    return True


CHECKS = {
    "column/row parallel MLP": lambda r, w, d: _check_mlp(r, w, d, sequence_parallel=False),
    "column/row parallel MLP under Megatron-SP": lambda r, w, d: _check_mlp(r, w, d, True),
    "SwiGLU stride-2 sharding": _check_swiglu_stride,
    "vocab-parallel embedding and cross entropy": _check_embedding_and_cross_entropy,
}


def _run_checks(rank, world):
    """All TP-layer checks in one spawn of 2 ranks (spawning costs more than checking)."""
    dims = ps.initialize_model_parallel(world, 1, 1)
    for name, check in CHECKS.items():
        try:
            check(rank, world, dims)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from e
    return sorted(CHECKS)


def test_tp_layers_match_dense_pytorch():
    assert run_distributed(_run_checks, 2) == [sorted(CHECKS)] * 2
