"""Everything one GPU can show, in one command, within 8 minutes on one H200 (torch 2.11, no
flash-attn needed), most informative first. Every section is isolated: an exception anywhere
in it (its release of device memory included) fails its own rows and the next section runs;
after a sticky CUDA error the later sections are recorded as SKIP with that error. Each row is
printed and flushed as it is measured and written at once to the result files
docs/results/gpu/<date>-<device>.json (machine-readable) and .md, so a crash or a kill keeps
every row measured until then. Each row says PASS, FAIL or SKIP against its stated bound, and
every attention row names the kernel that actually ran (SDPA's own `_fused_sdp_choice` on the
row's inputs, tools/gpu_check_sdpa.py).

Sections in order, with their time on one H200 estimated from their shapes (the budget guard
uses these; a section also stops starting cases past its cap):

  efficient   ~15 s (cap 45)  ring units and document tiles through model/lse_kernels'
              SDPA_EFFICIENT (torch's memory-efficient kernel called directly) in bf16 and fp16
              (fp32 as the control whose backward computes delta by torch ops), 8 q / 2 kv
              heads, head dim 128, against fp64: 9 units of 1024 x 1024, the tiles with
              attention dropout (128 tokens in tiles of 32, the mask read back as in the
              dropout section) and 2048-token tile runs, each well under a second
  dropout     ~5 s (cap 20)   attention dropout 0.1 through the model's attention core,
              causal, documents, window (N = head dim = 128, 16/4 heads): the mask read back
              from the output (dropped fraction, nothing outside the visible keys), output and
              gradients against fp64 with that mask, the same seed bitwise, another seed another
              mask
  documents   ~60 s (cap 110) two 1.3B-GPT layers at 131,072 tokens, 3 steps each: causal,
              10,000 documents without and with --attention-dropout 0.1, window 4096, both
              (~10 s each)
  performance ~100 s (cap 130) the 1.3B GPT at 8K and 32K (4 steps), then the longest that fits
              with full recompute, doubling from 64K (2 steps; ~25 s at 64K, ~60 s at 128K)
  precision   ~25 s (cap 45)  5 short runs of a 4-layer GQA model: bf16 (SDPA's choice; forced
              flash), flash-attn when installed, fp16 with loss scaling, fp16 overflow, vs fp32
  zero3       ~15 s (cap 30)  --zero-stage 3 on one rank (FSDP2) vs plain AdamW, fp32 and bf16
  attention   ~15 s (cap 30)  every path of the attention core at 4096 tokens vs fp64
  ring        ~25 s (cap 45)  ring attention on 2 and 4 virtual ranks at 8192 tokens; memory
              at 16K and 32K
  offload     ~20 s (cap 35)  --activation-checkpoint-cpu-offload vs full recompute, bitwise
  optimizer-offload ~12 s (cap 25)
  checkpoint  ~15 s (cap 30)  torch_dist --async-save, --load, resumed losses
  adamw       ~2 s (cap 10)   fused AdamW vs foreach AdamW
  fused       ~70 s (cap 100) --fused-layers (inductor) vs eager, bf16 then fp32: the cold
              compiles come last

Sum of estimates ~380 s of the 450 s budget (--time-budget; counted from the start of the
process, leaving 30 s of the 8 minutes for start-up, the last writes and the exit). What no
longer fits is skipped with a SKIP row marked "skipped for time", listed at the end of the
output and of both result files.

Outside what one GPU can show: multi-rank NCCL, tensor parallelism, sequence parallelism
(Ulysses and Megatron-SP), pipeline parallelism and the ring's communication.

    python -m tools.gpu_check                  # on a GPU: the first command a lent GPU runs
    python -m tools.gpu_check --write-docs     # ... and write the tables into
                                               # docs/benchmarks.md and docs/gpu.md
    python -m tools.gpu_check --cpu            # reduced mode: tiny shapes, the same code
                                               # paths where the CPU allows (the test suite)
    python -m tools.gpu_check --sections ring offload     # some sections only

Exit status 1 when a row FAILs (2 when interrupted). Runs as one process (a one-rank process
group); needs only the checkout and torch: synthetic tokens, no dataset, no network, no
flash-attn or apex. The modes, bounds and section runner are in tools/gpu_check_runner.py, the
result files in tools/gpu_check_results.py, the training sections in
tools/gpu_check_training.py, the attention cases in tools/gpu_check_attention.py.
"""

