#!/usr/bin/env python
"""Our Ulysses layer (model/attention/ulysses.py) side by side with DeepSpeed's
DistributedAttention and ALST's UlyssesSPAttentionHF (Arctic Long Sequence Training, in
DeepSpeed 0.19.8).

All three wrap the same local attention around their all-to-alls, on the same gloo ranks, the
same inputs [N/SP, b, heads, d] and upstream gradient: outputs and input gradients are compared
with ours bit for bit, each layer's forward + backward is timed (rounds alternate the layers and
the fastest of each is kept: noise on a shared machine only adds), and the bytes each rank
sends through all_to_all_single are counted (all three end there). The local attention is
either SDPA (the real layer) or a nearly free sum of q, k and v, which leaves the layers' own
work (all-to-alls, layout copies) as what is timed.

DeepSpeed is an optional, benchmark-only dependency (DS_BUILD_OPS=0, a venv of its own):

    python -m venv --system-site-packages /work/venvs/ds
    DS_BUILD_OPS=0 /work/venvs/ds/bin/pip install --no-deps deepspeed psutil hjson py-cpuinfo \\
        msgpack ninja einops
    /work/venvs/ds/bin/python -m tools.bench.bench_vs_deepspeed [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_ul.model.attention.layer import LayerAttention, local_attention
from megatron_ul.model.attention.ulysses import DistributedAttention
from megatron_ul.mpu import parallel_state as ps
from megatron_ul.mpu.random import model_parallel_seed
from tools.bench.common import markdown_table, report, run_ranks

MB = 1e6
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LAYERS = ("ours", "DeepSpeed", "ALST")


@contextmanager
def counted_all_to_all(group_size: int, rank: int):
    """{'bytes': ...}: bytes this rank sends to other ranks through all_to_all_single."""
    sent = {"bytes": 0}
    real = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
        row = input[0].numel() * input.element_size() if input.dim() else input.element_size()
        splits = input_split_sizes or [input.shape[0] // group_size] * group_size
        sent["bytes"] += sum(s for j, s in enumerate(splits) if j != rank) * row
        return real(output, input, output_split_sizes, input_split_sizes, **kwargs)

    # patched on purpose: counts the bytes, then sends them
    dist.all_to_all_single = counting  # type: ignore[assignment]
    try:
        yield sent
    finally:
        dist.all_to_all_single = real


class CountedWrites(TorchDispatchMode):
    """Bytes the ops write: every output, new or written in place, views (outputs that alias
    an input without writing it), allocations that write nothing (empty) and the collectives
    (what they fill is the wire's, counted apart) excluded. A layer's layout copies,
    deterministic where its times are noisy."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d" or func.__name__.startswith(("empty", "new_empty")):
            return out
        returns = func._schema.returns
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        inputs = {
            a.untyped_storage().data_ptr()
            for a in tree_leaves((args, kwargs))
            if torch.is_tensor(a)
        }
        for i, t in enumerate(outputs):
            alias = returns[i].alias_info if i < len(returns) else None
            if not torch.is_tensor(t):
                continue
            written = alias is not None and alias.is_write
            if written or t.untyped_storage().data_ptr() not in inputs:
                self.bytes += t.numel() * t.element_size()
        return out


def _deepspeed_layer(dims, kv_heads: int, attend):
    """DeepSpeed's DistributedAttention: (q, k, v) [N/SP, b, h, d] -> [N/SP, b, hq, d]."""
    from deepspeed.sequence.layer import DistributedAttention as DeepSpeedAttention
    from deepspeed.utils import groups

    class _SequenceGroup:  # what DeepSpeed's uneven-head path asks for the SP rank
        def get_sequence_parallel_rank(self):
            return dims.sp_rank

        def get_sequence_parallel_group(self):
            return dims.sp_group

        def get_sequence_parallel_world_size(self):
            return dims.sp

    groups.mpu = _SequenceGroup()
    layer = DeepSpeedAttention(
        attend, dims.sp_group, scatter_idx=2, gather_idx=0, num_kv_heads=kv_heads
    )
    return lambda q, k, v: layer(q, k, v, 1)  # batch dim 1


def _alst_layer(dims, seq: int, heads: int, kv_heads: int, head_dim: int, attend):
    """ALST's UlyssesSPAttentionHF around the same local attention, or None where it refuses
    the head counts (kv heads neither a multiple nor a divisor of SP). It takes and gives
    Hugging Face's layouts: q, k, v [b, h, N/SP, d] in, [b, N/SP, hq·d] out."""
    if kv_heads % dims.sp and dims.sp % kv_heads:
        return None
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    def hf_attention(module, q, k, v, attention_mask, *args, **kwargs):
        # Hugging Face's attention interface: [b, h, N, d] in, ([b, N, h, d], weights) out
        out = attend(*(t.permute(2, 0, 1, 3) for t in (q, k, v)))
        return out.permute(1, 0, 2, 3), None

    local = seq // dims.sp
    layer = UlyssesSPAttentionHF(
        hf_attention,
        batch_size=1,
        attn_head_count=heads,
        attn_head_size=head_dim,
        kv_head_count=kv_heads,
        num_hidden_layers=1,
        process_group=dims.sp_group,
        local_seq_length=local,
        global_seq_length=seq,
    )
    module = torch.nn.Module()  # the HF attention module its forward reads (.training)
    positions = torch.arange(local)[None] + dims.sp_rank * local

    def call(q, k, v):
        out, _ = layer(
            module, *(t.permute(1, 2, 0, 3) for t in (q, k, v)), None, position_ids=positions
        )
        return out.transpose(0, 1).reshape(q.shape)  # back to [N/SP, b, hq, d]

    return call


def _local_attention_fn(kind: str):
    """The local attention all three layers wrap: 'sdpa' (model/attention/layer.py's call) or
    'sum' (q plus k and v broadcast to q's heads: nearly free, so the layers' own work, the
    all-to-alls and layout copies, is what is timed)."""
    if kind == "sdpa":
        return lambda q, k, v: local_attention(q, k, v, backend="sdpa", dropout_p=0.0)

    def summed(q, k, v):
        group = q.shape[2] // k.shape[2]
        return q + k.repeat_interleave(group, dim=2) + v.repeat_interleave(group, dim=2)

    return summed


def compare(dims, rank, world, seq, heads, kv_heads, head_dim, dtype_name, attention, rounds):
    """Per layer in LAYERS (None where it refuses the case): (bit-equal output against ours,
    bit-equal input gradients, fastest forward + backward: wall s and this rank's thread CPU
    s, MB this rank sends, MB its ops write)."""
    attend = _local_attention_fn(attention)
    ulysses = DistributedAttention(world, LayerAttention(), dims.sp_group)
    layers = {
        "ours": lambda q, k, v: ulysses(q, k, v, dropout_p=0.0),
        "DeepSpeed": _deepspeed_layer(dims, kv_heads, attend),
        "ALST": _alst_layer(dims, seq, heads, kv_heads, head_dim, attend),
    }
    if attention != "sdpa":  # our layer calls local_attention itself: swap it for this case
        # a bare kernel in the layer's place: same call, no LayerAttention behind it
        ulysses.attention = lambda q, k, v, dropout_p, documents: attend(q, k, v)  # type: ignore[assignment]
    dtype = DTYPES[dtype_name]
    g = torch.Generator().manual_seed(rank)
    shapes = [heads, kv_heads, kv_heads]
    inputs = [torch.randn(seq // world, 1, h, head_dim, generator=g).to(dtype) for h in shapes]
    dout = torch.randn(seq // world, 1, heads, head_dim, generator=g).to(dtype)

    def run(call):
        leaves = [t.clone().requires_grad_() for t in inputs]
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.thread_time()
        # q, k, v come out of an op, as out of the QKV projection in a model: a leaf's
        # gradient would be copied into the leaf's layout, which no layer pays in a model.
        q, k, v = (t * 1 for t in leaves)
        out = call(q, k, v)
        out.backward(dout)
        took = (time.perf_counter() - start, time.thread_time() - start_cpu)
        return took, out.detach(), [t.grad for t in leaves]

    first, sent_mb, written_mb = {}, {}, {}
    for name, call in layers.items():
        if call is not None:
            with counted_all_to_all(world, dims.sp_rank) as sent, CountedWrites() as written:
                first[name] = run(call)
            sent_mb[name] = sent["bytes"] / MB
            written_mb[name] = written.bytes / MB
    # The first run (counted, under dispatch modes) is not timed.
    best = {name: (float("inf"), float("inf")) for name in first}
    for _ in range(max(rounds, 1)):  # alternating: load on a shared machine hits all alike
        for name in first:
            took = run(layers[name])[0]
            best[name] = (min(best[name][0], took[0]), min(best[name][1], took[1]))
    _, out_ours, grads_ours = first["ours"]
    results: dict[str, tuple | None] = {}
    for name in LAYERS:
        if name not in first:
            results[name] = None
            continue
        _, out, grads = first[name]
        same_out = torch.equal(out, out_ours)
        same_grads = all(torch.equal(a, b) for a, b in zip(grads, grads_ours))
        results[name] = (same_out, same_grads, *best[name], sent_mb[name], written_mb[name])
    return results


def compare_all(rank, world, cases, rounds):
    """compare() for every (N, q heads, kv heads, dtype, local attention) case, in one
    process group."""
    torch.set_num_threads(1)
    dims = ps.initialize_model_parallel(1, world, 1)
    model_parallel_seed(1, dims, "cpu")
    os.environ.setdefault("DS_BUILD_OPS", "0")
    import deepspeed.comm

    if not deepspeed.comm.is_initialized():
        deepspeed.comm.init_distributed(
            dist_backend="gloo", auto_mpi_discovery=False, verbose=False
        )
    results = []
    for seq, heads, kv_heads, dtype, attention in cases:
        results.append(
            compare(dims, rank, world, seq, heads, kv_heads, 64, dtype, attention, rounds)
        )
        if rank == 0:  # progress: a long matrix on a shared machine
            print(
                f"SP{world} N={seq} {heads}/{kv_heads} {dtype} {attention}: {results[-1]}",
                flush=True,
            )
    return results


def _row(case, per_rank):
    seq, sp, heads, kv_heads, _, attention = case

    def slowest(name, i):  # the slowest rank's time
        return max(r[name][i] for r in per_rank)

    row = [seq, sp, f"{heads}/{kv_heads}", attention, f"{slowest('ours', 2) * 1e3:.0f}"]
    ratios, equal = [], []
    sent, written = [f"{slowest('ours', 4):.2f}"], [f"{slowest('ours', 5):.1f}"]
    for name in LAYERS[1:]:
        if per_rank[0][name] is None:
            row.append("refuses")
            ratios += ["-", "-"]
            equal.append("-")
            sent.append("-")
            written.append("-")
            continue
        written.append(f"{slowest(name, 5):.1f}")
        row.append(f"{slowest(name, 2) * 1e3:.0f}")
        ratios += [f"{slowest('ours', i) / slowest(name, i):.2f}" for i in (2, 3)]
        same_out = all(r[name][0] for r in per_rank)
        same_grads = all(r[name][1] for r in per_rank)
        equal.append(f"{'yes' if same_out else 'NO'}/{'yes' if same_grads else 'NO'}")
        sent.append(f"{slowest(name, 4):.2f}")
    return row + ratios + equal + ["/".join(sent), "/".join(written)]


def table(cases, rounds: int) -> str:
    results = {}
    for sp in sorted({case[1] for case in cases}):  # one spawn per SP: DeepSpeed imports slowly
        mine = [(n, h, kv, dt, att) for n, s, h, kv, dt, att in cases if s == sp]
        for case, per_rank in zip(mine, zip(*run_ranks(compare_all, sp, mine, rounds))):
            key = (case[0], sp, *case[1:])
            results[key] = per_rank
    rows = [_row(case, results[case]) for case in cases]
    return markdown_table(
        [
            "N",
            "SP",
            "q/kv heads",
            "local attention",
            "ours ms",
            "DeepSpeed ms",
            "ALST ms",
            "ours / DeepSpeed, wall",
            "ours / DeepSpeed, CPU",
            "ours / ALST, wall",
            "ours / ALST, CPU",
            "DeepSpeed bit-equal (out/grads)",
            "ALST bit-equal (out/grads)",
            "MB sent, max rank (ours/DeepSpeed/ALST)",
            "MB written by ops, max rank (ours/DeepSpeed/ALST)",
        ],
        rows,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--seq-lengths",
        type=int,
        nargs="*",
        default=[4096, 8192],
        help="N for the layers around SDPA (the real layer)",
    )
    ap.add_argument(
        "--overhead-seq-lengths",
        type=int,
        nargs="*",
        default=[4096, 8192, 16384],
        help="N for the layers around the 'sum' local attention (their own work alone)",
    )
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--heads", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gqa-seq-length", type=int, default=4096, help="0: no GQA case")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args(argv)
    lengths = [(n, "sdpa") for n in args.seq_lengths]
    lengths += [(n, "sum") for n in args.overhead_seq_lengths]
    cases = [
        (n, sp, h, h, args.dtype, att)
        for n, att in lengths
        for sp in args.sizes
        for h in args.heads
    ]
    if args.gqa_seq_length:
        cases += [(args.gqa_seq_length, 4, 12, 6, args.dtype, att) for att in ("sdpa", "sum")]
    report(
        "vs-deepspeed",
        "Ulysses layer vs DeepSpeed's DistributedAttention and ALST's UlyssesSPAttentionHF "
        "(CPU, gloo)",
        f"One attention layer (all-to-alls + the same local attention), forward + backward, "
        f"micro-batch 1, head dim 64, {args.dtype}, one thread per rank; all three layers get "
        f"the same inputs and upstream gradient, and their outputs and input gradients are "
        f"compared with ours bit for bit. Local attention 'sdpa': model/attention/layer.py's "
        f"SDPA call (the real layer); 'sum': q plus k and v broadcast to q's heads, nearly free, "
        f"so the time is the layers' own all-to-alls and layout copies. Time: the fastest of "
        f"{max(args.rounds, 1)} rounds that alternate the layers, after one untimed run, max "
        f"over ranks, as wall time and as the rank's thread CPU time (what the rank computes, "
        f"not what it waits for: robust to other load on a shared machine). MB sent: what each "
        f"rank sends through all_to_all_single in forward + backward; MB written: the bytes "
        f"every op of the untimed run writes (outputs and in-place writes; views, empty "
        f"allocations and the collectives excluded), deterministic; both max over ranks.",
        table(cases, args.rounds),
        write_docs=args.write_docs,
    )


if __name__ == "__main__":
    main()
