"""Every tensor handed to a collective lives on the training device (the parameters'), never
on an implicit CPU: NCCL's default group has no CPU backend, so a CPU tensor kills the first
fp16 step or every --exit-signal-handler run on GPUs.

No GPU here: the parameters live on the `meta` device instead, which differs from the CPU just
as `cuda` does; the collective is replaced by a recorder that notes the device and stops."""

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_ul.config import Config
from megatron_ul.optim import grads as grads_module
from megatron_ul.optim.precision import GradScaler
from megatron_ul.training import step as step_module
from megatron_ul.training.exit import RunControl

META = torch.device("meta")


class Handed(Exception):
    """Raised by the recorder: the collective was reached (meta tensors hold no values)."""


@pytest.fixture
def handed(monkeypatch):
    """[(device, dtype)] of each tensor handed to all_reduce, on a pretend 2-rank world."""
    seen = []

    def record(tensor, *args, **kwargs):
        seen.append((tensor.device, tensor.dtype))
        raise Handed

    monkeypatch.setattr(dist, "all_reduce", record)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    return seen


def _meta_params():
    p = torch.nn.Parameter(torch.zeros(4, device=META))
    p.grad = torch.zeros(4, device=META)
    return [p]


def test_fp16_scaler_reduces_found_inf_on_the_parameters_device(handed):
    with pytest.raises(Handed):
        GradScaler(1024.0).unscale_and_check([_meta_params()[0].grad], META)
    assert handed == [(META, torch.float32)]


def test_exit_flags_are_reduced_on_the_parameters_device(handed):
    cfg = Config()
    cfg.checkpoint.exit_duration_in_mins = 60.0
    cfg.train.global_batch_size = 1  # resolved, as setup() hands it (the data position)
    control = RunControl(cfg, torch.nn.Linear(2, 2, device=META), None, None)
    with pytest.raises(Handed):
        control.after_iteration(1)
    assert handed == [(META, torch.float32)]


def test_grad_norm_is_reduced_on_the_parameters_device_even_without_gradients(handed):
    dims = SimpleNamespace(pp_tp_group=None, tp_rank=0)  # the model-parallel group
    p = torch.nn.Parameter(torch.zeros(4, device=META))  # no .grad on this rank
    with pytest.raises(Handed):
        grads_module.global_grad_norm([p], dims, lambda p: p.grad)
    assert handed == [(META, torch.float64)]


def test_token_count_is_reduced_in_fp64_on_the_training_device(handed, monkeypatch):
    batches = [{"loss_mask": torch.ones(2, 8)}]
    with pytest.raises(Handed):
        step_module.count_tokens(batches, META, SimpleNamespace(dp_cp_sp_group=None))
    assert handed == [(META, torch.float64)]


def test_token_count_is_exact_past_fp32s_integers(monkeypatch):
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    n = 2**24 + 1  # the first integer fp32 cannot hold
    batches = [{"loss_mask": torch.ones(1, 2**23)}, {"loss_mask": torch.ones(1, 2**23 + 1)}]
    assert (
        int(
            step_module.count_tokens(
                batches, torch.device("cpu"), SimpleNamespace(dp_cp_sp_group=None)
            ).item()
        )
        == n
    )


def test_nccl_group_is_bound_to_the_ranks_gpu(monkeypatch):
    """Barriers and object collectives (checkpoint saves) then use this rank's GPU instead of
    guessing one from the global rank."""
    from megatron_ul import initialize

    seen = {}

    def init_process_group(backend, **kwargs):
        seen.update(kwargs, backend=backend)
        raise Handed

    current = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: current.update(device=i))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["device"])
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setenv("RANK", "13")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(Handed):
        initialize.initialize_distributed(Config())
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda", 5)


def test_a_one_process_run_leaves_the_environment_alone(monkeypatch):
    """A plain one-process run meets itself on loopback through its init method: nothing is
    written into os.environ, where later subprocesses would inherit a port already taken."""
    from megatron_ul import initialize

    seen = {}

    def init_process_group(backend, **kwargs):
        seen.update(kwargs)
        raise Handed

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    before = dict(os.environ)
    with pytest.raises(Handed):
        initialize.initialize_distributed(Config())
    assert dict(os.environ) == before
    assert seen["init_method"].startswith("tcp://127.0.0.1:") and seen["world_size"] == 1
    monkeypatch.setenv("MASTER_PORT", "29555")
    with pytest.raises(Handed):
        initialize.initialize_distributed(Config())
    assert seen["init_method"] == "tcp://127.0.0.1:29555"
