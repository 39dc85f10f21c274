"""Metrics: phase timers and their levels, timers handed to the all-to-all and to a whole
training run, comm_stats' per-op byte accounting against the bytes each algorithm moves,
peak-TFLOP/s lookup, MFU/ETA log line."""

import logging

import pytest
import torch

from megatron_ul.timers import NO_TIMERS, Timers
from megatron_ul.training import metrics
from megatron_ul.training.pretrain import configure, setup
from megatron_ul.training.step import train_step
from tests.distributed import run_distributed


def test_timer_levels_and_no_op_without_timers():
    with NO_TIMERS("forward"):  # the default everywhere: times nothing
        pass
    assert NO_TIMERS.pop() == ({}, {})
    timers = Timers(log_level=1)
    with timers("forward"):
        sum(range(10000))
    with timers("grad-clip", level=2):  # above the level: not timed
        pass
    seconds, calls = timers.pop()
    assert calls == {"forward": 1} and seconds["forward"] > 0
    assert timers.pop() == ({}, {})


def _collectives(rank, world):
    """Run each collective once under count_communication, the all-to-all with timers."""
    from megatron_ul.mpu import comm_stats, mappings
    from megatron_ul.mpu import parallel_state as ps

    group = ps.initialize_model_parallel(world, 1, 1).tp_group
    x = torch.ones(world * 6, 5)  # 4-byte floats
    timers = Timers(log_level=1)
    with comm_stats.count_communication() as counts:
        mappings.all_to_all(x, 0, 1, group, timers)
        mappings.all_gather(x, 0, group)
        mappings.reduce_scatter(x, 0, group)
        mappings.all_reduce(x.clone(), group)
    mappings.all_to_all(x, 0, 1, group)  # given no timers: not timed
    return {op: dict(v) for op, v in counts.items()}, timers.pop()[1]


def test_comm_stats_bytes_and_all_to_all_timers():
    world = 2
    counts, calls = run_distributed(_collectives, world)[0]
    local = world * 6 * 5 * 4  # bytes of x on each rank
    # Bytes a rank puts on the wire: all-to-all keeps its own 1/world; ring all-gather sends
    # world-1 local chunks; ring reduce-scatter sends world-1 output-sized chunks; ring
    # all-reduce = reduce-scatter + all-gather.
    assert counts["all_to_all"]["bytes"] == local * (world - 1) / world
    assert counts["all_gather"]["bytes"] == local * (world - 1)
    assert counts["reduce_scatter"]["bytes"] == local / world * (world - 1)
    assert counts["all_reduce"]["bytes"] == 2 * local * (world - 1) / world
    assert all(v["calls"] == 1 for v in counts.values())
    assert calls == {"all-to-all": 1}


def test_peak_tflops_from_flag_and_gpu_name(monkeypatch):
    cfg = configure(["--mock-data", "--vocab-size", "100", "--peak-tflops", "123"], 1)
    assert metrics.peak_tflops(cfg) == 123
    cfg.logging.peak_tflops = None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, peak in [
        ("NVIDIA H200", 989.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA H100 PCIe", None),
        ("Tesla T4", None),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, n=name: n)
        assert metrics.peak_tflops(cfg) == peak, name


def test_log_line_has_mfu_memory_eta_and_time_split(caplog):
    cfg = configure(
        [
            "--mock-data",
            "--vocab-size",
            "100",
            "--train-iters",
            "10",
            "--log-interval",
            "2",
            "--peak-tflops",
            "1",
            "--timing-log-level",
            "1",
        ],
        1,
    )
    timers = Timers(cfg.logging.timing_log_level)
    logger = metrics.MetricsLogger(cfg, 128, is_reporting_rank=True, timers=timers)
    try:
        with caplog.at_level(logging.INFO, logger="megatron_ul"):
            for it in (1, 2):
                with timers("forward"):
                    pass
                logger.iteration(it, 5.0, 1e-3, 1.0)
    finally:
        logger.close()
    text = caplog.text
    assert "MFU" in text and "peak mem" in text and "ETA 0:00:" in text
    assert "time split (ms/iter): forward" in text


@pytest.mark.parametrize("seconds,text", [(59, "0:00:59"), (3661, "1:01:01")])
def test_format_eta(seconds, text):
    assert metrics.format_eta(seconds) == text


def _timed_run(rank, world):
    cfg = configure(
        [
            "--mock-data",
            "--vocab-size",
            "64",
            "--num-layers",
            "1",
            "--hidden-size",
            "16",
            "--num-attention-heads",
            "2",
            "--seq-length",
            "8",
            "--ds-sequence-parallel-size",
            "2",
            "--train-iters",
            "2",
            "--log-interval",
            "100",
            "--timing-log-level",
            "1",
        ],
        world,
    )
    trainer = setup(cfg)
    for _ in range(2):
        train_step(
            trainer.model,
            trainer.optimizer,
            next(trainer.train_batches),
            clip_grad=cfg.train.clip_grad,
            timers=trainer.timers,
        )
    return trainer.timers.pop()[1]


def test_a_run_times_its_phases_through_the_timers_it_was_given():
    """setup() builds one Timers and hands it to the model (all-to-all), the schedule and the
    step; nothing is installed process-wide."""
    calls = run_distributed(_timed_run, 2)[0]
    # 2 iterations x 1 micro-batch; 1 layer x 4 all-to-alls (q, k, v, the output) forward
    # + 4 backward
    assert calls == {
        "forward": 2,
        "backward": 2,
        "all-to-all": 16,
        "grad-reduce": 2,
        "optimizer": 2,
    }