from __future__ import annotations

import time

PROCESS_START = time.monotonic()  # the time budget counts from here

import argparse  # noqa: E402 - after the clock starts: imports count against the budget
import logging  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from dataclasses import replace  # noqa: E402

import torch  # noqa: E402

from megatron_ul.model.attention import flash_attn as attention  # noqa: E402
from tools import gpu_check_attention as attn  # noqa: E402
from tools.bench.common import command_line  # noqa: E402
from tools.gpu_check_results import RESULTS_DIR, ResultFiles, environment  # noqa: E402
from tools.gpu_check_runner import (  # noqa: E402
    CPU,
    GPU,
    HALF_PRECISION_LOSS_TOLERANCE,
    RING_GROWTH_BOUND,
    RING_VS_ONE_DEVICE_BOUND,
    SCOPE,
    Check,
    Mode,
    Row,
    Section,
    mib,
    ms,
    release,
    verdict,
)
from tools.gpu_check_sdpa import SdpaRecorder  # noqa: E402
from tools.gpu_check_training import (  # noqa: E402
    ATTENTION_DROPOUT,
    adamw_rows,
    checkpoint_rows,
    documents_rows,
    fused_rows,
    offload_rows,
    optimizer_offload_rows,
    performance_rows,
    precision_rows,
    zero3_rows,
)


