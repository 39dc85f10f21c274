"""What only a GPU can show, on one device, in one command (at most about 8 minutes on one GPU):

  1. correctness, on a small Llama-style model (GQA, RoPE, SwiGLU), each against fp32 with the
     same seed and data, per-step losses within the half-precision tolerance of the test suite:
       - bf16 with torch SDPA forced onto its flash kernel;
       - bf16 with FlashAttention-2 (`--use-flash-attn`), when `flash_attn` is importable; the
         check fails unless flash_attn_func really ran;
       - fp16 with dynamic loss scaling; and an overflowing loss scale must skip its steps;
       - fused AdamW (the optimizer GPU runs use) against torch's foreach AdamW, 3 steps;
  2. speed and memory of a 1.3B GPT (24 layers, hidden 2048, 16 heads, RoPE, bf16) at 8K and
     32K tokens and at the longest sequence that fits (doubling from 64K with full recompute,
     while the time budget lasts): tokens/s, TFLOP/s, MFU, peak memory
     (torch.cuda.max_memory_allocated) next to the memory estimator's figure for the same run;
  3. start-up and fusion of the same 1.3B GPT at 8K tokens: initialisation time and peak memory
     (each rank computes only its own shard, on the device), and step time with eager layers
     against --fused-layers (torch.compile per layer; its compile time is left out).

    python -m tools.gpu_check                  # on a GPU; --write-docs puts the tables in
                                               # docs/benchmarks.md
    python -m tools.gpu_check --cpu            # reduced mode: tiny models, short sequences
                                               # (what the test suite runs)

Exit status 1 when a correctness check fails. Runs as one process (a one-rank process group).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from dataclasses import dataclass

import torch

from megatron_ul.model import attention
from megatron_ul.training.loop import autocast_dtype
from megatron_ul.training.memory_estimator import GiB, estimate_config
from megatron_ul.training.metrics import flops_per_token, peak_memory_gib, peak_tflops
from megatron_ul.training.pretrain import configure, setup
from megatron_ul.training.step import train_step
from tools.bench.common import markdown_table, report

HALF_PRECISION_LOSS_TOLERANCE = 2e-2   # as tests/optim/test_precision.py (fp16 vs fp32)
COMMON = ["--mock-data", "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "42",
          "--log-interval", "1000000", "--lr", "1e-3", "--lr-warmup-iters", "1",
          "--min-lr", "1e-4", "--adam-eps", "1e-6"]
LLAMA = ["--group-query-attention", "--position-embedding-type", "rope",
         "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]


@dataclass(frozen=True)
class Mode:
    device: str
    small: list            # the correctness model
    steps: int
    big: list              # the performance model (the 1.3B GPT on a GPU)
    lengths: tuple         # sequence lengths always measured
    longest_from: int      # doubling search for the longest that fits starts here
    longest_cap: int       # ... and stops here
    budget_s: float


GPU = Mode("cuda",
           ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
            "--num-query-groups", "4", "--seq-length", "2048", "--vocab-size", "32000",
            "--micro-batch-size", "2", "--global-batch-size", "4"], 6,
           ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
            "--vocab-size", "50257", "--position-embedding-type", "rope"],
           (8192, 32768), 65536, 1 << 20, 7 * 60)
CPU = Mode("cpu",
           ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
            "--num-query-groups", "2", "--seq-length", "32", "--vocab-size", "1000",
            "--micro-batch-size", "2", "--global-batch-size", "4"], 3,
           ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--vocab-size", "1000", "--position-embedding-type", "rope"],
           (32, 64), 128, 256, 120)


def _release() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _sdpa_flash_kernel(device: str):
    """Force torch SDPA onto its flash kernel on a GPU (an error, not a silent fallback)."""
    if device != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        yield


@contextlib.contextmanager
def _counting_flash_attn_calls(counter: list):
    """Count flash_attn_func calls (wrapping the module's function for the duration)."""
    module = attention._flash_attn_module()
    original = module.flash_attn_func

    def counted(*args, **kwargs):
        counter[0] += 1
        return original(*args, **kwargs)
    module.flash_attn_func = counted
    try:
        yield
    finally:
        module.flash_attn_func = original


def train_losses(argv: list[str], device: str, sdpa_flash: bool = False):
    """Per-step losses of a fresh run, and the trainer (for its scaler)."""
    trainer = setup(configure(argv, world_size=1))
    with _sdpa_flash_kernel(device) if sdpa_flash else contextlib.nullcontext():
        losses = trainer.train()
    scaler = trainer.grad_scaler
    del trainer
    _release()
    return losses, scaler


def _loss_row(name: str, losses, reference, note: str = "") -> tuple[list, bool]:
    diff = max(abs(a - b) for a, b in zip(losses, reference))
    ok = diff < HALF_PRECISION_LOSS_TOLERANCE and losses != reference
    return [name, f"{diff:.2e}", f"< {HALF_PRECISION_LOSS_TOLERANCE:g}", "pass" if ok else "FAIL",
            note], ok


def fused_adamw_row(device: str) -> tuple[list, bool]:
    """Fused AdamW against foreach AdamW: same start, same gradients, 3 steps."""
    g = torch.Generator().manual_seed(0)
    shapes = [(256, 512), (512,), (1000, 64)]
    start = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    finals = []
    for fused in (True, False):
        params = [torch.nn.Parameter(p.to(device).clone()) for p in start]
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1,
                                **({"fused": True} if fused else {"foreach": True}))
        for step in grads:
            for p, grad in zip(params, step):
                p.grad = grad.to(device)
            opt.step()
        finals.append([p.detach().cpu() for p in params])
    diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(*finals))
    ok = diff < 1e-6
    return ["fused AdamW vs foreach AdamW (3 steps)", f"{diff:.2e}", "< 1e-06 (rel.)",
            "pass" if ok else "FAIL", ""], ok


