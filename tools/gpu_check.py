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
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Optional

import torch

from megatron_ul.data.batches import build_micro_batch
from megatron_ul.model import attention
from megatron_ul.training.memory_estimator import GiB, estimate_config
from megatron_ul.training.metrics import flops_per_token, peak_tflops
from megatron_ul.training.pretrain import configure, setup
from tools import gpu_check_attention as attn
from tools.bench.common import REPO_ROOT, command_line, machine_info, write_section

HALF_PRECISION_LOSS_TOLERANCE = 2e-2   # as tests/optim/test_precision.py (fp16 vs fp32)
FP32_LOSS_TOLERANCE = 1e-5             # the project's fp32 bar (tests/model/test_fused_layers)
MEMORY_BOUND = 1.25                    # max_memory_allocated <= 1.25 x the estimator's figure
RING_GROWTH_BOUND = 2.1                # ring memory per doubling of the local sequence
RING_VS_ONE_DEVICE_BOUND = 1.5         # ring vs one-device attention, same tokens per rank
SCOPE = ("Outside what one GPU can show: multi-rank NCCL, tensor parallelism (TP), sequence "
         "parallelism (SP: Ulysses and Megatron-SP), pipeline parallelism (PP) and the ring's "
         "communication; the ring rows run R virtual ranks in one process (their compute, "
         "with the messages handed over in memory).")
GPU_DOC = os.path.join(REPO_ROOT, "docs", "gpu.md")
BENCHMARKS_DOC = os.path.join(REPO_ROOT, "docs", "benchmarks.md")
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
    budget_s: float        # the whole check
    attention_seq: int
    heads: tuple           # (query heads, kv heads, head dim) of the attention rows
    ring_seq: int
    ring_growth_seqs: tuple
    documents_seq: int
    documents: int
    window: int
    offload_model: list = field(default_factory=list)


GPU = Mode("cuda",
           ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
            "--num-query-groups", "4", "--seq-length", "2048", "--vocab-size", "32000",
            "--micro-batch-size", "2", "--global-batch-size", "4"], 6,
           ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
            "--vocab-size", "50257", "--position-embedding-type", "rope"],
           (8192, 32768), 65536, 1 << 20, 8 * 60 - 30,
           attention_seq=4096, heads=(16, 4, 128), ring_seq=8192,
           ring_growth_seqs=(16384, 32768), documents_seq=131072, documents=10_000,
           window=4096,
           offload_model=["--num-layers", "8", "--seq-length", "8192",
                          "--micro-batch-size", "1", "--global-batch-size", "2"])
CPU = Mode("cpu",
           ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
            "--num-query-groups", "2", "--seq-length", "32", "--vocab-size", "1000",
            "--micro-batch-size", "2", "--global-batch-size", "4"], 3,
           ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--vocab-size", "1000", "--position-embedding-type", "rope"],
           (32, 64), 128, 256, 240,
           attention_seq=64, heads=(4, 2, 16), ring_seq=64, ring_growth_seqs=(64, 128),
           documents_seq=256, documents=20, window=16)


class OutOfTime(Exception):
    """Raised by Check.need: the rest of a section is skipped with a SKIP row."""


# ---- the section runner ---------------------------------------------------------------------
@dataclass
class Section:
    key: str
    title: str
    header: list            # the last two columns are always "status" and "note"
    rows: Callable          # rows(check) -> iterator of rows (lists matching the header)
    needs_s: float          # about how long it takes on the GPU (the budget guard)
    note: str = ""


