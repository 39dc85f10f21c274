"""The GPU check's training sections: whole training runs through pretrain_gpt.py's own
configure/setup/train (precision, activation offload, torch_dist async save and resume, fused
AdamW, compiled layers, documents at 128K tokens, a 1.3B GPT's speed and memory)."""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megatron_ul.data.batches import build_micro_batch
from megatron_ul.model.attention import flash_attn as attention
from megatron_ul.optim.precision import GradScaler
from megatron_ul.training.memory_estimator import GiB, estimate_config
from megatron_ul.training.metrics import flops_per_token, peak_tflops
from megatron_ul.training.pretrain import configure, setup
from tools.gpu_check_runner import (
    FP32_LOSS_TOLERANCE,
    HALF_PRECISION_LOSS_TOLERANCE,
    MEMORY_BOUND,
    Check,
    Mode,
    Row,
    gib,
    peak_gib,
    peak_reset,
    release,
    verdict,
)
from tools.gpu_check_sdpa import SdpaRecorder

COMMON = [
    "--mock-data",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--seed",
    "42",
    "--log-interval",
    "1000000",
    "--lr",
    "1e-3",
    "--lr-warmup-iters",
    "1",
    "--min-lr",
    "1e-4",
    "--adam-eps",
    "1e-6",
]
ATTENTION_DROPOUT = 0.1  # Megatron's default --attention-dropout
LLAMA = [
    "--group-query-attention",
    "--position-embedding-type",
    "rope",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
]


@dataclass
class TrainRun:
    losses: list
    calls: Counter  # attention kernels of the first iteration (SdpaRecorder), if recorded
    seconds: list  # per timed iteration (the first includes any compilation)
    peak_gib: float | None
    estimate_gib: float
    init_seconds: float
    params: list  # final parameters (when asked for)
    optimizer_state: dict  # final optimizer state_dict (when asked for)
    scaler: GradScaler | None  # the fp16 loss scaler, if the run has one
    trainer_cfg: object


class _FirstIteration:
    """An SdpaRecorder active from the start of training to the second batch fetch: the
    first iteration's attention calls (untimed: the timings leave the first iteration out)."""

    def __init__(self, record: bool):
        self.recorder = SdpaRecorder() if record else None
        self.active = False

    def start(self) -> None:
        if self.recorder is not None:
            self.recorder.__enter__()
            self.active = True

    def stop(self) -> None:
        if self.active and self.recorder is not None:
            self.active = False
            self.recorder.__exit__(None, None, None)

    @property
    def calls(self) -> Counter:
        return self.recorder.calls if self.recorder is not None else Counter()


def _timed(batches: Iterator, device: str, stamps: list, first: _FirstIteration) -> Iterator:
    """Yield from `batches`, stamping the time of each fetch: the training loop fetches one
    global batch per iteration, so consecutive stamps bound one iteration."""
    for batch in batches:
        if len(stamps) == 1:
            first.stop()
        if device == "cuda":
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())
        yield batch


def train_run(
    argv: list,
    device: str,
    batches: Iterator | None = None,
    keep_state: bool = False,
    sdpa_flash: bool = False,
    record: bool = False,
) -> TrainRun:
    """Train with pretrain_gpt.py's flags (the real loop: whatever --bf16 or --fused-layers
    mean today), optionally on our own batches; time each iteration and (record) count the
    attention kernels of the first one."""
    cfg = configure(argv, world_size=1)
    peak_reset(device)
    start = time.perf_counter()
    trainer = setup(cfg)
    init_seconds = time.perf_counter() - start
    stamps: list = []
    first = _FirstIteration(record)
    trainer.train_batches = _timed(
        batches if batches is not None else trainer.train_batches, device, stamps, first
    )
    peak_reset(device)
    try:
        with _sdpa_flash_kernel(device) if sdpa_flash else contextlib.nullcontext():
            first.start()
            try:
                losses = trainer.train()
            finally:
                first.stop()
        if device == "cuda":
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())
        peak = peak_gib(device)
        params = [p.detach().clone() for p in trainer.model.parameters()] if keep_state else []
        state = _cloned(trainer.optimizer.state_dict()) if keep_state else {}
        return TrainRun(
            losses,
            first.calls,
            [b - a for a, b in zip(stamps, stamps[1:])],
            peak,
            estimate_config(cfg).total_bytes / GiB,
            init_seconds,
            params,
            state,
            trainer.grad_scaler,
            cfg,
        )
    finally:
        del trainer
        release()


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
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(_tensors_equal(a[k], b[k]) for k in a)
        )
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


