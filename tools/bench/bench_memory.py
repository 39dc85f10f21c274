"""Per-rank memory, measured: ZeRO model state over dp_sp, Ulysses activation memory over SP,
and the longest sequence that fits a memory cap with full recompute.

    python -m tools.bench.bench_memory   # prints the tables, writes docs/results/memory.md

All numbers are bytes of tensors a rank really holds (tools/bench/saved_bytes.py), on CPU
gloo ranks spawned here; no timing is involved.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import sys
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from tools.bench.common import run_ranks
from tools.bench.memory_targets import table_targets

if TYPE_CHECKING:
    from megatron_ul.model.gpt import GPTModel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIB = 2**20
STATE_MODEL = [
    "--num-layers",
    "4",
    "--hidden-size",
    "256",
    "--num-attention-heads",
    "8",
    "--vocab-size",
    "4000",
    "--seq-length",
    "256",
    "--micro-batch-size",
    "1",
]
ACT_MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "128",
    "--num-attention-heads",
    "8",
    "--vocab-size",
    "1000",
    "--micro-batch-size",
    "1",
    "--position-embedding-type",
    "rope",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0.1",
]
COMMON = [
    "--mock-data",
    "--train-iters",
    "4",
    "--log-interval",
    "100",
    "--distributed-timeout-minutes",
    "5",
]


# ---- 1. model state under ZeRO 0/1/2/3 --------------------------------------------------------
def model_state_worker(rank, world, argv):
    from megatron_ul.pipeline.schedules import forward_backward_no_pipelining
    from megatron_ul.training.pretrain import configure, setup
    from megatron_ul.training.step import count_tokens, train_step
    from tools.bench.saved_bytes import model_state_bytes

    trainer = setup(configure(argv, world))
    model, optimizer = trainer.model, trainer.optimizer
    train_step(model, optimizer, next(trainer.train_batches), clip_grad=1.0)  # Adam state exists
    batch = next(trainer.train_batches)  # gradients of one more step exist while we measure
    tokens = count_tokens(batch, torch.device("cpu"), model.dims).float()
    optimizer.start_step(len(batch))  # ZeRO-2 reduce-scatters each bucket as it completes
    forward_backward_no_pipelining(model, batch, tokens)
    return model_state_bytes(model, optimizer)


def table_model_state() -> str:
    sp2 = ["--ds-sequence-parallel-size", "2"]
    layouts = [(1, [], 1), (2, sp2, 1), (4, sp2, 2)]  # (dp_sp, flags, DP): dp_sp 4 = SP2 × DP2
    zero = {
        "ZeRO-0": [],
        "ZeRO-1": ["--use-distributed-optimizer"],
        "ZeRO-2": ["--zero-stage", "2"],
        "ZeRO-3": ["--zero-stage", "3"],
    }
    rows = [
        "| ZeRO | dp_sp | params MiB | grads MiB | optimizer MiB | total MiB | total vs dp_sp=1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, flags in zero.items():
        base = None
        for dp_sp, layout, dp in layouts:
            per_rank = run_ranks(
                model_state_worker,
                dp_sp,
                COMMON + STATE_MODEL + layout + flags + ["--global-batch-size", str(dp)],
            )
            m = max(per_rank, key=lambda r: r["total"])  # the fullest rank
            base = base or m["total"]
            rows.append(
                f"| {name} | {dp_sp} | {m['params'] / MIB:.2f} | {m['grads'] / MIB:.2f} | "
                f"{m['optimizer'] / MIB:.2f} | {m['total'] / MIB:.2f} | "
                f"{m['total'] / base:.3f} |"
            )
            print(rows[-1], flush=True)
    return "\n".join(rows)


# ---- 2. activations per layer over SP ------------------------------------------------------
def _local_batch(model_cfg, seq_length: int, dims):
    """This SP rank (of `dims`)'s tokens/positions/labels of one fixed random sequence."""
    sp, rank = dims.sp, dims.sp_rank
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model_cfg.vocab_size, (1, seq_length + 1), generator=g)
    chunk = seq_length // sp
    sl = slice(rank * chunk, (rank + 1) * chunk)
    positions = torch.arange(seq_length).unsqueeze(0)
    return tokens[:, :-1][:, sl], positions[:, sl], tokens[:, 1:][:, sl]