class Check:
    """Runs sections: prints each row as it comes (flushed), turns an exception into a FAIL
    row, skips what the time budget no longer allows, and (with write_docs) rewrites the
    docs' gpu-check section after every section, so a later crash keeps the earlier tables."""

    def __init__(self, mode: Mode, write_docs: bool, out=None):
        self.mode, self.write_docs = mode, write_docs
        self.out = out or sys.stdout
        self.deadline = time.monotonic() + mode.budget_s
        # The budget binds on a GPU; CPU timings of the reduced mode depend on machine load.
        self.enforce_budget = mode.device == "cuda"
        self.tables: list[str] = []
        self.counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
        self.started = datetime.datetime.now(datetime.timezone.utc)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def need(self, seconds: float, what: str) -> None:
        """Skip the rest of the section unless about `seconds` (GPU estimate) remain."""
        if self.enforce_budget and self.left() < seconds:
            raise OutOfTime(f"time budget: {self.left():.0f} s left, {what} needs ~{seconds:.0f} s")

    def print(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def run(self, section: Section) -> None:
        lines = [f"### {section.title}", "", _row(section.header),
                 "|" + "|".join("---" for _ in section.header) + "|"]
        self.print("\n".join(["", *lines]))
        width = len(section.header)
        start = time.monotonic()
        try:
            self.need(section.needs_s, f"section {section.key}")
            for row in section.rows(self):
                lines.append(self._emit(row))
        except OutOfTime as e:
            lines.append(self._emit(_filled(width, section.key, "SKIP", str(e))))
        except Exception as e:  # noqa: BLE001 - one failing section must not hide the others
            where = traceback.extract_tb(e.__traceback__)[-1]
            message = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''} " \
                      f"({os.path.basename(where.filename)}:{where.lineno})"
            lines.append(self._emit(_filled(width, f"{section.key}: section aborted", "FAIL",
                                            message)))
        _release()   # after the traceback (and the tensors its frames hold) is gone
        tail = f"{section.note + ' ' if section.note else ''}Section time: " \
               f"{time.monotonic() - start:.1f} s."
        self.print("\n" + tail)
        self.tables.append("\n".join(lines) + "\n\n" + tail)
        if self.write_docs:
            self.write(finished=False)

    def _emit(self, row: list) -> str:
        status = str(row[-2])
        if status in self.counts:
            self.counts[status] += 1
        line = _row(row)
        self.print(line)
        return line

    def summary(self) -> str:
        c = self.counts
        return f"{c['PASS']} PASS, {c['FAIL']} FAIL, {c['SKIP']} SKIP."

    def body(self, finished: bool) -> str:
        mode = self.mode
        when = self.started.strftime("%Y-%m-%d %H:%M UTC")
        device = torch.cuda.get_device_name() if mode.device == "cuda" else "CPU (reduced mode)"
        flash = "installed" if attention.flash_attn_module() is not None else "not installed"
        state = self.summary() if finished else "**Incomplete: the run stopped or is still " \
                                                "running after the tables above.**"
        return "\n\n".join([
            "## GPU check (tools/gpu_check.py)",
            f"Run {when} on {device}. Machine: {machine_info()}; flash-attn {flash}.",
            f"Command: `{command_line()}`", SCOPE, *self.tables, state])

    def write(self, finished: bool) -> None:
        body = self.body(finished)
        write_section("gpu-check", body, BENCHMARKS_DOC)
        write_section("gpu-check", body, GPU_DOC)


def _row(cells: list) -> str:
    return "| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |"


def _filled(width: int, label: str, status: str, note: str) -> list:
    return [label] + [""] * (width - 3) + [status, note]


def _status(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _release() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _peak_reset(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: str) -> Optional[float]:
    return torch.cuda.max_memory_allocated() / GiB if device == "cuda" else None


def _gib(x: Optional[float]) -> str:
    return f"{x:.2f}" if x is not None else "-"


# ---- training runs through the public entry points -----------------------------------------
@dataclass
class TrainRun:
    losses: list
    seconds: list            # per timed iteration (the first includes any compilation)
    peak_gib: Optional[float]
    estimate_gib: float
    init_seconds: float
    params: list             # final parameters (when asked for)
    optimizer_state: dict    # final optimizer state_dict (when asked for)
    scaler: object
    trainer_cfg: object


def _timed(batches: Iterator, device: str, stamps: list) -> Iterator:
    """Yield from `batches`, stamping the time of each fetch: the training loop fetches one
    global batch per iteration, so consecutive stamps bound one iteration."""
    for batch in batches:
        if device == "cuda":
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())
        yield batch