def precision_rows(check: Check):
    mode = check.mode
    base = COMMON + LLAMA + mode.small + ["--train-iters", str(mode.steps)]
    fp32 = train_run(base, mode.device).losses
    bound = f"< {HALF_PRECISION_LOSS_TOLERANCE:g}"

    def against_fp32(name, run, note):
        diff = _max_diff(run.losses, fp32)
        ok = diff < HALF_PRECISION_LOSS_TOLERANCE and run.losses != fp32
        return Row([name, f"{diff:.2e}", bound, verdict(ok), note], run.calls)

    run = train_run(base + ["--bf16"], mode.device, record=True)
    yield against_fp32("bf16 vs fp32 (SDPA's own choice)", run, "")
    run = train_run(base + ["--bf16"], mode.device, sdpa_flash=True, record=True)
    yield against_fp32(
        "bf16, torch SDPA flash kernel vs fp32",
        run,
        "SDPA forced to FLASH_ATTENTION" if mode.device == "cuda" else "CPU SDPA",
    )
    why_not = attention.flash_attn_refusal(torch.device(mode.device), torch.bfloat16)
    if why_not is not None:
        yield ["bf16, flash-attn 2 vs fp32", "-", bound, "SKIP", why_not]
    else:
        calls = [0]
        with _counting_flash_attn_calls(calls):
            run = train_run(base + ["--bf16", "--use-flash-attn"], mode.device, record=True)
        row = against_fp32("bf16, flash-attn 2 vs fp32", run, f"{calls[0]} flash_attn_func calls")
        if calls[0] == 0:
            row.cells[3] = "FAIL"
        yield row
    run = train_run(base + ["--fp16", "--initial-loss-scale", "4096"], mode.device, record=True)
    scaler = _loss_scaler(run)
    yield against_fp32(
        "fp16 + dynamic loss scaling vs fp32",
        run,
        f"final scale {scaler.scale:g}, {scaler.skipped_steps} skipped",
    )
    run = train_run(
        base
        + [
            "--fp16",
            "--initial-loss-scale",
            str(2.0**120),
            "--hysteresis",
            "1",
            "--train-iters",
            "2",
        ],
        mode.device,
        record=True,
    )
    scaler = _loss_scaler(run)
    ok = scaler.skipped_steps == 2 and scaler.scale == 2.0**118
    yield Row(
        [
            "fp16 overflow: loss scale 2^120 for 2 steps",
            f"{scaler.skipped_steps} skipped",
            "2 skipped, scale 2^118",
            verdict(ok),
            "",
        ],
        run.calls,
    )


def offload_rows(check: Check):
    mode = check.mode
    base = (
        COMMON
        + LLAMA
        + mode.small
        + mode.offload_model
        + [
            "--train-iters",
            "3",
            "--bf16",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
        ]
    )
    with _deterministic():
        plain = train_run(base, mode.device, keep_state=True)
        check.need(15, "the offloaded run")
        offload = train_run(
            base + ["--activation-checkpoint-cpu-offload"], mode.device, keep_state=True
        )
        same = offload.losses == plain.losses and _tensors_equal(offload.params, plain.params)
        status, why = verdict(same), "3 bf16 steps; losses and parameters compared"
        if not same:  # is it the offload, or kernels that differ from run to run?
            again = train_run(base, mode.device, keep_state=True)
            if not _tensors_equal(again.params, plain.params):
                status = "SKIP"
                why = "plain recompute differs from itself: kernels not deterministic"
    where = "pinned host memory, side stream" if mode.device == "cuda" else "CPU: no copy"
    runs = (("full recompute", plain), ("+ --activation-checkpoint-cpu-offload", offload))
    for name, run in runs:
        yield [
            name,
            f"{sum(run.seconds[1:]) / max(len(run.seconds) - 1, 1):.3f}",
            gib(run.peak_gib),
            "bitwise",
            status,
            where if run is offload else why,
        ]


# Bytes per parameter the offloaded bf16 run must save at its peak: the fp32 main parameters
# and Adam's moments (12) and most of the host-held fp32 gradients (4, less one parameter's
# fp32 staging); without host-held gradients the saving is 12.
OPTIMIZER_OFFLOAD_SAVING_BOUND = 14.0