def layer_activation_worker(rank, world, argv, seq_length):
    from megatron_ul.training.pretrain import configure, setup
    from tools.bench.saved_bytes import saved_activation_bytes

    cfg = configure(argv, world)
    model = cast("GPTModel", setup(cfg).model)  # one stage: the configs here have no PP
    tokens, positions, _ = _local_batch(cfg.model, seq_length, model.dims)
    x, rotary = _layer_inputs(model, cfg, tokens, positions)
    _, saved = saved_activation_bytes(
        lambda: model.layers[0](x, rotary, None), exclude=list(model.parameters())
    )
    return saved


def table_layer_activations(seq_length: int) -> str:
    rows = [
        "| SP | tokens per rank | saved bytes per layer per rank (MiB) | vs SP=1 | 1/SP |",
        "|---|---|---|---|---|",
    ]
    base = None
    for sp in (1, 2, 4, 8):
        argv = (
            COMMON
            + ACT_MODEL
            + ["--seq-length", str(seq_length), "--ds-sequence-parallel-size", str(sp)]
        )
        saved = max(run_ranks(layer_activation_worker, sp, argv, seq_length))
        base = base or saved
        rows.append(
            f"| {sp} | {seq_length // sp} | {saved / MIB:.3f} | {saved / base:.3f} | {1 / sp:.3f} |"
        )
        print(rows[-1], flush=True)
    return "\n".join(rows)


# ---- 3. longest sequence under a cap with full recompute -----------------------------------------
def _layer_inputs(model, cfg, tokens, positions):
    from megatron_ul.model.rotary import rotary_cos_sin

    x = model.embed(tokens, positions).detach().requires_grad_()
    return x, rotary_cos_sin(positions.t(), cfg.model.head_dim, cfg.model.rotary_base, x.dtype)


def longest_sequence_worker(rank, world, argv, cap_bytes, start):
    """Doubling search on this SP group; every rank measures, the fullest rank decides.

    Per-rank bytes(N) = model state (measured after one small training step: params, grads,
    Adam state) + activations a full-recompute forward keeps at length N + the saved tensors of
    the one layer being recomputed during backward (its working set)."""
    from megatron_ul.training.pretrain import configure, setup
    from tools.bench.saved_bytes import model_state_bytes, saved_activation_bytes

    cfg = configure(argv + ["--seq-length", str(start)], world)
    trainer = setup(cfg)
    model = cast("GPTModel", trainer.model)  # one stage: the configs here have no PP
    params = list(model.parameters())
    tokens, positions, labels = _local_batch(cfg.model, start, model.dims)
    model(tokens, positions, None, labels).sum().backward()
    trainer.optimizer.step()
    state = model_state_bytes(model, trainer.optimizer)["total"]
    best, n = None, start
    while True:
        cfg.model.seq_length = n  # rope: no table depends on the length
        tokens, positions, labels = _local_batch(cfg.model, n, model.dims)
        model.cfg.recompute_granularity = "full"
        # the lambdas run at once, inside the call, so late binding cannot bite
        _, kept = saved_activation_bytes(
            lambda: model(tokens, positions, None, labels),  # noqa: B023
            exclude=params,
        )
        x, rotary = _layer_inputs(model, cfg, tokens, positions)
        _, layer = saved_activation_bytes(
            lambda: model.layers[0](x, rotary, None),  # noqa: B023
            exclude=params,
        )
        need = torch.tensor(float(state + kept + layer), device=tokens.device)
        dist.all_reduce(need, op=dist.ReduceOp.MAX)
        if need.item() > cap_bytes:
            return best
        best, n = (n, need.item()), n * 2


