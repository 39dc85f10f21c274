"""--timing-log-level on a GPU measures with CUDA events and never synchronises the host on the
per-micro-batch path; only pop() (once per log interval) waits for the device, and only
--timing-device-sync synchronises around every timed call. Checked on a stand-in CUDA device
whose events complete a few records behind the host and that counts every host sync."""

import time

import pytest
import torch

from megatron_ul.model.gpt import GPTModel
from megatron_ul.mpu.parallel_state import single_rank_dims
from megatron_ul.mpu.random import model_parallel_seed
from megatron_ul.pipeline.schedules import forward_backward_no_pipelining
from megatron_ul.timers import Timers
from tests.pipeline.nccl_harness import MICRO_BATCH, SEQ, micro_batches, model_config


class StandInDevice:
    """torch.cuda's Event and synchronize for a device that runs `lag` events behind."""

    def __init__(self, lag: int = 3):
        self.lag, self.syncs, self.events = lag, 0, []
        device = self

        class Event:
            def __init__(self, enable_timing=False):
                self.timing, self.position, self.synced = enable_timing, None, False

            def record(self, stream=None):
                self.position, self.time = len(device.events), time.perf_counter()
                device.events.append(self)

            def query(self):  # non-blocking: no sync
                return self.synced or self.position < len(device.events) - device.lag

            def synchronize(self):
                device.syncs += 1
                for event in device.events[: self.position + 1]:
                    event.synced = True

            def elapsed_time(self, end):
                if not (self.timing and end.timing) or self.position is None:
                    raise RuntimeError("elapsed_time needs two recorded timing events")
                if not end.query():
                    raise RuntimeError("CUDA error: device not ready (end event incomplete)")
                return (end.time - self.time) * 1e3

        self.Event = Event

    def synchronize(self, device=None):
        self.syncs += 1
        for event in self.events:
            event.synced = True


@pytest.fixture
def device(monkeypatch):
    stand_in = StandInDevice()
    monkeypatch.setattr(torch.cuda, "Event", stand_in.Event)
    monkeypatch.setattr(torch.cuda, "synchronize", stand_in.synchronize)
    return stand_in


def _train_micro_batches(timers: Timers, count: int = 2) -> None:
    """The schedule's per-micro-batch path, plus per-layer-style all-to-all timers."""
    model_parallel_seed(1, single_rank_dims())
    model = GPTModel(model_config(2), seed=1, dims=single_rank_dims(), timers=timers)
    forward_backward_no_pipelining(
        model, micro_batches(count), torch.tensor(float(count * MICRO_BATCH * SEQ)), timers=timers
    )
    for _ in range(8):
        with timers("all-to-all"):
            pass


def test_timing_on_a_gpu_makes_no_host_sync_until_the_log_interval(device):
    timers = Timers(log_level=2, device_type="cuda")
    _train_micro_batches(timers)
    assert device.syncs == 0
    assert len(timers._pending) <= device.lag  # finished events are folded in as they go
    seconds, calls = timers.pop()
    assert calls == {"forward": 2, "backward": 2, "all-to-all": 8}
    assert seconds["forward"] > 0 and seconds["backward"] > 0
    assert 1 <= device.syncs <= device.lag  # the log interval waits for the device
    assert timers.pop() == ({}, {})


def test_timing_device_sync_synchronises_around_every_timed_call(device):
    timers = Timers(log_level=2, device_type="cuda", device_sync=True)
    _train_micro_batches(timers)
    assert device.syncs == 2 * (2 + 2 + 8)
    assert timers.pop()[1] == {"forward": 2, "backward": 2, "all-to-all": 8}
