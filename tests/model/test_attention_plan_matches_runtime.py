"""--dry-run's plan and the runtime's decision are one answer.

For every combination of device (the CPU, and CUDA as modelled on sm90 and sm80), dtype,
documents, window, ring, attention dropout, --use-flash-attn and flash-attn present or absent,
the attention core runs through its real call site (DistributedAttention, SelfAttention.attend,
the layer's LayerAttention) on the CPU, in training and in evaluation, while `decide` is
intercepted: the AttentionCall the layer builds is what the runtime decides from. On
CUDA-as-modelled that call is judged on the modelled GPU; what --dry-run plans comes from the
configuration alone (training.dry_run.attention_call). The two must name the same kernel, and
the dry-run line must name it.
"""

import itertools
import types
from dataclasses import replace

import pytest
import torch

from megatron_ul.model.attention import backends
from megatron_ul.model.attention import flash_attn as attention
from megatron_ul.model.attention.backends import attention_kernel, planned_kernel, planned_kernels
from megatron_ul.model.attention.dispatch import MODELLED_GPUS
from megatron_ul.model.attention.documents import DocumentMask
from megatron_ul.model.attention.layer import LayerAttention, model_call
from megatron_ul.model.attention.ring import Ring
from megatron_ul.model.attention.ulysses import DistributedAttention
from megatron_ul.model.transformer import SelfAttention
from megatron_ul.mpu.random import MODEL_PARALLEL_RNG, get_rng_tracker
from megatron_ul.training.dry_run import attention_call, describe, run_precision
from megatron_ul.training.pretrain import configure
from tests.conftest import FLASH_ATTN_RELEASES

N = 32  # tokens; 4 query heads and 2 kv heads of 64
BASE = [
    "--mock-data",
    "--vocab-size",
    "1000",
    "--num-layers",
    "1",
    "--hidden-size",
    "256",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--seq-length",
    str(N),
    "--dry-run",
]
DTYPES = {torch.float32: [], torch.bfloat16: ["--bf16"], torch.float16: ["--fp16"]}
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _config(dtype, documents, window, ring, dropout, use_flash_attn):
    flags = BASE + DTYPES[dtype] + ["--attention-dropout", str(dropout)]
    flags += ["--reset-attention-mask"] if documents else []
    flags += ["--window-size", "8", "0"] if window else []
    flags += ["--context-parallel-size", "2"] if ring else []
    flags += ["--use-flash-attn"] if use_flash_attn else []
    return configure(flags, 2 if ring else 1)


def _runtime_calls(cfg, training: bool, monkeypatch) -> list:
    """(AttentionCall, kernel) for each decide the call sites make in one forward (and the
    backward in training, but for the ring) of the attention core, wired as SelfAttention
    wires it."""
    seen = []
    real = backends.decide

    def spy(call):
        seen.append((call, real(call)))
        return seen[-1][1]

    monkeypatch.setattr(backends, "decide", spy)
    m = cfg.model
    dtype = run_precision(cfg)[1]
    cp = cfg.parallel.context_parallel_size
    attend = LayerAttention(model_call(m, CPU, dtype, tp=1, sp=1, cp=cp, documents=False))
    if cp > 1:
        attend.ring = Ring(None, 0, 1, 0, 0)  # the ring's call site, as one ring rank runs it
    core = DistributedAttention(1, attend, None)
    layer = types.SimpleNamespace(core=core, attention_dropout=m.attention_dropout)
    layer.training = training
    q = torch.randn(N, 1, 4, m.head_dim, dtype=dtype, requires_grad=training)
    k, v = (torch.randn(N, 1, 2, m.head_dim, dtype=dtype, requires_grad=training) for _ in "kv")
    documents = (
        DocumentMask(torch.tensor([0, 11, N], dtype=torch.int32), 1)
        if cfg.data.reset_attention_mask
        else None
    )
    with torch.set_grad_enabled(training):
        out = SelfAttention.attend(layer, [q, k, v], documents)  # type: ignore[arg-type]
        if training and attend.ring is None:  # one ring rank cannot run the ring's backward
            out.float().sum().backward()
    return seen


@pytest.fixture
def rng():
    get_rng_tracker().reset("cpu")
    get_rng_tracker().add(MODEL_PARALLEL_RNG, 0)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_without_flash_attn_the_plan_is_what_the_call_sites_decide(dtype, monkeypatch, rng):
    monkeypatch.setattr(attention, "flash_attn_module", lambda: None)
    _check_every_combination(dtype, False, monkeypatch)


# The newest release's API (custom ops): the kernel named does not depend on the release.
@pytest.mark.parametrize("flash_attn_stand_in", FLASH_ATTN_RELEASES[-1:], indirect=True)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_with_flash_attn_the_plan_is_what_the_call_sites_decide(
    dtype, flash_attn_stand_in, monkeypatch, rng
):
    _check_every_combination(dtype, True, monkeypatch)


def _check_every_combination(dtype, flash_present: bool, monkeypatch) -> None:
    checked = 0
    for documents, window, ring, dropout, use_flash in itertools.product(
        (False, True), (False, True), (False, True), (0.0, 0.1), (False, True)
    ):
        if ring and dropout:
            continue  # refused by the configuration (the ring has no dropout)
        cfg = _config(dtype, documents, window, ring, dropout, use_flash)
        planned_call = attention_call(cfg, CUDA)
        dry_run_line = next(
            line for line in describe(cfg).splitlines() if line.startswith("attention kernel")
        )
        assert dry_run_line == "attention kernel on a GPU: " + planned_kernel(planned_call)
        for training in (True, False):
            with monkeypatch.context() as patch:
                seen = _runtime_calls(cfg, training, patch)
            assert len(seen) == 1, seen  # one decision per layer call
            call, cpu_backend = seen[0]
            cpu_kernel = cpu_backend.name
            what = (dtype, documents, window, ring, dropout, use_flash, flash_present, training)
            if not ring:  # the call site hands over the run's own dropout
                assert call.dropout == (dropout if training else 0.0), what
            plan = planned_call if training else replace(planned_call, dropout=0.0)
            plan = replace(plan, requires_grad=training)
            assert cpu_kernel == attention_kernel(replace(plan, device=CPU)), what
            planned = planned_kernels(plan)
            for name, gpu in MODELLED_GPUS.items():
                runtime = attention_kernel(replace(call, device=CUDA, gpu=gpu))
                assert runtime == planned[(name, flash_present)], (what, name, runtime)
                if training:
                    assert runtime in dry_run_line, (what, name, dry_run_line)
                checked += 1
    assert checked == 2 * 2 * 24  # GPUs × phases × configurations (32, less ring + dropout)