def table_longest_sequence(cap_bytes: int, start: int) -> str:
    rows = [
        f"| SP | longest sequence under {cap_bytes / MIB:.0f} MiB per rank | vs SP=1 | "
        f"per-rank MiB at that length |",
        "|---|---|---|---|",
    ]
    base = None
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    for sp in (1, 2, 4):
        argv = COMMON + ACT_MODEL + recompute + ["--ds-sequence-parallel-size", str(sp)]
        best, need = run_ranks(longest_sequence_worker, sp, argv, cap_bytes, start)[0]
        base = base or best
        rows.append(f"| {sp} | {best} | {best / base:.2f} | {need / MIB:.1f} |")
        print(rows[-1], flush=True)
    return "\n".join(rows)


# ---- 4. peak live tensors over two training iterations -----------------------------------------
PEAK_MODEL = [
    "--num-layers",
    "1",
    "--num-attention-heads",
    "8",
    "--vocab-size",
    "32000",
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--position-embedding-type",
    "rope",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--micro-batch-size",
    "1",
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--train-iters",
    "2",
    "--log-interval",
    "100",
    "--mock-data",
    "--distributed-timeout-minutes",
    "30",
]
LONG_CONTEXT = [
    "--tiled-loss-chunk-size",
    "1024",
    "--tiled-mlp-chunk-size",
    "4096",
    "--activation-checkpoint-cpu-offload",
    "--tokenizer-type",
    "NullTokenizer",
    "--reset-attention-mask",
    "--reset-position-ids",
]
# fp32; bf16: --bf16 as Megatron means it (a bf16 model, fp32 main parameters and gradients,
# optim/mixed_precision.py); autocast-bf16: the earlier meaning of --bf16, an fp32 model run
# under torch.autocast, kept here as the baseline. The whole step runs under autocast so that
# the offloaded layers' recompute (inside backward) casts as their forward did.
PRECISIONS = ("fp32", "bf16", "autocast-bf16")


def peak_worker(rank, world, argv, precision: str):
    """Two training iterations under the live-tensor tracker; per phase (forward, loss
    backward, layer backward (and the embedding's), gradient clipping, optimizer step) its peak
    and what was alive then."""
    from megatron_ul.training import step as step_module
    from megatron_ul.training.pretrain import configure, setup
    from tools.bench.fp32_half_kernels import Fp32HalfKernels, native_half_matmul_is_slow
    from tools.bench.live_tensors import LiveTensorTracker, peak_rss_bytes

    cfg = configure(argv + (["--bf16"] if precision == "bf16" else []), world)
    rss_start = peak_rss_bytes()
    offloaded = cfg.train.optimizer_cpu_offload
    with _host_held_gradients() if offloaded else contextlib.nullcontext():
        trainer = setup(cfg)
    model, optimizer = trainer.model, trainer.optimizer
    batches = [next(trainer.train_batches) for _ in range(cfg.train.train_iters)]
    params = list(model.parameters())
    # The half-precision model's fp32 main copies and main gradients exist before the tracker.
    held = [optimizer.states.get(p) for p in params]
    main = [s.main_param for s in held if s is not None and s.main_param is not None]
    main_grads = [s.main_grad for s in held if s is not None and s.main_grad is not None]

    def gradients():
        return {"gradients": main_grads + [p.grad for p in params + main if p.grad is not None]}

    tracker = LiveTensorTracker(model, preexisting=params + main + main_grads, classify=gradients)
    inner = optimizer.torch_optimizer

    def adam_state():
        return [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]

    if offloaded:  # fp32 main parameters, main gradients and (once made) Adam's on the host
        tracker.hold_on_host(main + main_grads)
        _after(optimizer, "step", lambda: tracker.hold_on_host(adam_state()))
    _phase_wrap(optimizer, "reduce_and_clip", tracker, "clip")
    _phase_wrap(optimizer, "step", tracker, "optimizer")
    _mark_backward_stages(model, tracker)
    autocast = precision == "autocast-bf16"
    # bf16 GEMMs are ~60x slower than fp32 ones on this project's AVX2 CPUs; the fp32 stand-in
    # runs below the tracker, which sees the same ops and tensors either way.
    wide = precision != "fp32" and native_half_matmul_is_slow()
    offload_on_host = _offloaded_activations_on_host(tracker)
    with Fp32HalfKernels() if wide else contextlib.nullcontext(), tracker, offload_on_host:
        for i, batch in enumerate(batches):
            tracker.phase = f"iteration {i + 1} forward"
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                step_module.train_step(model, optimizer, batch, clip_grad=cfg.train.clip_grad)
    classes = {"parameters": params + main, "optimizer state": adam_state()}
    phases = {}
    for phase, peak in tracker.peaks.items():
        phases[phase] = {
            # every storage, the host-held ones included (a CPU run's one memory)
            "peak": tracker.total_peaks[phase],
            # the device's alone, as a GPU run holds it: offloaded activations and, under
            # --optimizer-cpu-offload, main parameters, main gradients and Adam's state apart
            # (offloaded, the step and its temporaries run on the host)
            "device_peak": None if offloaded and phase.endswith("optimizer") else peak.bytes,
            "where": peak.where,
            "breakdown": tracker.peak_breakdown(phase, classes),  # at the device peak
        }
    return {
        "phases": phases,
        "peak": max(tracker.total_peaks[phase] for phase in phases),
        "rss_peak": peak_rss_bytes(),  # with the fp32 copies when fp32_half_kernels
        "fp32_half_kernels": wide,
        "rss_start": rss_start,
        "tokens_per_rank": cfg.model.seq_length // (model.dims.sp * model.dims.cp),
        "params": sum(p.numel() for p in params),
    }


