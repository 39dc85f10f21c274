"""Host-held fp32 gradients (--optimizer-cpu-offload of a half-precision model on a GPU):
accumulated through a device staging tensor, reduced through device buffers, read by the host
after one stream synchronisation per step.

A CPU run keeps the plain add (the host is the device), so these tests force the host-held path
(optim/host_grads.keeps_grads_apart) and check it against the plain path bit for bit, and that
no collective is ever handed a host-held buffer (a stand-in for NCCL, which takes none)."""

import sys
from contextlib import contextmanager, nullcontext

import pytest
import torch

from megatron_ul.mpu import host_staging
from megatron_ul.optim import host_grads
from megatron_ul.optim.contract import ParamStates
from megatron_ul.training.pretrain import configure, setup
from tests.checkpoint.runs import NO_DROPOUT, TINY
from tests.distributed import run_distributed
from tests.stand_ins.host_memory import HostTensor, on_host, refuse_host_tensors
from tests.training.test_half_precision import TOLERANCE


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def micro_batch_grads(dtype, count: int) -> list[torch.Tensor]:
    """Gradients with the values an add can round or sign differently: -0 (0 + -0 is +0,
    a copy would keep -0), subnormals, large and tiny magnitudes, inf."""
    gen = torch.Generator().manual_seed(3)
    grads = []
    for _ in range(count):
        g = torch.randn(4096, generator=gen) * torch.logspace(-30, 30, 4096)
        g[:8] = torch.tensor([-0.0, 0.0, -0.0, 1e-40, -1e-42, float("inf"), 3.0, -3.0])
        grads.append(g.to(dtype))
    return grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("micro_batches", [1, 2, 3])
def test_staged_accumulation_gives_the_plain_adds_bits(dtype, micro_batches):
    grads = micro_batch_grads(dtype, micro_batches)
    plain = torch.zeros(4096)
    host = torch.full((4096,), float("nan"))  # garbage from the last step: never read
    for i, g in enumerate(grads):
        plain.add_(g)
        host_grads.accumulate_on_host(host, g, first=i == 0)
    assert torch.equal(bits(host), bits(plain))


def test_an_unwritten_host_main_grad_reads_as_zero():
    """A parameter no micro-batch touched (zero_grad only marks its buffer empty)."""
    p, states = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16)), ParamStates()
    host_grads.attach_host_main_grad(p, torch.full((3,), 7.0), states[p])
    assert torch.equal(states.grad(p), torch.zeros(3))
    states[p].host_grad_empty = True  # zero_grad
    (p.float() * 2).sum().backward()
    assert torch.equal(states.grad(p), torch.full((3,), 2.0))


class CountingStream:
    """Stands in for the CUDA stream the device-to-host copies are enqueued on; counts the
    host's waits and checks each comes before the host's first read (the grad norm)."""

    syncs = 0

    def synchronize(self) -> None:
        CountingStream.syncs += 1
        frame, callers = sys._getframe(1), set()
        while frame is not None:
            callers.add(frame.f_code.co_name)
            frame = frame.f_back
        assert "global_grad_norm" in callers, "the host waited elsewhere than before the norm"


@contextmanager
def host_held_forced():
    """The host-held path on a CPU run: its buffers marked as host memory, its copies on one
    counting stream."""
    saved = host_grads.keeps_grads_apart, host_grads.attach_host_main_grad, host_staging._stream_of
    attach, stream = host_grads.attach_host_main_grad, CountingStream()
    host_grads.keeps_grads_apart = lambda device: True
    host_grads.attach_host_main_grad = lambda p, host, state: attach(p, on_host(host), state)
    host_staging._stream_of = lambda tensor: stream
    try:
        yield
    finally:
        host_grads.keeps_grads_apart, host_grads.attach_host_main_grad = saved[:2]
        host_staging._stream_of = saved[2]


def train_host_held(rank: int, world: int, cases: dict) -> dict:
    """Each case's losses, parameters, host-held gradients and host synchronisations, the
    host-held path forced where the case says so; the collectives refuse host memory."""
    out = {}
    for name, (argv, forced) in cases.items():
        CountingStream.syncs = 0
        with host_held_forced() if forced else nullcontext():
            trainer = setup(configure(argv, world))
            with refuse_host_tensors():
                losses = trainer.train()
        model, states = trainer.model, trainer.optimizer.states
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        held = sum(isinstance(states[p].main_grad, HostTensor) for p in model.parameters())
        out[name] = (losses, params, held, CountingStream.syncs)
    return out


# 3 micro-batches per DP rank, 3 steps; half of the parameters offloaded (the rest keep an
# on-device main_grad, so buckets mix both).
ARGV = TINY + NO_DROPOUT + ["--bf16", "--global-batch-size", "12", "--train-iters", "3"]
OFFLOAD = ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"]
OVERLAP = ["--overlap-grad-reduce"]