def _bf16_sdpa_row(mode: Mode, base: list, fp32: list) -> tuple[list, bool]:
    bf16, _ = train_losses(base + ["--bf16"], mode.device, sdpa_flash=True)
    return _loss_row("bf16, torch SDPA flash kernel vs fp32", bf16, fp32,
                     "SDPA forced to FLASH_ATTENTION" if mode.device == "cuda" else "CPU SDPA")


def _bf16_flash_attn_row(mode: Mode, base: list, fp32: list) -> tuple[list, bool]:
    why_not = attention.flash_attn_refusal(torch.device(mode.device), torch.bfloat16)
    if why_not is not None:
        return ["bf16, flash-attn 2 vs fp32", "-", "-", "not run", why_not], True
    calls = [0]
    with _counting_flash_attn_calls(calls):
        flash, _ = train_losses(base + ["--bf16", "--use-flash-attn"], mode.device)
    row, ok = _loss_row("bf16, flash-attn 2 vs fp32", flash, fp32,
                        f"{calls[0]} flash_attn_func calls")
    return row, ok and calls[0] > 0


def _fp16_row(mode: Mode, base: list, fp32: list) -> tuple[list, bool]:
    fp16, scaler = train_losses(base + ["--fp16", "--initial-loss-scale", "4096"], mode.device)
    return _loss_row("fp16 + dynamic loss scaling vs fp32", fp16, fp32,
                     f"final scale {scaler.scale:g}, {scaler.skipped_steps} skipped")


def _fp16_overflow_row(mode: Mode, base: list, fp32: list) -> tuple[list, bool]:
    _, scaler = train_losses(base + ["--fp16", "--initial-loss-scale", str(2.0 ** 120),
                                     "--hysteresis", "1", "--train-iters", "2"], mode.device)
    ok = scaler.skipped_steps == 2 and scaler.scale == 2.0 ** 118
    return ["fp16 overflow: loss scale 2^120 for 2 steps", f"{scaler.skipped_steps} skipped",
            "2 skipped, scale 2^118", "pass" if ok else "FAIL", ""], ok


