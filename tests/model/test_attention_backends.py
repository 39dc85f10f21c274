"""The attention backends' protocol and table (model/attention/backends.py): a new kernel is one
class and one row, and then the run, the log, --dry-run and the start-up check all name it."""

import logging
from dataclasses import replace

import torch

from megatron_ul.model.attention import backends
from megatron_ul.model.attention.backends import AttentionBackend, kernel_refusal, select
from megatron_ul.model.attention.dispatch import AttentionCall
from megatron_ul.model.attention.layer import LayerAttention, local_attention
from megatron_ul.mpu.random import MODEL_PARALLEL_RNG, get_rng_tracker

CPU = torch.device("cpu")


class WrittenOutSoftmax(AttentionBackend):
    """A toy kernel: causal softmax attention written out in fp64, taking only fp64 calls."""

    paths = frozenset({"causal"})
    name = "written-out softmax"  # type: ignore[assignment]
    calls = 0

    @classmethod
    def refusal(cls, call):
        return None if call.dtype == torch.float64 else "fp64 only"

    def forward(self, q, k, v, call, *, documents, ring, softmax_scale):
        type(self).calls += 1
        n, hq, hk = q.shape[0], q.shape[2], k.shape[2]
        kx, vx = (t.repeat_interleave(hq // hk, dim=2) for t in (k, v))
        scores = torch.einsum("ibhd,jbhd->bhij", q, kx) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return torch.einsum("bhij,jbhd->ibhd", scores.softmax(-1), vx)


def test_a_new_kernel_is_one_class_and_one_table_row(monkeypatch, caplog):
    monkeypatch.setattr(backends, "TABLE", (WrittenOutSoftmax, *backends.TABLE))
    monkeypatch.setattr(backends, "_announced", set())
    monkeypatch.setattr(WrittenOutSoftmax, "calls", 0)
    get_rng_tracker().reset("cpu")
    get_rng_tracker().add(MODEL_PARALLEL_RNG, 0)
    call = AttentionCall(CPU, torch.float64, 8, 4, 2)
    assert isinstance(select(call), WrittenOutSoftmax)
    assert kernel_refusal(call) is None
    # it refuses fp32: the next row that serves the path runs
    assert select(replace(call, dtype=torch.float32)).name == "sdpa cpu-flash"
    assert backends.planned_kernel(call) == "written-out softmax"  # --dry-run names it
    q = torch.randn(16, 1, 4, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(16, 1, 2, 8, dtype=torch.float64, requires_grad=True) for _ in "kv")
    layer = LayerAttention()
    with caplog.at_level(logging.INFO, logger=backends.__name__):
        out = layer(q, k, v, dropout_p=0.0)
        layer(q, k, v, dropout_p=0.0)  # selected once for this kind of call
    assert WrittenOutSoftmax.calls == 2
    assert [r.getMessage() for r in caplog.records] == [
        "attention: causal = written-out softmax (cpu)"
    ]
    with monkeypatch.context() as patch:  # an independent reference: the table without it
        patch.setattr(backends, "TABLE", backends.TABLE[1:])
        reference = local_attention(q, k, v, backend="sdpa", dropout_p=0.0)
    torch.testing.assert_close(out, reference)


def test_the_selection_returns_typed_backends_the_call_sites_run():
    """The ring decides its unit kernels once, as objects; the document paths and SDPA are
    rows of the same table."""
    ring = select(AttentionCall(CPU, torch.float32, 8, 4, 4, True, 4, ring=True))
    assert isinstance(ring, backends.RingUnits) and ring.cut
    assert ring.dense is ring.masked is backends.lse_kernels.CPU_FLASH
    assert ring.name == "ring: cpu-flash / cpu-flash" and ring.log_name == "cpu-flash / cpu-flash"
    assert isinstance(
        select(AttentionCall(CPU, torch.float32, 8, 4, 4, True)), backends.DocumentBlocks
    )
    cuda = AttentionCall(
        torch.device("cuda"), torch.float32, 64, 8, 2, gpu=backends.MODELLED_GPUS["sm80 (A100)"]
    )
    sdpa = select(cuda)
    assert isinstance(sdpa, backends.TorchSdpa) and sdpa.backend == "efficient" and sdpa.expand_kv


def test_block_sparse_is_a_row_of_the_table_the_run_the_dry_run_and_the_check_ask():
    """--sparse-attention: select() returns the block-sparse rows (one rank, the ring) on the
    table's unit kernels; the start-up check refuses a head dim the CUDA kernel cannot align,
    naming the flags, and attention dropout; the log names the pattern."""
    from megatron_ul.model.attention.block_sparse import SparseHeads
    from megatron_ul.sparsity_config import SparsityPattern

    sparse = SparseHeads(SparsityPattern.create("fixed", block=8), num_heads=4)
    call = AttentionCall(CPU, torch.float32, 8, 4, 2, sparse=sparse)
    assert isinstance(select(call), backends.BlockSparse)
    assert select(call).name == "block-sparse fixed: cpu-flash"
    ring = replace(call, ring=True, documents=True)
    assert isinstance(select(ring), backends.BlockSparseRing)
    assert select(ring).name == "ring block-sparse fixed: cpu-flash / cpu-flash"
    assert backends.attention_path(ring) == "ring block-sparse fixed + documents"
    cuda = replace(call, device=torch.device("cuda"), dtype=torch.bfloat16, head_dim=36)
    assert "--kv-channels" in kernel_refusal(cuda)  # 36 is not a multiple of 8
    assert select(replace(cuda, head_dim=64)).name == "block-sparse fixed: sdpa-efficient"
    assert backends.planned_kernel(replace(call, head_dim=64)) == (
        "block-sparse fixed: sdpa-efficient"
    )
    assert "--attention-dropout" in kernel_refusal(replace(call, dropout=0.1))