def optimizer_offload_rows(check: Check):
    """2 bf16 steps of 2 micro-batches with and without --optimizer-cpu-offload: the same
    first loss (the same forward), the second within the half-precision tolerance (the step
    runs in CPU foreach AdamW instead of the fused CUDA kernel; on CPU both are bitwise), and on
    a GPU a peak lower by the main parameters, Adam's moments and the fp32 gradients."""
    mode = check.mode
    base = COMMON + LLAMA + mode.small + ["--train-iters", "2", "--bf16"]
    with _deterministic():
        plain = train_run(base, mode.device, keep_state=True)
        check.need(15, "the offloaded run")
        offload = train_run(base + ["--optimizer-cpu-offload"], mode.device, keep_state=True)
    elements = sum(p.numel() for p in plain.params)
    diff = max(abs(a - b) for a, b in zip(offload.losses, plain.losses))
    if mode.device == "cuda":
        losses_ok = offload.losses[0] == plain.losses[0] and diff < HALF_PRECISION_LOSS_TOLERANCE
        losses_bound = f"step 1 equal, step 2 < {HALF_PRECISION_LOSS_TOLERANCE:g}"
    else:
        losses_ok, losses_bound = offload.losses == plain.losses, "bitwise (CPU)"
    yield ["bf16, losses", f"{diff:.2e}", losses_bound, verdict(losses_ok), ""]
    if plain.peak_gib is None or offload.peak_gib is None:
        yield ["bf16, peak saving", "-", "GPU only", "SKIP", "CPU: the host is the device"]
        return
    saved = (plain.peak_gib - offload.peak_gib) * GiB / elements
    yield [
        "bf16, peak saving per parameter",
        f"{saved:.1f} B ({plain.peak_gib:.2f} -> {offload.peak_gib:.2f} GiB)",
        f">= {OPTIMIZER_OFFLOAD_SAVING_BOUND:g} B",
        verdict(saved >= OPTIMIZER_OFFLOAD_SAVING_BOUND),
        f"{elements / 1e6:.0f}M parameters; expected 16 B less one parameter's fp32 staging",
    ]


def checkpoint_rows(check: Check):
    mode = check.mode
    base = COMMON + LLAMA + mode.small + ["--train-iters", "4", "--ckpt-format", "torch_dist"]
    with tempfile.TemporaryDirectory(prefix="gpu_check_ckpt_") as tmp, _deterministic():
        saved = train_run(
            base + ["--save", tmp, "--save-interval", "2", "--async-save", "--exit-interval", "2"],
            mode.device,
            keep_state=True,
        )
        check.need(20, "the resumed runs")
        trainer = setup(configure(base + ["--load", tmp], world_size=1))
        try:
            same = _tensors_equal(
                saved.params, [p.detach() for p in trainer.model.parameters()]
            ) and _tensors_equal(saved.optimizer_state, trainer.optimizer.state_dict())
            yield [
                "async save at step 2, load: parameters and optimizer state",
                "bitwise" if same else "differ",
                "bitwise",
                verdict(same),
                f"torch_dist, --async-save, on {mode.device}",
            ]
            resumed = trainer.train()
        finally:
            del trainer
            release()
        whole = train_run(base, mode.device).losses
        diff = _max_diff(resumed, whole[2:])
        yield [
            "resumed steps 3-4 vs the uninterrupted run",
            f"{diff:.2e}",
            f"<= {FP32_LOSS_TOLERANCE:g} (0: bitwise)",
            verdict(diff <= FP32_LOSS_TOLERANCE),
            "fp32, deterministic algorithms where torch has them",
        ]


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


def _loss_scaler(run: TrainRun) -> GradScaler:
    if run.scaler is None:
        raise RuntimeError("an --fp16 run without a loss scaler")
    return run.scaler


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
        opt = torch.optim.AdamW(
            params, lr=1e-3, weight_decay=0.1, fused=fused or None, foreach=not fused or None
        )
        for step in grads:
            for p, grad in zip(params, step):
                p.grad = grad.to(device)
            opt.step()
        finals.append([p.detach().cpu() for p in params])
    diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(*finals))
    yield [
        "fused AdamW vs foreach AdamW (3 steps)",
        f"{diff:.2e}",
        "< 1e-06 (rel.)",
        verdict(diff < 1e-6),
        "",
    ]