def efficient_rows(check: Check):
    """The efficient kernel's forward and backward as the ring units and document tiles call
    it, in bf16, fp16 and fp32, against fp64 (more than one head: a layout error in what the
    backward is handed shows as O(1) gradient errors)."""
    mode, device = check.mode, check.mode.device
    hq, hk, d = mode.efficient_heads
    recorder = SdpaRecorder()
    with attn.efficient_kernel_ops(device, recorder) as kernel:
        if kernel is None:
            yield [
                "efficient kernel",
                "-",
                "-",
                "",
                "-",
                "-",
                "SKIP",
                "no CUDA and no CPU stand-in of the kernel (tests/stand_ins not importable)",
            ]
            return
        dtypes = (torch.bfloat16, torch.float16, torch.float32)
        for kind in ("causal", "full", "masked"):
            for dtype in dtypes:
                name = f"ring unit, {kind}, {hq}/{hk} heads, {_dtype_name(dtype)}"
                check.need(3, name)
                recorder.calls.clear()
                with recorder:
                    results, reference, seconds = attn.efficient_unit(
                        kind, mode.efficient_seq, mode.efficient_heads, dtype, device
                    )
                yield _error_row(name, dtype, results, reference, seconds, recorder, kernel)
                del results, reference
                release()
        yield from _efficient_dropout_rows(check, recorder, kernel)
        docs = max(mode.documents // 1000, 4)
        window = mode.tile_seq // 3
        for dtype in dtypes:
            case = attn.Case(
                f"document tiles, {docs} documents + window {window}, {_dtype_name(dtype)}",
                mode.tile_seq,
                hq,
                hk,
                d,
                dtype,
                documents=docs,
                window=window,
            )
            check.need(5, case.name)
            recorder.calls.clear()
            with recorder:
                results, reference, seconds = attn.efficient_tiles(case, device)
            yield _error_row(case.name, dtype, results, reference, seconds, recorder, kernel)
            del results, reference
            release()


def _efficient_dropout_rows(check: Check, recorder: SdpaRecorder, kernel: str):
    """The document tiles with attention dropout on the efficient kernel (several tiles per
    sequence), the mask read back from the output as in the dropout section."""
    mode, device, p = check.mode, check.mode.device, ATTENTION_DROPOUT
    hq, hk, d = mode.dropout_heads
    for dtype in (torch.bfloat16, torch.float16):
        case = attn.Case(
            f"document tiles, 4 documents + window {d // 4}, dropout {p:g}, {_dtype_name(dtype)}",
            d,
            hq,
            hk,
            d,
            dtype,
            documents=4,
            window=d // 4,
        )
        check.need(3, case.name)
        recorder.calls.clear()
        with recorder:
            c = attn.dropout_check(case, device, p, tiles=True)
        out_bound, grad_bound = case.bounds()
        ok = _dropout_ok(c, p, out_bound, grad_bound)
        yield Row(
            [
                case.name,
                f"{c.out_error:.1e}",
                f"{c.grad_error:.1e}",
                f"{out_bound:g} / {grad_bound:g}",
                "-",
                "-",
                verdict(ok),
                f"{kernel}; {_dropout_note(c, p)}",
            ],
            recorder.calls.copy(),
            {"dropped": c.dropped, "out error": c.out_error, "grad error": c.grad_error},
        )
        release()


def _dropout_ok(c, p: float, out_bound: float, grad_bound: float) -> bool:
    return (
        abs(c.dropped - p) <= c.rate_bound
        and c.leaked == 0
        and c.same_seed_out_equal
        and c.same_seed_grad_diff <= attn.SAME_SEED_GRAD_TOLERANCE
        and c.other_seed_differs
        and c.out_error <= out_bound
        and c.grad_error <= grad_bound
    )


def _dropout_note(c, p: float) -> str:
    return (
        f"dropped {c.dropped:.4f} (bound {p:g} ± {c.rate_bound:.4f}); same seed "
        + _same_seed(c)
        + ", other seed "
        + ("another mask" if c.other_seed_differs else "THE SAME MASK")
        + (f"; {c.leaked} probabilities outside the visible keys" if c.leaked else "")
    )


def _same_seed(c) -> str:
    if not c.same_seed_out_equal:
        return "ANOTHER OUTPUT"
    if c.same_seed_grad_diff == 0:
        return "bitwise"
    return f"output bitwise, gradients within {c.same_seed_grad_diff:.0e}"


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def _error_row(name, dtype, results, reference, seconds, recorder, kernel) -> Row:
    out_err, grad_err = attn.errors(results, reference)
    out_bound, grad_bound = attn.Case(name, 1, 1, 1, 1, dtype).bounds()
    ok = out_err <= out_bound and grad_err <= grad_bound
    return Row(
        [
            name,
            f"{out_err:.1e}",
            f"{grad_err:.1e}",
            f"{out_bound:g} / {grad_bound:g}",
            ms(seconds),
            "-",
            verdict(ok),
            kernel,
        ],
        recorder.calls.copy(),
        {"out error": out_err, "grad error": grad_err},
    )


def dropout_rows(check: Check):
    """Attention dropout through the model's attention core: the mask it drew, read back from
    the output, and everything else held to fp64 with that mask."""
    mode, device = check.mode, check.mode.device
    hq, hk, d = mode.dropout_heads
    n, p = d, ATTENTION_DROPOUT
    docs, window = 4, n // 4
    cases = [
        attn.Case(f"causal, dropout {p:g}, bf16", n, hq, hk, d, torch.bfloat16),
        attn.Case(f"{docs} documents, dropout {p:g}, bf16", n, hq, hk, d, torch.bfloat16, docs),
        attn.Case(
            f"window {window}, dropout {p:g}, bf16", n, hq, hk, d, torch.bfloat16, window=window
        ),
        attn.Case(
            f"{docs} documents + window {window}, dropout {p:g}, bf16",
            n,
            hq,
            hk,
            d,
            torch.bfloat16,
            docs,
            window,
        ),
    ]
    for case in cases:
        check.need(3, case.name)
        with SdpaRecorder() as recorder:
            c = attn.dropout_check(case, device, p)
        out_bound, grad_bound = case.bounds()
        ok = _dropout_ok(c, p, out_bound, grad_bound)
        seeds = _same_seed(c) + " / " + ("differs" if c.other_seed_differs else "SAME MASK")
        yield Row(
            [
                case.name,
                f"{c.dropped:.4f}",
                f"{c.out_error:.1e}",
                f"{c.grad_error:.1e}",
                f"dropped {p:g} ± {c.rate_bound:.4f}; {out_bound:g} / {grad_bound:g}",
                seeds,
                verdict(ok),
                f"{attn.kernel_of(case, device, dropout=True)}"
                + (f"; {c.leaked} probabilities outside the visible keys" if c.leaked else ""),
            ],
            recorder.calls.copy(),
            {"dropped": c.dropped, "out error": c.out_error, "grad error": c.grad_error},
        )
        release()


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
        recorder = SdpaRecorder()
        try:
            run = attn.one_device(case, q, k, v, dout, documents, device, recorder=recorder)
        except RuntimeError as e:
            if "No available kernel" not in str(e):
                raise
            yield Row(
                [
                    case.name,
                    "-",
                    "-",
                    "",
                    "-",
                    "-",
                    "FAIL",
                    "only SDPA's math kernel (O(N²) memory) takes this call",
                ],
                recorder.calls,
            )
            continue
        out_err, grad_err = attn.errors(run.results, reference)
        out_bound, grad_bound = case.bounds()
        ok = out_err <= out_bound and grad_err <= grad_bound
        yield Row(
            [
                case.name,
                f"{out_err:.1e}",
                f"{grad_err:.1e}",
                f"{out_bound:g} / {grad_bound:g}",
                ms(run.seconds),
                mib(run.working_mib),
                verdict(ok),
                f"dispatch: {attn.kernel_of(case, device)}",
            ],
            recorder.calls,
            {"out error": out_err, "grad error": grad_err},
        )
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
        recorder = SdpaRecorder()
        ring = attn.virtual_ring(case, size, q, k, v, dout, documents, device, recorder)
        out_err, grad_err = attn.errors(ring.results, reference)
        out_bound, grad_bound = case.bounds()
        ok = out_err <= out_bound and grad_err <= grad_bound and ring.converged
        note = f"dispatch: {attn.kernel_of(case, device, ring=True)}; {ring.passes} passes" + (
            "" if ring.converged else ", no bitwise fixpoint"
        )
        yield Row(
            [
                case.name,
                f"{out_err:.1e}",
                f"{grad_err:.1e}",
                f"{out_bound:g} / {grad_bound:g}",
                ms(ring.seconds),
                mib(ring.working_mib),
                verdict(ok),
                note,
            ],
            recorder.calls,
            {"out error": out_err, "grad error": grad_err},
        )
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
        recorder = SdpaRecorder()
        ring = attn.virtual_ring(case, size, q, k, v, dout, None, device, recorder)
        per_rank = replace(case, heads=hq // size, kv_heads=max(hk // size, 1))
        oq, ok, ov, odout, _ = attn.inputs(per_rank, device)
        one = attn.one_device(per_rank, oq, ok, ov, odout, None, device)
        del oq, ok, ov, odout
        working.append(_cuda_mib(ring))
        ratio = _cuda_mib(ring) / _cuda_mib(one)
        yield Row(
            [
                f"R=4 at N={n} (C={n // (2 * size)}) vs one device, heads/R",
                "-",
                "-",
                f"<= {RING_VS_ONE_DEVICE_BOUND}x",
                ms(ring.seconds),
                mib(ring.working_mib),
                verdict(ratio <= RING_VS_ONE_DEVICE_BOUND),
                f"{ratio:.2f}x one-device attention ({mib(one.working_mib)} MiB)",
            ],
            recorder.calls,
        )
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
    """Every section, most informative first (the cold compiles last)."""
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
    hq, hk, d = mode.efficient_heads
    dq, dk, dd = mode.dropout_heads
    return [
        Section(
            "efficient",
            "torch's efficient kernel called directly (ring units, document tiles) against fp64",
            attention_header,
            efficient_rows,
            15,
            45,
            f"lse_kernels.SDPA_EFFICIENT forward, then backward with the final out and lse in "
            f"the callers' layout ([S, b, h, d] buffers seen as [b, h, S, d]); units of "
            f"{mode.efficient_seq} x {mode.efficient_seq} ('masked': three documents as a "
            f"bias), tiles over {mode.tile_seq} tokens; {hq} q / {hk} kv heads, head dim {d}. "
            f"Errors are max |x - ref| / max |ref| over the output and over dq, dk, dv.",
            backend_column=True,
        ),
        Section(
            "dropout",
            f"Attention dropout {ATTENTION_DROPOUT:g} through the attention core, against fp64 "
            f"with the mask it drew",
            [
                "path",
                "dropped",
                "out error",
                "grad error",
                "bound",
                "same seed / other seed",
                "status",
                "note",
            ],
            dropout_rows,
            5,
            20,
            f"N = head dim = {dd}, {dq} q / {dk} kv heads; v is the identity over the "
            f"sequence, so the output is the dropped, rescaled probabilities and the mask is "
            f"read back from it (0 exactly where a key was dropped). Dropped: the fraction of "
            f"visible (query, key) pairs, bound {attn.DROPOUT_RATE_SIGMAS:g} binomial standard "
            f"deviations plus 1/256 (flash-attn's 8-bit threshold); output and gradients "
            f"against fp64 attention with that mask; the same seed twice: the output bitwise, "
            f"the gradients within {attn.SAME_SEED_GRAD_TOLERANCE:g} (a backward's atomic "
            f"accumulation order); another seed another mask.",
            backend_column=True,
        ),
        Section(
            "documents",
            f"Documents and windows at {mode.documents_seq:,} tokens, with and without "
            f"attention dropout",
            ["attention", "s/iter", "peak GiB", "estimator GiB", "bound", "status", "note"],
            documents_rows,
            60,
            110,
            "Two layers of the 1.3B GPT (hidden 2048, 16 heads, RoPE, bf16, tiled loss), "
            "one sample, synthetic tokens; peak = torch.cuda.max_memory_allocated; the kernel "
            "column counts the first step's attention calls.",
            backend_column=True,
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
            100,
            130,
            f"24 layers, hidden 2048, 16 heads, RoPE, bf16, micro-batch 1, attention "
            f"through {kernel}; the longest sequence doubles from {mode.longest_from} with "
            f"full recompute while the budget lasts (2 steps each, else 4). TFLOP/s counts "
            f"Megatron's formula (full N² attention, training/metrics.py); the estimator "
            f"excludes the CUDA context and allocator fragmentation.",
            backend_column=True,
        ),
        Section(
            "precision",
            "Training steps against fp32 (per-step losses)",
            ["check", "max loss diff / result", "bound", "status", "note"],
            precision_rows,
            25,
            45,
            "A 4-layer Llama-style model (GQA, RoPE, SwiGLU), same seed and data.",
            backend_column=True,
        ),
        Section(
            "zero3",
            "ZeRO-3 (--zero-stage 3, FSDP2) on one rank",
            [
                "check",
                "max loss diff",
                "max parameter diff",
                "bound (losses)",
                "peak GiB (ZeRO-3)",
                "peak GiB (plain)",
                "status",
                "note",
            ],
            zero3_rows,
            15,
            30,
            f"The precision section's model, {mode.steps} steps, one-rank mesh; the "
            f"half-precision bound is {HALF_PRECISION_LOSS_TOLERANCE:g}.",
            backend_column=True,
        ),
        Section(
            "attention",
            "Attention paths on the device, against fp64 dense attention",
            attention_header,
            attention_rows,
            15,
            30,
            f"N = {mode.attention_seq}, {mode.heads[0]} q heads (GQA: {mode.heads[1]} kv), "
            f"head dim {mode.heads[2]}, forward + backward through the model's attention "
            f"core; errors are max |x - ref| / max |ref| over the output and over dq, dk, "
            f"dv. On CUDA SDPA may not use its math kernel.",
            backend_column=True,
        ),
        Section(
            "ring",
            "Ring attention: R virtual ranks in one process",
            attention_header,
            ring_rows,
            25,
            45,
            f"N = {mode.ring_seq}; against the one-device path in fp32 on the same inputs. "
            f"Time: the slowest rank's forward + backward; memory: the largest rank's "
            f"peak above its inputs (messages handed over in memory; no communication).",
            backend_column=True,
        ),
        Section(
            "offload",
            "Activation offload against plain full recompute",
            ["run", "s/iter", "peak GiB", "bound", "status", "note"],
            offload_rows,
            20,
            35,
        ),
        Section(
            "optimizer-offload",
            "Optimizer offload: host-held fp32 gradients",
            ["check", "result", "bound", "status", "note"],
            optimizer_offload_rows,
            12,
            25,
            "2 bf16 steps of 2 micro-batches, --optimizer-cpu-offload against the on-device "
            "optimizer; peak = torch.cuda.max_memory_allocated.",
        ),
        Section(
            "checkpoint",
            "torch_dist --async-save and resume",
            ["check", "result", "bound", "status", "note"],
            checkpoint_rows,
            15,
            30,
        ),
        Section(
            "adamw",
            "Fused AdamW",
            ["check", "rel. diff", "bound", "status", "note"],
            adamw_rows,
            2,
            10,
        ),
        Section(
            "fused",
            "--fused-layers (torch.compile per layer), bf16 then fp32",
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
            70,
            100,
            "3 steps of the precision section's model; compile time = the first two "
            "steps' (forward and backward graphs) excess over the third's time.",
        ),
    ]


class Interrupted(BaseException):
    """SIGTERM (a device tool's time limit): the result files are closed as interrupted."""


def _interrupt(signum, frame):
    raise Interrupted(f"signal {signum}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cpu", action="store_true", help="reduced mode on CPU (tiny shapes, the same code paths)"
    )
    parser.add_argument(
        "--sections",
        nargs="+",
        metavar="NAME",
        help="run only these sections (default: all, in order): "
        + " ".join(s.key for s in sections(CPU)),
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"seconds for the sections, counted from the start of the process; what no longer "
        f"fits is skipped and reported (default on a GPU: {GPU.budget_s:.0f}, within 8 "
        f"minutes; the --cpu mode has none unless given)",
    )
    parser.add_argument(
        "--results-dir",
        default=RESULTS_DIR,
        metavar="DIR",
        help="where <date>-<device>.json and .md are written (default: docs/results/gpu)",
    )
    parser.add_argument(
        "--write-docs",
        action="store_true",
        help="also write the tables into docs/benchmarks.md and docs/gpu.md "
        "(section gpu-check), after every section",
    )
    parser.add_argument(
        "--docs-from",
        metavar="JSON",
        help="write the gpu-check section of docs/gpu.md and docs/benchmarks.md from a result "
        "file (a run brought back from a lent GPU) and exit",
    )
    args = parser.parse_args(argv)
    if args.docs_from is not None:
        try:
            written = ResultFiles.from_file(args.docs_from)
        except (OSError, ValueError) as e:
            parser.error(f"--docs-from: {e}")
        if written.record["mode"] != "gpu":
            parser.error(
                f"--docs-from {args.docs_from}: a --cpu run's results say nothing "
                f"about GPUs; the docs record GPU runs only"
            )
        written.scope = SCOPE
        Check(GPU, results=written).write_doc_sections(
            finished=written.record["state"] == "complete"
        )
        return 0
    logging.basicConfig(level=logging.WARNING)
    # cuBLAS is deterministic with a fixed workspace (read when its handle is made): the
    # bitwise rows run under torch's deterministic algorithms.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --cpu for the reduced mode")
    if args.cpu and args.write_docs:
        parser.error("--write-docs records a GPU's tables; the reduced --cpu mode prints only")
    if args.time_budget is not None and args.time_budget <= 0:
        parser.error(f"--time-budget: {args.time_budget:g} s; give a positive number of seconds")
    mode = CPU if args.cpu else GPU
    every = sections(mode)
    names = [s.key for s in every]
    unknown = sorted(set(args.sections or []) - set(names))
    if unknown:
        parser.error(f"--sections: unknown {', '.join(unknown)} (choose from {', '.join(names)})")
    # the reduced CPU mode's timings depend on the machine's load: no budget unless given
    budget = args.time_budget if args.time_budget is not None or args.cpu else mode.budget_s
    try:
        results = ResultFiles(
            args.results_dir,
            "cpu" if args.cpu else "gpu",
            environment(mode.device),
            command_line(),
            budget,
        )
    except OSError as e:
        parser.error(f"--results-dir {args.results_dir}: {e}")
    results.scope = SCOPE
    check = Check(
        mode, args.write_docs, results=results, time_budget_s=args.time_budget, start=PROCESS_START
    )
    env = results.record["environment"]
    check.print(
        f"GPU check on {env['device']}; torch {env['torch']}, CUDA {env['cuda']}, cuDNN "
        f"{env['cudnn']}; "
        + (f"time budget {budget:.0f} s." if budget is not None else "no time budget.")
        + f"\nResults: {results.json_path} (and .md)\n"
        f"{SCOPE}"
    )
    previous = signal.signal(signal.SIGTERM, _interrupt)
    state = "complete"
    try:
        for section in every:
            if args.sections is None or section.key in args.sections:
                check.run(section)
    except (Interrupted, KeyboardInterrupt) as e:
        state = f"interrupted ({type(e).__name__} {e})".strip()
    finally:
        signal.signal(signal.SIGTERM, previous)
        check.finish(state)
    check.print(f"\n{check.summary()}")
    skipped = check.skipped_for_time
    check.print(
        "Skipped for time: " + "; ".join(skipped) + "." if skipped else "Nothing skipped for time."
    )
    check.print(f"Results: {results.json_path}, {results.md_path}")
    if state != "complete":
        return 2
    return 1 if check.counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
