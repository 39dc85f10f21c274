"""Everything one GPU can show, in one command, in at most 8 minutes (one H200, torch 2.11,
no flash-attn needed): each table is printed and flushed as it is measured, each row says
PASS, FAIL or SKIP against its stated bound, and an exception in one section becomes a FAIL
row with the error while the next section runs.

  precision     bf16 and fp16 training steps against fp32 (same seed and data), fp16 overflow
  attention     every attention path of the model's attention core on the device (causal,
                GQA, fp32 GQA, documents, sliding window, both) against fp64 dense attention;
                on CUDA SDPA's math kernel is refused (it is O(N²) in memory)
  ring          ring attention over R virtual ranks in one process (tools/gpu_check_attention)
                against the one-device path; per-rank time and memory, memory growth per
                doubling of the local sequence
  offload       --activation-checkpoint-cpu-offload (pinned host memory, side stream on CUDA)
                bit-identical to plain full recompute
  optimizer-offload  --optimizer-cpu-offload of a bf16 model (fp32 gradients held on the
                host): the same losses, a peak lower by the optimizer state and gradients
  checkpoint    torch_dist --async-save, then --load: model and optimizer state bitwise, and
                the continued losses against the uninterrupted run
  adamw         fused AdamW against foreach AdamW
  fused         --fused-layers (torch.compile per layer; inductor on CUDA) against eager layers;
                compile time
  documents     10,000 documents and sliding windows at 128K tokens (two 1.3B-GPT layers):
                step time and max_memory_allocated against the memory estimator
  performance   a 1.3B GPT at 8K, 32K and the longest sequence that fits: tokens/s, TFLOP/s,
                MFU, max_memory_allocated next to --dry-run's estimate

Outside what one GPU can show: multi-rank NCCL, tensor parallelism, sequence parallelism
(Ulysses and Megatron-SP), pipeline parallelism and the ring's communication.

    python -m tools.gpu_check                  # on a GPU
    python -m tools.gpu_check --write-docs     # ... and write the tables into
                                               # docs/benchmarks.md and docs/gpu.md
    python -m tools.gpu_check --cpu            # reduced mode: tiny shapes, the same code
                                               # paths where the CPU allows (the test suite)
    python -m tools.gpu_check --sections ring offload     # some sections only

Exit status 1 when a row FAILs. Runs as one process (a one-rank process group); needs only
the checkout and torch: synthetic tokens, no dataset, no network, no flash-attn or apex.
The modes, bounds and section runner are in tools/gpu_check_runner.py, the training sections in
tools/gpu_check_training.py, the attention cases in tools/gpu_check_attention.py.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import replace

import torch

from megatron_ul.model import attention
from tools import gpu_check_attention as attn
from tools.gpu_check_runner import (
    CPU,
    GPU,
    RING_GROWTH_BOUND,
    RING_VS_ONE_DEVICE_BOUND,
    SCOPE,
    Check,
    Mode,
    Section,
    mib,
    ms,
    release,
    verdict,
)
from tools.gpu_check_training import (
    adamw_rows,
    checkpoint_rows,
    documents_rows,
    fused_rows,
    offload_rows,
    optimizer_offload_rows,
    performance_rows,
    precision_rows,
)


def _attention_cases(mode: Mode, seq: int) -> list:
    hq, hk, d = mode.heads
    bf16, docs, w = torch.bfloat16, max(mode.documents // 1000, 4), mode.window // 8
    return [
        attn.Case("causal, MHA, bf16", seq, hq, hq, d, bf16),
        attn.Case("causal, GQA, bf16", seq, hq, hk, d, bf16),
        attn.Case("causal, GQA, fp32", seq, hq, hk, d, torch.float32),
        attn.Case(f"{docs} documents, GQA, bf16", seq, hq, hk, d, bf16, documents=docs),
        attn.Case(f"window {w}, GQA, bf16", seq, hq, hk, d, bf16, window=w),
        attn.Case(
            f"{docs} documents + window {w}, bf16", seq, hq, hk, d, bf16, documents=docs, window=w
        ),
        attn.Case(
            f"{docs} documents + window {w}, fp32",
            seq,
            hq,
            hk,
            d,
            torch.float32,
            documents=docs,
            window=w,
        ),
    ]


def attention_rows(check: Check):
    device = check.mode.device
    for case in _attention_cases(check.mode, check.mode.attention_seq):
        check.need(5, case.name)
        q, k, v, dout, documents = attn.inputs(case, device)
        reference = attn.dense_reference(q, k, v, dout, documents, case.window)
        try:
            run = attn.one_device(case, q, k, v, dout, documents, device)
        except RuntimeError as e:
            if "No available kernel" not in str(e):
                raise
            yield [
                case.name,
                "-",
                "-",
                "",
                "-",
                "-",
                "FAIL",
                "only SDPA's math kernel (O(N²) memory) takes this call",
            ]
            continue
        out_err, grad_err = attn.errors(run.results, reference)
        out_bound, grad_bound = case.bounds()
        ok = out_err <= out_bound and grad_err <= grad_bound
        yield [
            case.name,
            f"{out_err:.1e}",
            f"{grad_err:.1e}",
            f"{out_bound:g} / {grad_bound:g}",
            ms(run.seconds),
            mib(run.working_mib),
            verdict(ok),
            attn.kernel_of(case, device),
        ]
        del reference, run
        release()


def ring_rows(check: Check):
    mode, device = check.mode, check.mode.device
    hq, hk, d = mode.heads
    w = mode.window // 8
    docs = max(mode.documents // 1000, 4)
    cases = []
    for size in (2, 4):
        n = mode.ring_seq
        cases += [
            (size, attn.Case(f"R={size}, causal, GQA, bf16", n, hq, hk, d, torch.bfloat16)),
            (size, attn.Case(f"R={size}, causal, GQA, fp32", n, hq, hk, d, torch.float32)),
        ]
    cases += [
        (
            4,
            attn.Case(
                f"R=4, {docs} documents, bf16",
                mode.ring_seq,
                hq,
                hk,
                d,
                torch.bfloat16,
                documents=docs,
            ),
        ),
        (
            4,
            attn.Case(f"R=4, window {w}, bf16", mode.ring_seq, hq, hk, d, torch.bfloat16, window=w),
        ),
    ]
    for size, case in cases:
        check.need(10, case.name)
        q, k, v, dout, documents = attn.inputs(case, device)
        full = [t.float() for t in (q, k, v, dout)]
        fq, fk, fv, fdout = full
        reference = attn.one_device(
            replace(case, dtype=torch.float32),
            fq,
            fk,
            fv,
            fdout,
            documents,
            device,
            repeats=1,
            fused_only=False,
        ).results
        ring = attn.virtual_ring(case, size, q, k, v, dout, documents, device)
        out_err, grad_err = attn.errors(ring.results, reference)
        out_bound, grad_bound = case.bounds()
        ok = out_err <= out_bound and grad_err <= grad_bound and ring.converged
        note = f"{attn.kernel_of(case, device, ring=True)}; {ring.passes} passes" + (
            "" if ring.converged else ", no bitwise fixpoint"
        )
        yield [
            case.name,
            f"{out_err:.1e}",
            f"{grad_err:.1e}",
            f"{out_bound:g} / {grad_bound:g}",
            ms(ring.seconds),
            mib(ring.working_mib),
            verdict(ok),
            note,
        ]
        del reference, ring
        release()
    yield from ring_memory_rows(check)


def _cuda_mib(run) -> float:
    """A run's working memory; only CUDA measures it (the rows below skip elsewhere)."""
    if run.working_mib is None:
        raise RuntimeError("no CUDA allocator statistics for this run")
    return run.working_mib