def fused_rows(check: Check):
    """--fused-layers against eager layers: bf16 (the training configuration) first, then
    fp32; each fused run compiles cold (the first two steps: forward and backward graphs)."""
    mode = check.mode
    base = COMMON + LLAMA + mode.small + ["--train-iters", "3"]
    backend = ["--fused-layers-backend", "aot_eager"] if mode.device == "cpu" else []
    for precision, flags, tolerance in (
        ("bf16", ["--bf16"], HALF_PRECISION_LOSS_TOLERANCE),
        ("fp32", [], FP32_LOSS_TOLERANCE),
    ):
        check.need(45, f"compiling the layers in {precision}")
        eager = train_run(base + flags, mode.device)
        # (not recorded: a TorchFunctionMode would be traced into the compiled layers)
        fused = train_run(base + flags + ["--fused-layers"] + backend, mode.device)
        diff = _max_diff(fused.losses, eager.losses)
        steady_fused, steady_eager = fused.seconds[-1], eager.seconds[-1]
        compile_s = fused.seconds[0] + fused.seconds[1] - 2 * steady_fused
        yield [
            f"--fused-layers vs eager layers, {precision} losses",
            f"{diff:.2e}",
            f"< {tolerance:g}",
            f"{compile_s:.1f}",
            f"{steady_fused / steady_eager:.2f}",
            verdict(diff < tolerance),
            f"backend {'aot_eager (CPU)' if backend else 'inductor'}",
        ]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value (a ZeRO-3 parameter is a DTensor sharded over one rank)."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def zero3_rows(check: Check):
    """--zero-stage 3 (FSDP2 over a one-rank mesh) against the plain optimizer: the same
    losses (fp32 to the project's bar; bf16, where FSDP2 casts the gathered parameters, within
    the half-precision tolerance), the final parameters and both peaks."""
    mode = check.mode
    base = COMMON + LLAMA + mode.small + ["--train-iters", str(mode.steps)]
    for precision, flags, tolerance in (
        ("fp32", [], FP32_LOSS_TOLERANCE),
        ("bf16", ["--bf16"], HALF_PRECISION_LOSS_TOLERANCE),
    ):
        check.need(15, f"ZeRO-3 in {precision}")
        with _deterministic():
            plain = train_run(base + flags, mode.device, keep_state=True)
            zero3 = train_run(
                base + flags + ["--zero-stage", "3"], mode.device, keep_state=True, record=True
            )
        diff = _max_diff(zero3.losses, plain.losses)
        params = max(
            float((_local(a).float() - b.float()).abs().max() / b.float().abs().max())
            for a, b in zip(zero3.params, plain.params)
        )
        yield Row(
            [
                f"ZeRO-3 on one rank vs plain AdamW, {precision}",
                f"{diff:.2e}",
                f"{params:.2e}",
                f"< {tolerance:g}",
                gib(zero3.peak_gib),
                gib(plain.peak_gib),
                verdict(diff < tolerance),
                f"{mode.steps} steps; parameters: largest relative difference",
            ],
            zero3.calls,
        )


def _documents_batches(cfg, device: str, documents: int) -> Iterator:
    """Synthetic global batches of one sample of N tokens holding exactly `documents`
    documents (EOD tokens at random places), built by the data pipeline's own function."""
    n, vocab = cfg.model.seq_length, cfg.model.vocab_size
    eod = vocab - 1  # the mock data's EOD (training/data.eod_token_for)
    g = torch.Generator().manual_seed(0)
    while True:
        texts = torch.randint(0, vocab - 1, (1, n + 1), generator=g)
        if documents > 1:
            ends = torch.randperm(n - 1, generator=g)[: documents - 1]
            texts[0, ends] = eod
        mb = build_micro_batch(
            texts, eod_token=eod, reset_position_ids=True, reset_attention_mask=documents > 0
        )
        yield [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}]