@contextlib.contextmanager
def _host_held_gradients():
    """The offloaded parameters' fp32 gradients held apart from them, as in host memory on a
    GPU (a CPU run otherwise keeps them on its one device), so the device-side staging of
    their accumulation is what the tracker sees."""
    from megatron_ul.optim import host_grads

    keeps = host_grads.keeps_grads_apart
    host_grads.keeps_grads_apart = lambda device: True
    try:
        yield
    finally:
        host_grads.keeps_grads_apart = keeps


def _storage_bytes(tensors) -> int:
    return sum(
        {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values()
    )


@contextlib.contextmanager
def _offloaded_activations_on_host(tracker):
    """The activation offload as on a GPU: the parked input is a copy in host memory (the
    device tensor dies with its last device reference) and the prefetch makes a new device
    tensor. A CPU run otherwise keeps the device tensor itself (mpu/offload.py)."""
    from megatron_ul.mpu.offload import OffloadedTensor

    init, prefetch = OffloadedTensor.__init__, OffloadedTensor.prefetch

    def parked(self, offloader, x, previous):
        init(self, offloader, x, previous)
        if offloader.stream is None:
            self.host = x.detach().clone()
            tracker.hold_on_host([self.host])

    def fetched_back(self):
        if self.on_device is None and self.host is not None and self.offloader.stream is None:
            self.host = self.host.clone()  # the device copy; the host one dies once fetched
        prefetch(self)

    OffloadedTensor.__init__ = parked  # type: ignore[method-assign]
    OffloadedTensor.prefetch = fetched_back  # type: ignore[method-assign]
    try:
        yield
    finally:
        OffloadedTensor.__init__ = init  # type: ignore[method-assign]
        OffloadedTensor.prefetch = prefetch  # type: ignore[method-assign]


def _after(owner, name: str, then) -> None:
    """owner.name(...) followed by then()."""
    inner = getattr(owner, name)

    def wrapped(*args, **kwargs):
        out = inner(*args, **kwargs)
        then()
        return out

    setattr(owner, name, wrapped)


def _phase_wrap(owner, name: str, tracker, phase: str) -> None:
    """owner.name(...) runs as `phase` of the tracker's current iteration."""
    inner = getattr(owner, name)

    def wrapped(*args, **kwargs):
        _set_stage(tracker, phase)
        return inner(*args, **kwargs)

    setattr(owner, name, wrapped)


def _set_stage(tracker, stage: str) -> None:
    """'iteration N <stage>', keeping N."""
    tracker.phase = " ".join(tracker.phase.split(" ")[:2] + [stage])


def _mark_backward_stages(model, tracker) -> None:
    """A layer (or the output layer) running forward inside backward is its recompute: from
    there on, backward is that layer's (the loss's)."""

    def stage(name):
        def hook(_module, _inputs):
            if torch._C._current_autograd_node() is not None:
                _set_stage(tracker, name)

        return hook

    for layer in model.layers:
        layer.register_forward_pre_hook(stage("layer backward"))
    head = getattr(model, "output_layer", None)
    if head is not None:
        head.register_forward_pre_hook(stage("loss backward"))


def peak_argv(
    hidden: int, seq_length: int, sp: int = 1, cp: int = 1, extra=(), documents: bool = True
) -> list[str]:
    """The bench model's flags for one configuration (without documents: one causal
    sequence, --reset-attention-mask and --reset-position-ids left out)."""
    context = LONG_CONTEXT
    if not documents:
        context = [
            f for f in LONG_CONTEXT if f not in ("--reset-attention-mask", "--reset-position-ids")
        ]
    return (
        PEAK_MODEL
        + context
        + list(extra)
        + ["--hidden-size", str(hidden), "--seq-length", str(seq_length)]
        + ["--global-batch-size", "1", "--ds-sequence-parallel-size", str(sp)]
        + ["--context-parallel-size", str(cp)]
    )


def measure_peak(
    hidden: int,
    seq_length: int,
    precision: str,
    sp: int = 1,
    cp: int = 1,
    extra: tuple = (),
    documents: bool = True,
) -> dict:
    """The fullest rank's result of `peak_worker` for one configuration."""
    argv = peak_argv(hidden, seq_length, sp, cp, extra, documents)
    # tracked op by op, two iterations at up to 64K tokens: hours on a loaded 2-core machine
    results = run_ranks(peak_worker, sp * cp, argv, precision, timeout=4 * 3600.0)
    return max(results, key=lambda r: r["peak"])


def table_peak(hidden: int, seq_length: int, precisions, top: int) -> str:
    lines = []
    for precision in precisions:
        got = measure_peak(hidden, seq_length, precision)
        n = got["tokens_per_rank"]
        lines += [
            f"### {precision}, hidden {hidden}, N = {seq_length}",
            "",
            f"Peak RSS {got['rss_peak'] / MIB:.0f} MiB "
            f"({(got['rss_peak'] - got['rss_start']) / MIB:.0f} MiB above start"
            + (
                "; half-precision GEMMs and attention computed in fp32, their copies in RSS)."
                if got["fp32_half_kernels"]
                else ")."
            ),
            "",
        ]
        for phase, p in got["phases"].items():
            lines += [
                f"{phase}: peak live tensors {p['peak'] / MIB:.1f} MiB = "
                f"{p['peak'] / n:.0f} bytes/token, at `{p['where']}`",
                "",
                "| alive at the peak (phase / module or autograd node / op) | MiB | bytes/token |",
                "|---|---:|---:|",
            ]
            for label, nbytes in list(p["breakdown"].items())[:top]:
                lines.append(f"| {label} | {nbytes / MIB:.1f} | {nbytes / n:.0f} |")
            lines.append("")
    return "\n".join(lines)


# ---- 4b. options side by side, by term -------------------------------------------------------
# Each adds to LONG_CONTEXT (which is every long-context option of main before the tiles).
OPTIONS = {  # added to the bench model's flags; a run combines them with "+"
    "base": (),  # every long-context option (LONG_CONTEXT)
    "tiles": ("--attention-block-tiles", "4"),
    "offload": ("--optimizer-cpu-offload",),
    # The MLP's token chunk is the layer backward's constant above its floor: halved here.
    "mlp2k": ("--tiled-mlp-chunk-size", "2048"),
}
LAYER_BACKWARD = "iteration 2 layer backward"


def compare_options(hidden: int, seq_length: int, runs, extra: tuple = ()) -> dict:
    """{(precision, options): measure_peak's result} for each "precision:option+option" of
    `runs` (options from OPTIONS), measured one after the other in this run."""
    results = {}
    for run in runs:
        precision, _, names = run.partition(":")
        if precision not in PRECISIONS or any(n not in OPTIONS for n in names.split("+")):
            raise SystemExit(
                f"--runs {run}: want PRECISION:OPTION[+OPTION], from "
                f"{PRECISIONS} and {list(OPTIONS)}"
            )
        flags = [f for n in names.split("+") for f in OPTIONS[n]]
        label = "every long-context option" + "".join(
            f" + {' '.join(OPTIONS[n])}" for n in names.split("+") if OPTIONS[n]
        )
        results[precision, label] = measure_peak(
            hidden, seq_length, precision, extra=tuple(extra) + tuple(flags)
        )
        print(f"measured {precision}, {label}", flush=True)
    return results


def _model_state(result: dict, phase: str) -> int:
    breakdown = result["phases"][phase]["breakdown"]
    return breakdown.get("parameters", 0) + breakdown.get("optimizer state", 0)


def device_peak(result: dict) -> tuple[str, int]:
    """(phase, bytes) of the largest device peak over the phases of a `measure_peak` result:
    the live total less what a GPU run keeps in host memory (host-held state)."""
    phase = max(result["phases"], key=lambda p: result["phases"][p]["device_peak"] or 0)
    return phase, result["phases"][phase]["device_peak"] or 0


def table_options(results: dict, top: int = 14) -> str:
    """One row per (precision, option): the peak and the layer-backward peak, per token and
    above the model state, and the device peak with its phase; then what was alive at the
    layer-backward peak and at the device peak, by term."""
    rows = [
        "| precision | options | peak MiB | bytes/token | above params + Adam, bytes/token "
        "| layer-backward peak MiB | bytes/token | above params + Adam, bytes/token "
        "| device peak MiB (host-held state excluded) | bytes/token | device peak's phase |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for (precision, name), r in results.items():
        n = r["tokens_per_rank"]
        peak_phase = max(r["phases"], key=lambda p: r["phases"][p]["peak"])
        layer = r["phases"][LAYER_BACKWARD]["peak"]
        phase, device = device_peak(r)
        rows.append(
            f"| {precision} | {name} | {r['peak'] / MIB:.1f} | {r['peak'] / n:.0f} | "
            f"{(r['peak'] - _model_state(r, peak_phase)) / n:.0f} | {layer / MIB:.1f} | "
            f"{layer / n:.0f} | {(layer - _model_state(r, LAYER_BACKWARD)) / n:.0f} | "
            f"{device / MIB:.1f} | {device / n:.0f} | {phase} "
            f"(`{r['phases'][phase]['where'].replace(' | ', ' / ')}`) |"
        )
    rows += [
        "",
        "Alive at the layer-backward peak (phase / module or autograd node / op), MiB "
        "(bytes/token):",
    ]
    rows += _terms_table(results, lambda r: LAYER_BACKWARD, top)
    rows += ["", "Alive at the device peak (in its phase, named above), MiB (bytes/token):"]
    rows += _terms_table(results, lambda r: device_peak(r)[0], top)
    return "\n".join(rows)


def _terms_table(results: dict, phase_of, top: int) -> list[str]:
    """What was alive at `phase_of(result)`'s peak of each result, one column per result."""
    columns = list(results)
    terms: dict[str, dict] = {}
    for key, r in results.items():
        phase = phase_of(r)
        for label, nbytes in r["phases"][phase]["breakdown"].items():
            label = label.replace(phase + " backward", phase.split(" ", 2)[-1])
            label = label.replace("iteration 2 ", "").replace("iteration 1 ", "")
            label = label.replace(" | ", " / ")  # a table cell
            terms.setdefault(label, dict.fromkeys(columns, 0))[key] += nbytes
    largest = sorted(terms, key=lambda t: -max(terms[t].values()))[:top]
    n = results[columns[0]]["tokens_per_rank"]
    rows = [
        "",
        "| term | " + " | ".join(f"{p}, {o}" for p, o in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for label in largest:
        cells = " | ".join(
            f"{terms[label][c] / MIB:.1f} ({terms[label][c] / n:.0f})" for c in columns
        )
        rows.append(f"| {label} | {cells} |")
    return rows


def machine_info() -> str:
    return (
        f"{platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"torch {torch.__version__}, gloo on CPU"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seq-length", type=int, default=4096, help="fixed sequence length of the activation table"
    )
    parser.add_argument("--cap-mib", type=float, default=96, help="per-rank cap of table 3")
    parser.add_argument("--start-seq", type=int, default=1024, help="first length tried")
    parser.add_argument("--output", default=os.path.join(ROOT, "docs", "results", "memory.md"))
    parser.add_argument(
        "--targets", action="store_true", help="print only the estimator's GPU targets table"
    )
    parser.add_argument(
        "--model-state", action="store_true", help="print only the ZeRO model-state table"
    )
    parser.add_argument(
        "--compare-options",
        nargs=2,
        type=int,
        metavar=("HIDDEN", "N"),
        help="print only the live-tensor peaks of OPTIONS side by side, by term",
    )
    parser.add_argument(
        "--runs",
        nargs="+",
        default=["fp32:base"],
        metavar="PRECISION:OPTION[+OPTION]",
        help=f"for --compare-options: precisions {PRECISIONS}, options {list(OPTIONS)}",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        help="for --compare-options: instead of the bench model's 32000 (bf16 matmuls are slow "
        "on CPUs without bf16 units)",
    )
    args = parser.parse_args()
    if args.targets:
        print(table_targets())
        return
    if args.model_state:
        print(table_model_state())
        return
    if args.compare_options:
        hidden, seq_length = args.compare_options
        extra = ("--vocab-size", str(args.vocab_size)) if args.vocab_size else ()
        print(table_options(compare_options(hidden, seq_length, args.runs, extra)))
        return
    command = " ".join(["python -m tools.bench.bench_memory", *sys.argv[1:]])
    sections = [
        (
            "Model state per rank (params + grads + Adam state) under ZeRO over dp_sp",
            f"Model: {' '.join(STATE_MODEL)}. dp_sp 2 = SP2, dp_sp 4 = SP2 × DP2; the fullest rank "
            f"is shown, measured after a step with gradients present. ZeRO-1 shards the Adam "
            f"state (its fp32 master weights are the fp32 parameters themselves); ZeRO-2 also "
            f"the gradients (each bucket reduce-scattered into the rank's shard as backward "
            f"completes it); ZeRO-3 (FSDP2) also shards parameters, so everything falls as "
            f"1/dp_sp.",
            table_model_state(),
        ),
        (
            "Activation bytes saved for backward, per transformer layer, per rank",
            f"Model: {' '.join(ACT_MODEL)}, sequence {args.seq_length}; saved-tensor hooks, "
            f"deduplicated by storage, weights excluded.",
            table_layer_activations(args.seq_length),
        ),
        (
            "Longest sequence under a per-rank cap with full recompute (ZeRO-0)",
            "Per-rank bytes = model state (params, grads, Adam) + activations kept by a "
            "full-recompute forward (uniform, 1 layer per checkpoint; includes the loss's "
            "logits) + "
            "the saved tensors of the one layer being recomputed; the length is doubled from "
            f"{args.start_seq} until the fullest rank exceeds the cap.",
            table_longest_sequence(int(args.cap_mib * MIB), args.start_seq),
        ),
    ]
    today = datetime.date.today().isoformat()
    text = [
        f"# Memory, measured\n\nMeasured {today}.  \nCommand: `{command}`  \n"
        f"Machine: {machine_info()}\n"
    ]
    for title, note, table in sections:
        text.append(f"## {title}\n\n{note}\n\n{table}\n")
    out = "\n".join(text)
    print(out)
    with open(args.output, "w") as f:
        f.write(out)


if __name__ == "__main__":
    main()