def train_run(argv: list, device: str, batches: Optional[Iterator] = None,
              keep_state: bool = False, sdpa_flash: bool = False) -> TrainRun:
    """Train with pretrain_gpt.py's flags (the real loop: whatever --bf16 or --fused-layers
    mean today), optionally on our own batches; time each iteration."""
    cfg = configure(argv, world_size=1)
    _peak_reset(device)
    start = time.perf_counter()
    trainer = setup(cfg)
    init_seconds = time.perf_counter() - start
    stamps: list = []
    trainer.train_batches = _timed(batches if batches is not None else trainer.train_batches,
                                   device, stamps)
    _peak_reset(device)
    try:
        with _sdpa_flash_kernel(device) if sdpa_flash else contextlib.nullcontext():
            losses = trainer.train()
        if device == "cuda":
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())
        peak = _peak_gib(device)
        params = [p.detach().clone() for p in trainer.model.parameters()] if keep_state else []
        state = _cloned(trainer.optimizer.state_dict()) if keep_state else {}
        return TrainRun(losses, [b - a for a, b in zip(stamps, stamps[1:])], peak,
                        estimate_config(cfg).total_bytes / GiB, init_seconds, params, state,
                        trainer.grad_scaler, cfg)
    finally:
        del trainer
        _release()


def _cloned(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _cloned(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_cloned(v) for v in x)
    return x


def _tensors_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b.to(a.device))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_tensors_equal(x, y) for x, y in zip(a, b))
    return a == b


@contextlib.contextmanager
def _sdpa_flash_kernel(device: str):
    """Force torch SDPA onto its flash kernel on a GPU (an error, not a silent fallback)."""
    if device != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        yield


def _max_diff(a: list, b: list) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


# ---- sections ---------------------------------------------------------------------------------
def precision_rows(check: Check):
    mode = check.mode
    base = COMMON + LLAMA + mode.small + ["--train-iters", str(mode.steps)]
    fp32 = train_run(base, mode.device).losses
    bound = f"< {HALF_PRECISION_LOSS_TOLERANCE:g}"

    def against_fp32(name, losses, note):
        diff = _max_diff(losses, fp32)
        ok = diff < HALF_PRECISION_LOSS_TOLERANCE and losses != fp32
        return [name, f"{diff:.2e}", bound, _status(ok), note]

    run = train_run(base + ["--bf16"], mode.device, sdpa_flash=True)
    yield against_fp32("bf16, torch SDPA flash kernel vs fp32", run.losses,
                       "SDPA forced to FLASH_ATTENTION" if mode.device == "cuda" else "CPU SDPA")
    why_not = attention.flash_attn_refusal(torch.device(mode.device), torch.bfloat16)
    if why_not is not None:
        yield ["bf16, flash-attn 2 vs fp32", "-", bound, "SKIP", why_not]
    else:
        calls = [0]
        with _counting_flash_attn_calls(calls):
            run = train_run(base + ["--bf16", "--use-flash-attn"], mode.device)
        row = against_fp32("bf16, flash-attn 2 vs fp32", run.losses,
                           f"{calls[0]} flash_attn_func calls")
        if calls[0] == 0:
            row[3] = "FAIL"
        yield row
    run = train_run(base + ["--fp16", "--initial-loss-scale", "4096"], mode.device)
    yield against_fp32("fp16 + dynamic loss scaling vs fp32", run.losses,
                       f"final scale {run.scaler.scale:g}, {run.scaler.skipped_steps} skipped")
    run = train_run(base + ["--fp16", "--initial-loss-scale", str(2.0 ** 120), "--hysteresis",
                            "1", "--train-iters", "2"], mode.device)
    ok = run.scaler.skipped_steps == 2 and run.scaler.scale == 2.0 ** 118
    yield ["fp16 overflow: loss scale 2^120 for 2 steps", f"{run.scaler.skipped_steps} skipped",
           "2 skipped, scale 2^118", _status(ok), ""]