def check_against_on_device(cases: dict, argv: list = ARGV) -> dict:
    """Every forced case bit for bit like the on-device run, with one host wait per step."""
    dp2 = run_distributed(train_host_held, 2, {"on device": (argv, False), **cases})[0]
    losses, params, _, _ = dp2["on device"]
    for name in cases:
        held_losses, held_params, held, syncs = dp2[name]
        assert held > 0, name  # the forced path holds gradients on the host
        assert syncs == 3, f"{name}: {syncs} host syncs in 3 steps"
        assert held_losses == losses, name
        for key, value in params.items():
            assert torch.equal(held_params[key], value), f"{name}: {key}"
    return dp2


def test_host_held_gradients_train_bitwise_like_on_device_ones():
    check_against_on_device({"host-held, overlapped": (ARGV + OFFLOAD + OVERLAP, True)})


@pytest.mark.slow
def test_host_held_gradients_match_one_process():
    dp2 = check_against_on_device(
        {
            "host-held": (ARGV + OFFLOAD, True),
            "host-held, overlapped": (ARGV + OFFLOAD + OVERLAP, True),
            "all host-held": (ARGV + ["--optimizer-cpu-offload"], True),
        }
    )
    one = run_distributed(train_host_held, 1, {"one process": (ARGV, False)})[0]["one process"]
    loss_tol, _ = TOLERANCE["bf16"]
    diff = max(abs(a - b) for a, b in zip(dp2["host-held"][0], one[0]))
    print(f"host-held DP2 against one process (bf16): max loss diff {diff:.2e}")
    assert diff < loss_tol


@pytest.mark.slow
def test_host_held_tied_embedding_is_summed_over_pipeline_stages_on_the_device():
    pp2 = ARGV + ["--pipeline-model-parallel-size", "2"]
    check_against_on_device({"host-held PP2": (pp2 + ["--optimizer-cpu-offload"], True)}, pp2)


# ---- the estimator's host/device split against the live-tensor tracker ----
def device_tracker(model, device: list, host: list):
    """tools/bench's live-tensor tracker, counting `device` from the start and never `host`
    (an op writing a host buffer returns it, which would register it)."""
    from tools.bench.live_tensors import LiveTensorTracker, _storage_key

    host_keys = {_storage_key(t)[0] for t in host}

    class DeviceTracker(LiveTensorTracker):
        def _register(self, t, label):
            if _storage_key(t)[0] not in host_keys:
                super()._register(t, label)

    return DeviceTracker(model, preexisting=device)


def layer_backward_peak(rank: int, world: int, argv: list, forced: bool) -> tuple[int, int]:
    """(Iteration 2's layer-backward peak of live device storages, bytes of host storages),
    the host-held path forced or not. On CPU every tensor is in one memory: what a GPU run
    keeps in host memory (main parameters, Adam's state and, forced, the main gradients) is
    told apart by name."""
    from megatron_ul.training.step import train_step
    from tools.bench.bench_memory import (
        _host_held_gradients,
        _mark_backward_stages,
        _storage_bytes,
    )

    with _host_held_gradients() if forced else nullcontext():
        cfg = configure(argv, world)
        trainer = setup(cfg)
        model, optimizer = trainer.model, trainer.optimizer
        first, second = next(trainer.train_batches), next(trainer.train_batches)
        train_step(model, optimizer, first, clip_grad=cfg.train.clip_grad)  # Adam's state
        params = list(model.parameters())
        adam = [v for s in optimizer.torch_optimizer.state.values() for v in s.values()]
        held = [optimizer.states[p] for p in params]
        state = [s.main_param for s in held] + [t for t in adam if t.dim() > 0]
        grads = [s.main_grad for s in held]
        host = state + grads if forced else []
        tracker = device_tracker(model, params + ([] if forced else state + grads), host)
        _mark_backward_stages(model, tracker)
        with tracker:
            tracker.phase = "iteration 2 forward"
            train_step(model, optimizer, second, clip_grad=cfg.train.clip_grad)
    host_bytes = _storage_bytes(host)
    return tracker.peaks["iteration 2 layer backward"].bytes, host_bytes


@pytest.mark.slow
def test_estimated_host_device_split_of_host_held_gradients_matches_the_tracker():
    """What the estimator says offload moves off the device (gradients, main parameters, Adam)
    against the tracker's device peak and the host storages, bf16, all parameters offloaded."""
    from megatron_ul.training import memory_estimator as me

    argv = ARGV + ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    offload = argv + ["--optimizer-cpu-offload"]
    on_device, _ = run_distributed(layer_backward_peak, 1, argv, False)[0]
    held, host = run_distributed(layer_backward_peak, 1, offload, True)[0]
    plain, offloaded = (me.estimate_config(configure(a, 1)) for a in (argv, offload))
    estimated_saving = (
        plain.gradient_bytes
        + plain.optimizer_bytes
        - offloaded.gradient_bytes
        - offloaded.optimizer_bytes
    )
    estimated_host = offloaded.host_bytes - plain.host_bytes
    print(
        f"device saving: measured {on_device - held} B, estimated {estimated_saving:.0f} B; "
        f"host: measured {host} B, estimated {estimated_host:.0f} B"
    )
    assert abs(estimated_saving / (on_device - held) - 1) < 0.15
    assert abs(estimated_host / host - 1) < 0.15
