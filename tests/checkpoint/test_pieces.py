"""checkpoint/storage/pieces.py: a rank's flat range of its TP-local tensor becomes rectangular
pieces of the global tensor that cover exactly that range, at the right places, as contiguous
views."""

import pytest
import torch

from megatron_ul.checkpoint.storage.pieces import clip_rows, pieces_of
from megatron_ul.mpu.layers import tp_slice
from megatron_ul.mpu.param_spec import ParamSpec

CASES = [
    ((12, 5), ParamSpec(0, 1)),
    ((12, 5), ParamSpec(0, 2)),  # column-parallel, [gate; up]
    ((6, 8), ParamSpec(1, 1)),  # row-parallel
    ((12,), ParamSpec(0, 2)),
    ((7, 3), ParamSpec()),
    ((9,), ParamSpec()),
]


@pytest.mark.parametrize("shape,spec", CASES)
def test_pieces_tile_the_rank_range(shape, spec):
    full = torch.randn(*shape)  # distinct values: a misplaced piece cannot match
    for tp in (1, 2):
        d = spec.partition_dim
        if d is not None and shape[d] % (tp * spec.partition_stride):
            continue
        for rank in range(tp):
            local = (
                tp_slice(full, d, spec.partition_stride, tp, rank).contiguous()
                if d is not None
                else full
            )
            n = local.numel()
            for lo, hi in [(0, n), (1, n - 2), (3, 4), (5, n)]:  # partial rows at both ends
                data = local.reshape(-1)[lo:hi].clone()
                for block_bytes in (8, 1 << 30):
                    got, hits = torch.zeros(shape), torch.zeros(shape)
                    for p in pieces_of(data, tuple(local.shape), lo, spec, tp, rank, block_bytes):
                        assert p.tensor.is_contiguous()
                        assert data.data_ptr() <= p.tensor.data_ptr()  # a view, not a copy
                        where = tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes))
                        got[where] += p.tensor
                        hits[where] += 1
                    assert hits.max() <= 1 and hits.sum() == hi - lo
                    assert torch.equal(got[hits.bool()], full[hits.bool()])


def test_clip_rows_splits_off_padding_rows():
    t = torch.arange(12.0).view(6, 2)
    pieces = pieces_of(t, (6, 2), 0, ParamSpec(0, 1, vocab_padded=True), 1, 0, 16)
    kept, beyond = clip_rows(pieces, 5)
    assert sum(p.sizes[0] for p in kept) == 5 and sum(b.shape[0] for b in beyond) == 1
    assert torch.equal(beyond[0], t[5:])