@contextlib.contextmanager
def _counting_flash_attn_calls(counter: list):
    """Count flash_attn_func calls (wrapping the module's function for the duration)."""
    module = attention.flash_attn_module()
    original = module.flash_attn_func

    def counted(*args, **kwargs):
        counter[0] += 1
        return original(*args, **kwargs)
    module.flash_attn_func = counted
    try:
        yield
    finally:
        module.flash_attn_func = original


def _attention_cases(mode: Mode, seq: int) -> list:
    hq, hk, d = mode.heads
    bf16, docs, w = torch.bfloat16, max(mode.documents // 1000, 4), mode.window // 8
    return [attn.Case("causal, MHA, bf16", seq, hq, hq, d, bf16),
            attn.Case("causal, GQA, bf16", seq, hq, hk, d, bf16),
            attn.Case("causal, GQA, fp32", seq, hq, hk, d, torch.float32),
            attn.Case(f"{docs} documents, GQA, bf16", seq, hq, hk, d, bf16, documents=docs),
            attn.Case(f"window {w}, GQA, bf16", seq, hq, hk, d, bf16, window=w),
            attn.Case(f"{docs} documents + window {w}, bf16", seq, hq, hk, d, bf16,
                      documents=docs, window=w),
            attn.Case(f"{docs} documents + window {w}, fp32", seq, hq, hk, d, torch.float32,
                      documents=docs, window=w)]


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def _mib(x: Optional[float]) -> str:
    return f"{x:.0f}" if x is not None else "-"


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
            yield [case.name, "-", "-", "", "-", "-", "FAIL",
                   "only SDPA's math kernel (O(N²) memory) takes this call"]
            continue
        out_err, grad_err = attn.errors(run.results, reference)
        out_bound, grad_bound = case.bounds()
        ok = out_err <= out_bound and grad_err <= grad_bound
        yield [case.name, f"{out_err:.1e}", f"{grad_err:.1e}", f"{out_bound:g} / {grad_bound:g}",
               _ms(run.seconds), _mib(run.working_mib), _status(ok), ""]
        del reference, run
        _release()


def ring_rows(check: Check):
    mode, device = check.mode, check.mode.device
    hq, hk, d = mode.heads
    w = mode.window // 8
    docs = max(mode.documents // 1000, 4)
    cases = []
    for size in (2, 4):
        n = mode.ring_seq
        cases += [(size, attn.Case(f"R={size}, causal, GQA, bf16", n, hq, hk, d, torch.bfloat16)),
                  (size, attn.Case(f"R={size}, causal, GQA, fp32", n, hq, hk, d, torch.float32))]
    cases += [(4, attn.Case(f"R=4, {docs} documents, bf16", mode.ring_seq, hq, hk, d,
                            torch.bfloat16, documents=docs)),
              (4, attn.Case(f"R=4, window {w}, bf16", mode.ring_seq, hq, hk, d, torch.bfloat16,
                            window=w))]
    for size, case in cases:
        check.need(10, case.name)
        q, k, v, dout, documents = attn.inputs(case, device)
        full = [t.float() for t in (q, k, v, dout)]
        reference = attn.one_device(replace(case, dtype=torch.float32), *full, documents,
                                    device, repeats=1, fused_only=False).results
        ring = attn.virtual_ring(case, size, q, k, v, dout, documents, device)
        out_err, grad_err = attn.errors(ring.results, reference)
        out_bound, grad_bound = case.bounds()
        ok = out_err <= out_bound and grad_err <= grad_bound and ring.converged
        note = f"{ring.passes} passes" + ("" if ring.converged else ", no bitwise fixpoint")
        yield [case.name, f"{out_err:.1e}", f"{grad_err:.1e}", f"{out_bound:g} / {grad_bound:g}",
               _ms(ring.seconds), _mib(ring.working_mib), _status(ok), note]
        del reference, ring
        _release()
    yield from ring_memory_rows(check)


def ring_memory_rows(check: Check):
    """Working memory per virtual rank at two local lengths, and against one-device attention
    at the same tokens per rank (what Ulysses alone would hold: N tokens, heads / R)."""
    mode, device = check.mode, check.mode.device
    hq, hk, d = mode.heads
    size = 4
    if device != "cuda":
        yield ["R=4 memory per doubling of C", "-", "-", f"<= {RING_GROWTH_BOUND}x", "-", "-",
               "SKIP", "memory rows need CUDA's allocator statistics"]
        return
    working = []
    for n in mode.ring_growth_seqs:
        check.need(20, f"ring memory at N={n}")
        case = attn.Case(f"R=4, N={n}", n, hq, hk, d, torch.bfloat16)
        q, k, v, dout, _ = attn.inputs(case, device)
        ring = attn.virtual_ring(case, size, q, k, v, dout, None, device)
        one = attn.one_device(replace(case, heads=hq // size, kv_heads=max(hk // size, 1)),
                              *attn.inputs(replace(case, heads=hq // size,
                                                   kv_heads=max(hk // size, 1)), device)[:4],
                              None, device)
        working.append(ring.working_mib)
        ratio = ring.working_mib / one.working_mib
        yield [f"R=4 at N={n} (C={n // (2 * size)}) vs one device, heads/R", "-", "-",
               f"<= {RING_VS_ONE_DEVICE_BOUND}x", _ms(ring.seconds), _mib(ring.working_mib),
               _status(ratio <= RING_VS_ONE_DEVICE_BOUND),
               f"{ratio:.2f}x one-device attention ({_mib(one.working_mib)} MiB)"]
        del ring, one, q, k, v, dout
        _release()
    growth = working[1] / working[0]
    yield ["R=4 memory per doubling of C", "-", "-", f"<= {RING_GROWTH_BOUND}x", "-", "-",
           _status(growth <= RING_GROWTH_BOUND), f"{growth:.2f}x"]


def offload_rows(check: Check):
    mode = check.mode
    base = COMMON + LLAMA + mode.small + mode.offload_model + [
        "--train-iters", "3", "--bf16", "--recompute-granularity", "full",
        "--recompute-method", "uniform"]
    with _deterministic():
        plain = train_run(base, mode.device, keep_state=True)
        check.need(15, "the offloaded run")
        offload = train_run(base + ["--activation-checkpoint-cpu-offload"], mode.device,
                            keep_state=True)
        same = offload.losses == plain.losses and _tensors_equal(offload.params, plain.params)
        status, why = _status(same), "3 bf16 steps; losses and parameters compared"
        if not same:   # is it the offload, or kernels that differ from run to run?
            again = train_run(base, mode.device, keep_state=True)
            if not _tensors_equal(again.params, plain.params):
                status = "SKIP"
                why = "plain recompute differs from itself: kernels not deterministic"
    where = "pinned host memory, side stream" if mode.device == "cuda" else "CPU: no copy"
    runs = (("full recompute", plain), ("+ --activation-checkpoint-cpu-offload", offload))
    for name, run in runs:
        yield [name, f"{sum(run.seconds[1:]) / max(len(run.seconds) - 1, 1):.3f}",
               _gib(run.peak_gib), "bitwise", status, where if run is offload else why]


def checkpoint_rows(check: Check):
    mode = check.mode
    base = COMMON + LLAMA + mode.small + ["--train-iters", "4", "--ckpt-format", "torch_dist"]
    with tempfile.TemporaryDirectory(prefix="gpu_check_ckpt_") as tmp, _deterministic():
        saved = train_run(base + ["--save", tmp, "--save-interval", "2", "--async-save",
                                  "--exit-interval", "2"], mode.device, keep_state=True)
        check.need(20, "the resumed runs")
        trainer = setup(configure(base + ["--load", tmp], world_size=1))
        try:
            same = (_tensors_equal(saved.params, [p.detach() for p in trainer.model.parameters()])
                    and _tensors_equal(saved.optimizer_state, trainer.optimizer.state_dict()))
            yield ["async save at step 2, load: parameters and optimizer state",
                   "bitwise" if same else "differ", "bitwise", _status(same),
                   f"torch_dist, --async-save, on {mode.device}"]
            resumed = trainer.train()
        finally:
            del trainer
            _release()
        whole = train_run(base, mode.device).losses
        diff = _max_diff(resumed, whole[2:])
        yield ["resumed steps 3-4 vs the uninterrupted run", f"{diff:.2e}",
               f"<= {FP32_LOSS_TOLERANCE:g} (0: bitwise)", _status(diff <= FP32_LOSS_TOLERANCE),
               "fp32, deterministic algorithms where torch has them"]


@contextlib.contextmanager
def _deterministic():
    """torch's deterministic algorithms (warning where an op has none), for bitwise rows:
    kernels that accumulate with atomics would otherwise differ between two runs."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def adamw_rows(check: Check):
    """Fused AdamW against foreach AdamW: same start, same gradients, 3 steps."""
    device = check.mode.device
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
    yield ["fused AdamW vs foreach AdamW (3 steps)", f"{diff:.2e}", "< 1e-06 (rel.)",
           _status(diff < 1e-6), ""]


def fused_rows(check: Check):
    mode = check.mode
    base = COMMON + LLAMA + mode.small + ["--train-iters", "3"]
    backend = ["--fused-layers-backend", "aot_eager"] if mode.device == "cpu" else []
    eager = train_run(base, mode.device)
    check.need(60, "compiling the layers")
    fused = train_run(base + ["--fused-layers"] + backend, mode.device)
    diff = _max_diff(fused.losses, eager.losses)
    steady_fused, steady_eager = fused.seconds[-1], eager.seconds[-1]
    compile_s = fused.seconds[0] + fused.seconds[1] - 2 * steady_fused
    yield ["--fused-layers vs eager layers, fp32 losses", f"{diff:.2e}",
           f"< {FP32_LOSS_TOLERANCE:g}", f"{compile_s:.1f}",
           f"{steady_fused / steady_eager:.2f}", _status(diff < FP32_LOSS_TOLERANCE),
           f"backend {'aot_eager (CPU)' if backend else 'inductor'}"]


def _documents_batches(cfg, device: str, documents: int) -> Iterator:
    """Synthetic global batches of one sample of N tokens holding exactly `documents`
    documents (EOD tokens at random places), built by the data pipeline's own function."""
    n, vocab = cfg.model.seq_length, cfg.model.vocab_size
    eod = vocab - 1              # the mock data's EOD (training/data.eod_token_for)
    g = torch.Generator().manual_seed(0)
    while True:
        texts = torch.randint(0, vocab - 1, (1, n + 1), generator=g)
        if documents > 1:
            ends = torch.randperm(n - 1, generator=g)[:documents - 1]
            texts[0, ends] = eod
        mb = build_micro_batch(texts, eod_token=eod, reset_position_ids=True,
                               reset_attention_mask=documents > 0)
        yield [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}]


def documents_rows(check: Check):
    mode = check.mode
    n = mode.documents_seq
    model = (["--num-layers", "2"] + mode.big[2:]) if mode.device == "cuda" else mode.big
    base = COMMON + model + ["--seq-length", str(n), "--max-position-embeddings", str(n),
                             "--micro-batch-size", "1", "--global-batch-size", "1",
                             "--train-iters", "3", "--bf16", "--tiled-loss-chunk-size",
                             str(min(8192, n // 4)), "--reset-position-ids"]
    window = ["--window-size", str(mode.window), "0"]
    docs = ["--reset-attention-mask"]
    plan = [("causal (no documents)", [], 0), (f"{mode.documents:,} documents", docs,
                                               mode.documents),
            (f"window {mode.window}", window, 0),
            (f"{mode.documents:,} documents + window {mode.window}", docs + window,
             mode.documents)]
    causal_s = None
    for name, extra, documents in plan:
        check.need(30, name)
        cfg = configure(base + extra, world_size=1)
        run = train_run(base + extra, mode.device,
                        batches=_documents_batches(cfg, mode.device, documents))
        seconds = sum(run.seconds[1:]) / max(len(run.seconds) - 1, 1)
        fits = run.peak_gib is None or run.peak_gib <= MEMORY_BOUND * run.estimate_gib
        # Fewer scores than dense causal attention: never slower (a GPU figure; CPU timings
        # of these tiny shapes are noise).
        faster = causal_s is None or seconds <= causal_s or mode.device != "cuda"
        causal_s = causal_s or seconds
        note = "" if faster else "slower than dense causal attention at the same length"
        yield [name, f"{seconds:.2f}", _gib(run.peak_gib), f"{run.estimate_gib:.2f}",
               f"<= {MEMORY_BOUND}x estimate" + ("; <= causal time" if extra else ""),
               _status(fits and faster), note]


def _perf_argv(mode: Mode, seq: int, use_flash: bool, recompute: bool) -> list:
    argv = COMMON + mode.big + ["--seq-length", str(seq), "--max-position-embeddings", str(seq),
                                "--micro-batch-size", "1", "--global-batch-size", "1",
                                "--train-iters", "4", "--bf16"]
    if use_flash:
        argv.append("--use-flash-attn")
    if recompute:
        argv += ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    return argv


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error)


def performance_rows(check: Check):
    mode = check.mode
    use_flash = attention.flash_attn_refusal(torch.device(mode.device), torch.bfloat16) is None
    plan = [(seq, False) for seq in mode.lengths]
    seq = mode.longest_from
    while seq <= mode.longest_cap:
        plan.append((seq, True))
        seq *= 2
    rate = None        # measured FLOP/s, to predict longer runs' time
    for seq, recompute in plan:
        argv = _perf_argv(mode, seq, use_flash, recompute)
        cfg = configure(argv, world_size=1)
        tokens = cfg.train.global_batch_size * seq
        flops = flops_per_token(cfg.model, cfg.model.padded_vocab_size(1)) * tokens
        estimate = estimate_config(cfg).total_bytes / GiB
        if rate is not None:   # 4 iterations with full recompute, plus start-up
            check.need(5 * flops / rate + 20, f"sequence {seq}")
        try:
            run = train_run(argv, mode.device)
        except RuntimeError as e:   # the longest search ends at the first length that OOMs
            if not (recompute and _is_oom(e)):
                raise
            _release()
            yield [seq, "full", "out of memory", "", "", "", "", "", f"{estimate:.1f}",
                   "PASS", "the longest search ends here"]
            return
        seconds = sum(run.seconds[1:]) / len(run.seconds[1:])
        rate = flops / seconds
        tflops = flops / seconds / 1e12
        peak = peak_tflops(cfg)
        fits = run.peak_gib is None or run.peak_gib <= MEMORY_BOUND * estimate
        yield [seq, "full" if recompute else "none", f"{tokens / seconds:,.0f}", f"{tflops:.3g}",
               f"{tflops / peak:.1%}" if peak else "n/a", f"{seconds:.2f}",
               f"{run.init_seconds:.1f}", _gib(run.peak_gib), f"{estimate:.2f}",
               _status(fits), f"<= {MEMORY_BOUND}x estimate"]


def sections(mode: Mode) -> list[Section]:
    kernel = ("flash-attn 2" if attention.flash_attn_refusal(torch.device(mode.device),
                                                              torch.bfloat16) is None
              else "torch SDPA")
    attention_header = ["path", "out error", "grad error", "bound (out / grads)",
                        "fwd+bwd ms", "working MiB", "status", "note"]
    return [
        Section("precision", "Training steps against fp32 (per-step losses)",
                ["check", "max loss diff / result", "bound", "status", "note"], precision_rows,
                60, "A 4-layer Llama-style model (GQA, RoPE, SwiGLU), same seed and data."),
        Section("attention", "Attention paths on the device, against fp64 dense attention",
                attention_header, attention_rows, 20,
                f"N = {mode.attention_seq}, {mode.heads[0]} q heads (GQA: {mode.heads[1]} kv), "
                f"head dim {mode.heads[2]}, forward + backward through the model's attention "
                f"core; errors are max |x - ref| / max |ref| over the output and over dq, dk, "
                f"dv. On CUDA SDPA may not use its math kernel."),
        Section("ring", "Ring attention: R virtual ranks in one process", attention_header,
                ring_rows, 40,
                f"N = {mode.ring_seq}; against the one-device path in fp32 on the same inputs. "
                f"Time: the slowest rank's forward + backward; memory: the largest rank's "
                f"peak above its inputs (messages handed over in memory; no communication)."),
        Section("offload", "Activation offload against plain full recompute",
                ["run", "s/iter", "peak GiB", "bound", "status", "note"], offload_rows, 30),
        Section("checkpoint", "torch_dist --async-save and resume",
                ["check", "result", "bound", "status", "note"], checkpoint_rows, 30),
        Section("adamw", "Fused AdamW", ["check", "rel. diff", "bound", "status", "note"],
                adamw_rows, 5),
        Section("fused", "--fused-layers (torch.compile per layer)",
                ["check", "max loss diff", "bound", "compile s", "fused/eager step time",
                 "status", "note"], fused_rows, 90,
                "3 steps of the precision section's model; compile time = the first two "
                "steps' (forward and backward graphs) excess over the third's time."),
        Section("documents", f"Documents and windows at {mode.documents_seq:,} tokens",
                ["attention", "s/iter", "peak GiB", "estimator GiB", "bound", "status", "note"],
                documents_rows, 60,
                "Two layers of the 1.3B GPT (hidden 2048, 16 heads, RoPE, bf16, tiled loss), "
                "one sample, synthetic tokens; peak = torch.cuda.max_memory_allocated."),
        Section("performance", "Speed and memory of a 1.3B GPT",
                ["sequence", "recompute", "tokens/s", "TFLOP/s", "MFU", "s/iter", "init s",
                 "peak GiB", "estimator GiB (--dry-run)", "status", "note"], performance_rows,
                60,
                f"24 layers, hidden 2048, 16 heads, RoPE, bf16, micro-batch 1, attention "
                f"kernel {kernel}; the longest sequence doubles from {mode.longest_from} with "
                f"full recompute while the budget lasts. TFLOP/s counts Megatron's formula "
                f"(full N² attention, training/metrics.py); the estimator excludes the CUDA "
                f"context and allocator fragmentation."),
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true",
                        help="reduced mode on CPU (tiny shapes, the same code paths)")
    parser.add_argument("--sections", nargs="+", metavar="NAME",
                        help="run only these sections (default: all, in order): precision "
                             "attention ring offload checkpoint adamw fused documents "
                             "performance")
    parser.add_argument("--write-docs", action="store_true",
                        help="write the tables into docs/benchmarks.md and docs/gpu.md "
                             "(section gpu-check), after every section")
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
    where = torch.cuda.get_device_name() if mode.device == "cuda" else (
        "CPU (reduced mode: tiny shapes, the GPU check's code paths; its numbers say nothing "
        "about GPUs)")
    check.print(f"GPU check on {where}; torch {torch.__version__}; budget "
                f"{mode.budget_s:.0f} s.\n{SCOPE}")
    for section in every:
        if args.sections is None or section.key in args.sections:
            check.run(section)
    check.print(f"\n{check.summary()}")
    if args.write_docs:
        check.write(finished=True)
    return 1 if check.counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