def correctness(mode: Mode) -> tuple[str, bool]:
    base = COMMON + LLAMA + mode.small + ["--train-iters", str(mode.steps)]
    fp32, _ = train_losses(base, mode.device)
    rows, all_ok = [], True
    checks = [_bf16_sdpa_row, _bf16_flash_attn_row, _fp16_row, _fp16_overflow_row,
              lambda mode, base, fp32: fused_adamw_row(mode.device)]
    for check in checks:
        try:
            row, ok = check(mode, base, fp32)
        except Exception as e:  # noqa: BLE001 - one failing check must not hide the others
            _release()
            row, ok = [check.__name__.strip("_").replace("_", " "), "error", "", "FAIL",
                       f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"], False
        rows.append(row)
        all_ok &= ok
    table = markdown_table(["check", "max loss diff / result", "bound", "", "note"], rows)
    return table, all_ok


# ---- speed and memory ---------------------------------------------------------------------------
def perf_argv(mode: Mode, seq: int, use_flash: bool, recompute: bool) -> list[str]:
    argv = COMMON + mode.big + ["--seq-length", str(seq), "--max-position-embeddings", str(seq),
                                "--micro-batch-size", "1", "--global-batch-size", "1",
                                "--train-iters", "1000", "--bf16"]
    if use_flash:
        argv.append("--use-flash-attn")
    if recompute:
        argv += ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    return argv


def measure(argv: list[str], device: str, warmup: int, timed: int) -> dict:
    """Tokens/s, TFLOP/s, MFU and peak memory of `timed` iterations after `warmup`."""
    cfg = configure(argv, world_size=1)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer = setup(cfg)
    if device == "cuda":
        torch.cuda.synchronize()
    init_seconds = time.perf_counter() - start
    init_peak, _ = peak_memory_gib()
    dtype = autocast_dtype(cfg)
    try:
        times = []
        for i in range(warmup + timed):
            batch = next(trainer.train_batches)
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            train_step(trainer.model, trainer.optimizer, batch, clip_grad=cfg.train.clip_grad,
                       autocast_dtype=dtype, iteration=i + 1, grad_scaler=trainer.grad_scaler)
            if device == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - start)
        per_iter = sum(times) / len(times)
        tokens = cfg.train.global_batch_size * cfg.model.seq_length
        tflops = flops_per_token(cfg.model, trainer.model.padded_vocab_size) * tokens \
            / per_iter / 1e12
        peak = peak_tflops(cfg)
        memory, kind = peak_memory_gib()
        return {"seconds": per_iter, "tokens_per_s": tokens / per_iter, "tflops": tflops,
                "mfu": tflops / peak if peak else None, "peak_gib": memory, "kind": kind,
                "estimate_gib": estimate_config(cfg).total_bytes / GiB,
                "init_seconds": init_seconds, "init_peak_gib": init_peak}
    finally:
        del trainer
        _release()


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error)