def ring_memory_rows(check: Check):
    """Working memory per virtual rank at two local lengths, and against one-device attention
    at the same tokens per rank (what Ulysses alone would hold: N tokens, heads / R)."""
    mode, device = check.mode, check.mode.device
    hq, hk, d = mode.heads
    size = 4
    if device != "cuda":
        yield [
            "R=4 memory per doubling of C",
            "-",
            "-",
            f"<= {RING_GROWTH_BOUND}x",
            "-",
            "-",
            "SKIP",
            "memory rows need CUDA's allocator statistics",
        ]
        return
    working = []
    for n in mode.ring_growth_seqs:
        check.need(20, f"ring memory at N={n}")
        case = attn.Case(f"R=4, N={n}", n, hq, hk, d, torch.bfloat16)
        q, k, v, dout, _ = attn.inputs(case, device)
        ring = attn.virtual_ring(case, size, q, k, v, dout, None, device)
        per_rank = replace(case, heads=hq // size, kv_heads=max(hk // size, 1))
        oq, ok, ov, odout, _ = attn.inputs(per_rank, device)
        one = attn.one_device(per_rank, oq, ok, ov, odout, None, device)
        del oq, ok, ov, odout
        working.append(_cuda_mib(ring))
        ratio = _cuda_mib(ring) / _cuda_mib(one)
        yield [
            f"R=4 at N={n} (C={n // (2 * size)}) vs one device, heads/R",
            "-",
            "-",
            f"<= {RING_VS_ONE_DEVICE_BOUND}x",
            ms(ring.seconds),
            mib(ring.working_mib),
            verdict(ratio <= RING_VS_ONE_DEVICE_BOUND),
            f"{ratio:.2f}x one-device attention ({mib(one.working_mib)} MiB)",
        ]
        del ring, one, q, k, v, dout
        release()
    growth = working[1] / working[0]
    yield [
        "R=4 memory per doubling of C",
        "-",
        "-",
        f"<= {RING_GROWTH_BOUND}x",
        "-",
        "-",
        verdict(growth <= RING_GROWTH_BOUND),
        f"{growth:.2f}x",
    ]


def sections(mode: Mode) -> list[Section]:
    kernel = (
        "flash-attn 2"
        if attention.flash_attn_refusal(torch.device(mode.device), torch.bfloat16) is None
        else "torch SDPA"
    )
    attention_header = [
        "path",
        "out error",
        "grad error",
        "bound (out / grads)",
        "fwd+bwd ms",
        "working MiB",
        "status",
        "note",
    ]
    return [
        Section(
            "precision",
            "Training steps against fp32 (per-step losses)",
            ["check", "max loss diff / result", "bound", "status", "note"],
            precision_rows,
            60,
            "A 4-layer Llama-style model (GQA, RoPE, SwiGLU), same seed and data.",
        ),
        Section(
            "attention",
            "Attention paths on the device, against fp64 dense attention",
            attention_header,
            attention_rows,
            20,
            f"N = {mode.attention_seq}, {mode.heads[0]} q heads (GQA: {mode.heads[1]} kv), "
            f"head dim {mode.heads[2]}, forward + backward through the model's attention "
            f"core; errors are max |x - ref| / max |ref| over the output and over dq, dk, "
            f"dv. On CUDA SDPA may not use its math kernel.",
        ),
        Section(
            "ring",
            "Ring attention: R virtual ranks in one process",
            attention_header,
            ring_rows,
            40,
            f"N = {mode.ring_seq}; against the one-device path in fp32 on the same inputs. "
            f"Time: the slowest rank's forward + backward; memory: the largest rank's "
            f"peak above its inputs (messages handed over in memory; no communication).",
        ),
        Section(
            "offload",
            "Activation offload against plain full recompute",
            ["run", "s/iter", "peak GiB", "bound", "status", "note"],
            offload_rows,
            30,
        ),
        Section(
            "optimizer-offload",
            "Optimizer offload: host-held fp32 gradients",
            ["check", "result", "bound", "status", "note"],
            optimizer_offload_rows,
            20,
            "2 bf16 steps of 2 micro-batches, --optimizer-cpu-offload against the on-device "
            "optimizer; peak = torch.cuda.max_memory_allocated.",
        ),
        Section(
            "checkpoint",
            "torch_dist --async-save and resume",
            ["check", "result", "bound", "status", "note"],
            checkpoint_rows,
            30,
        ),
        Section(
            "adamw", "Fused AdamW", ["check", "rel. diff", "bound", "status", "note"], adamw_rows, 5
        ),
        Section(
            "fused",
            "--fused-layers (torch.compile per layer)",
            [
                "check",
                "max loss diff",
                "bound",
                "compile s",
                "fused/eager step time",
                "status",
                "note",
            ],
            fused_rows,
            90,
            "3 steps of the precision section's model; compile time = the first two "
            "steps' (forward and backward graphs) excess over the third's time.",
        ),
        Section(
            "documents",
            f"Documents and windows at {mode.documents_seq:,} tokens",
            ["attention", "s/iter", "peak GiB", "estimator GiB", "bound", "status", "note"],
            documents_rows,
            60,
            "Two layers of the 1.3B GPT (hidden 2048, 16 heads, RoPE, bf16, tiled loss), "
            "one sample, synthetic tokens; peak = torch.cuda.max_memory_allocated.",
        ),
        Section(
            "performance",
            "Speed and memory of a 1.3B GPT",
            [
                "sequence",
                "recompute",
                "tokens/s",
                "TFLOP/s",
                "MFU",
                "s/iter",
                "init s",
                "peak GiB",
                "estimator GiB (--dry-run)",
                "status",
                "note",
            ],
            performance_rows,
            60,
            f"24 layers, hidden 2048, 16 heads, RoPE, bf16, micro-batch 1, attention "
            f"kernel {kernel}; the longest sequence doubles from {mode.longest_from} with "
            f"full recompute while the budget lasts. TFLOP/s counts Megatron's formula "
            f"(full N² attention, training/metrics.py); the estimator excludes the CUDA "
            f"context and allocator fragmentation.",
        ),
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cpu", action="store_true", help="reduced mode on CPU (tiny shapes, the same code paths)"
    )
    parser.add_argument(
        "--sections",
        nargs="+",
        metavar="NAME",
        help="run only these sections (default: all, in order): precision "
        "attention ring offload optimizer-offload checkpoint adamw fused documents "
        "performance",
    )
    parser.add_argument(
        "--write-docs",
        action="store_true",
        help="write the tables into docs/benchmarks.md and docs/gpu.md "
        "(section gpu-check), after every section",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    # cuBLAS is deterministic with a fixed workspace (read when its handle is made): the
    # bitwise rows run under torch's deterministic algorithms.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --cpu for the reduced mode")
    if args.cpu and args.write_docs:
        parser.error("--write-docs records a GPU's tables; the reduced --cpu mode prints only")
    mode = CPU if args.cpu else GPU
    every = sections(mode)
    names = [s.key for s in every]
    unknown = sorted(set(args.sections or []) - set(names))
    if unknown:
        parser.error(f"--sections: unknown {', '.join(unknown)} (choose from {', '.join(names)})")
    check = Check(mode, args.write_docs)
    where = (
        torch.cuda.get_device_name()
        if mode.device == "cuda"
        else (
            "CPU (reduced mode: tiny shapes, the GPU check's code paths; its numbers say nothing "
            "about GPUs)"
        )
    )
    check.print(
        f"GPU check on {where}; torch {torch.__version__}; budget {mode.budget_s:.0f} s.\n{SCOPE}"
    )
    for section in every:
        if args.sections is None or section.key in args.sections:
            check.run(section)
    check.print(f"\n{check.summary()}")
    if args.write_docs:
        check.write(finished=True)
    return 1 if check.counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