def documents_rows(check: Check):
    mode = check.mode
    n = mode.documents_seq
    model = (["--num-layers", "2"] + mode.big[2:]) if mode.device == "cuda" else mode.big
    base = (
        COMMON
        + model
        + [
            "--seq-length",
            str(n),
            "--max-position-embeddings",
            str(n),
            "--micro-batch-size",
            "1",
            "--global-batch-size",
            "1",
            "--train-iters",
            "3",
            "--bf16",
            "--tiled-loss-chunk-size",
            str(min(8192, n // 4)),
            "--reset-position-ids",
        ]
    )
    window = ["--window-size", str(mode.window), "0"]
    docs = ["--reset-attention-mask"]
    dropout = ["--attention-dropout", str(ATTENTION_DROPOUT)]
    plan = [
        ("causal (no documents)", [], 0),
        (f"{mode.documents:,} documents", docs, mode.documents),
        (
            f"{mode.documents:,} documents, --attention-dropout {ATTENTION_DROPOUT:g}",
            docs + dropout,
            mode.documents,
        ),
        (f"window {mode.window}", window, 0),
        (f"{mode.documents:,} documents + window {mode.window}", docs + window, mode.documents),
    ]
    causal_s = documents_s = None
    for name, extra, documents in plan:
        check.need(45 if dropout[0] in extra else 25, name)
        cfg = configure(base + extra, world_size=1)
        run = train_run(
            base + extra,
            mode.device,
            batches=_documents_batches(cfg, mode.device, documents),
            record=True,
        )
        seconds = sum(run.seconds[1:]) / max(len(run.seconds) - 1, 1)
        fits = run.peak_gib is None or run.peak_gib <= MEMORY_BOUND * run.estimate_gib
        with_dropout = dropout[0] in extra
        # Fewer scores than dense causal attention: never slower (a GPU figure; CPU timings
        # of these tiny shapes are noise). Dropout runs another kernel path: its time is
        # reported next to the same documents without dropout, not bounded.
        faster = causal_s is None or with_dropout or seconds <= causal_s or mode.device != "cuda"
        causal_s = causal_s or seconds
        note = "" if faster else "slower than dense causal attention at the same length"
        if with_dropout and documents_s:
            note = f"{seconds / documents_s:.2f}x the time without dropout"
        elif extra == docs:
            documents_s = seconds
        bound = f"<= {MEMORY_BOUND}x estimate" + (
            "; <= causal time" if extra and not with_dropout else ""
        )
        yield Row(
            [
                name,
                f"{seconds:.2f}",
                gib(run.peak_gib),
                f"{run.estimate_gib:.2f}",
                bound,
                verdict(fits and faster),
                note,
            ],
            run.calls,
        )


def _perf_argv(mode: Mode, seq: int, use_flash: bool, recompute: bool) -> list:
    argv = (
        COMMON
        + mode.big
        + [
            "--seq-length",
            str(seq),
            "--max-position-embeddings",
            str(seq),
            "--micro-batch-size",
            "1",
            "--global-batch-size",
            "1",
            "--train-iters",
            "2" if recompute else "4",
            "--bf16",
        ]
    )
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
    rate = None  # measured FLOP/s, to predict longer runs' time
    for seq, recompute in plan:
        argv = _perf_argv(mode, seq, use_flash, recompute)
        cfg = configure(argv, world_size=1)
        tokens = cfg.train.global_batch_size * seq
        flops = flops_per_token(cfg.model, cfg.model.padded_vocab_size(1)) * tokens
        estimate = estimate_config(cfg).total_bytes / GiB
        if rate is not None:  # 2 iterations with full recompute (4/3 the FLOPs), start-up
            check.need(3 * flops / rate + 20, f"sequence {seq}")
        try:
            run = train_run(argv, mode.device, record=True)
        except RuntimeError as e:  # the longest search ends at the first length that OOMs
            if not (recompute and _is_oom(e)):
                raise
            release()
            yield [
                seq,
                "full",
                "out of memory",
                "",
                "",
                "",
                "",
                "",
                f"{estimate:.1f}",
                "PASS",
                "the longest search ends here",
            ]
            return
        seconds = sum(run.seconds[1:]) / len(run.seconds[1:])
        rate = flops / seconds
        tflops = flops / seconds / 1e12
        peak = peak_tflops(cfg)
        fits = run.peak_gib is None or run.peak_gib <= MEMORY_BOUND * estimate
        yield Row(
            [
                seq,
                "full" if recompute else "none",
                f"{tokens / seconds:,.0f}",
                f"{tflops:.3g}",
                f"{tflops / peak:.1%}" if peak else "n/a",
                f"{seconds:.2f}",
                f"{run.init_seconds:.1f}",
                gib(run.peak_gib),
                f"{estimate:.2f}",
                verdict(fits),
                f"<= {MEMORY_BOUND}x estimate",
            ],
            run.calls,
            {"TFLOP/s": tflops, "MFU": tflops / peak if peak else None, "s/iter": seconds},
        )