def performance(mode: Mode, deadline: float) -> str:
    use_flash = attention.flash_attn_refusal(torch.device(mode.device), torch.bfloat16) is None
    kernel = "flash-attn 2" if use_flash else "torch SDPA"
    rows, rate = [], None        # rate: measured FLOP/s, to predict longer runs' time
    plan = [(seq, False) for seq in mode.lengths]
    seq = mode.longest_from
    while seq <= mode.longest_cap:
        plan.append((seq, True))
        seq *= 2
    longest = None
    for seq, recompute in plan:
        argv = perf_argv(mode, seq, use_flash, recompute)
        cfg = configure(argv, world_size=1)
        flops = flops_per_token(cfg.model, cfg.model.padded_vocab_size(1)) * seq
        remaining = deadline - time.monotonic()
        if rate is not None and 4 * flops / rate > remaining:
            rows.append([seq, "full" if recompute else "none", "not run: time budget", "", "",
                         "", "", f"{estimate_config(cfg).total_bytes / GiB:.1f}"])
            break
        try:
            r = measure(argv, mode.device, warmup=1, timed=2)
        except RuntimeError as e:   # the longest search ends at the first length that OOMs
            if not (recompute and _is_oom(e)):
                raise
            _release()
            rows.append([seq, "full", "out of memory", "", "", "", "",
                         f"{estimate_config(cfg).total_bytes / GiB:.1f}"])
            break
        rate = flops / r["seconds"]
        if recompute:
            longest = seq
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        rows.append([seq, "full" if recompute else "none", f"{r['tokens_per_s']:,.0f}",
                     f"{r['tflops']:.3g}", mfu, f"{r['seconds']:.2f}",
                     f"{r['peak_gib']:.2f} ({r['kind']})", f"{r['estimate_gib']:.2f}"])
    table = markdown_table(["sequence", "recompute", "tokens/s", "TFLOP/s", "MFU", "s/iter",
                            "peak memory GiB", "estimator GiB"], rows)
    note = (f"Attention kernel: {kernel}. Longest sequence measured with full recompute: "
            f"{longest if longest else 'none within the budget'}. TFLOP/s counts Megatron's "
            f"formula (full N² attention, see training/metrics.py); the estimator's figure "
            f"excludes the CUDA context and allocator fragmentation.")
    return table + "\n\n" + note


def initialisation_and_fusion(mode: Mode) -> str:
    """Item 3 of the module docstring: init time/memory, step time eager vs --fused-layers."""
    use_flash = attention.flash_attn_refusal(torch.device(mode.device), torch.bfloat16) is None
    argv = perf_argv(mode, mode.lengths[0], use_flash, recompute=False)
    # On CPU the reduced mode traces without inductor's C++ compile (seconds, not minutes).
    backend = ["--fused-layers-backend", "aot_eager"] if mode.device == "cpu" else []
    eager = measure(argv, mode.device, warmup=1, timed=2)
    fused = measure(argv + ["--fused-layers"] + backend, mode.device, warmup=2, timed=2)
    rows = [[name, f"{r['init_seconds']:.2f}", f"{r['init_peak_gib']:.2f} ({r['kind']})",
             f"{r['seconds']:.3f}", f"{r['peak_gib']:.2f}"]
            for name, r in (("eager layers", eager), ("--fused-layers", fused))]
    table = markdown_table(["layers", "init s", "init peak GiB", "s/iter", "peak memory GiB"],
                           rows)
    return (table + f"\n\nSequence {mode.lengths[0]}, no recompute. Fused / eager step time: "
            f"{fused['seconds'] / eager['seconds']:.2f}× (after 2 warm-up steps that compile).")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true",
                        help="reduced mode on CPU (tiny models, short sequences)")
    parser.add_argument("--skip-performance", action="store_true")
    parser.add_argument("--write-docs", action="store_true",
                        help="write the tables into docs/benchmarks.md (section gpu-check)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --cpu for the reduced mode")
    mode = CPU if args.cpu else GPU
    deadline = time.monotonic() + mode.budget_s
    if mode.device == "cuda":
        name = torch.cuda.get_device_name()
        setup_text = (f"One {name}. Correctness: a 4-layer Llama-style model (hidden 1024, "
                      f"16 q / 4 kv heads, seq 2048), {mode.steps} steps per precision. Speed: "
                      f"a 1.3B GPT (24 layers, hidden 2048, 16 heads, RoPE, bf16, micro-batch 1).")
    else:
        setup_text = ("Reduced CPU mode (the code path of the GPU check, on tiny models; its "
                      "numbers say nothing about GPUs).")
    table, ok = correctness(mode)
    body = "### Correctness against fp32\n\n" + table
    if not args.skip_performance:
        body += "\n\n### Speed and memory\n\n" + performance(mode, deadline)
        body += ("\n\n### Initialisation and fused layers\n\n"
                 + initialisation_and_fusion(mode))
    report("gpu-check", "GPU check (tools/gpu_check.py)", setup_text, body,
           conclusion="" if ok else "**A correctness check FAILED.**",
           write_docs=args.write_docs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
