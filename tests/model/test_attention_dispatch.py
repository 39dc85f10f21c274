"""One decision for the attention kernel (model/attention/backends.py's select over the
model/attention/dispatch.py's description and SDPA model): torch SDPA's CUDA
backend choice modelled from torch 2.11's sdp_utils.cpp, checked case by case against the rules
read there; for every shape and dtype the model produces, a CUDA run never reaches SDPA's math
kernel (O(N²) memory), judged by an independent transcription of those rules; --dry-run
reports the same decision with the run's dropout."""

import itertools
from dataclasses import replace

import pytest
import torch

from megatron_ul.model.attention.backends import (
    TorchSdpa,
    attention_kernel,
    planned_kernel,
    planned_kernels,
    select,
)
from megatron_ul.model.attention.dispatch import (
    A100,
    H100,
    AttentionCall,
    CudaSdpa,
    SdpaInputs,
    sdpa_backend_name,
    sdpa_backend_pinned,
    sdpa_choice,
    sdpa_cuda_backend,
    sdpa_expands_kv,
)

CUDA = torch.device("cuda")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEADS = ((8, 8), (8, 2), (8, 1), (12, 6))  # (query heads, kv heads) per rank
HEAD_DIMS = (16, 64, 128)
BF16 = torch.bfloat16

# (what, inputs, GPU, torch 2.11's choice): each expectation read off sdp_utils.cpp by hand.
CASES = [
    (
        "sm90 + cuDNN 9.19 puts cuDNN first (check_prefer_cudnn_attention)",
        SdpaInputs(BF16, 128, 8, 2),
        H100,
        "cudnn",
    ),
    (
        "torch 2.11 hands cuDNN dropout 0.1 (no 1/16 check before 2.12)",
        SdpaInputs(BF16, 128, 8, 2, dropout=0.1),
        H100,
        "cudnn",
    ),
    (
        "TORCH_CUDNN_SDPA_DEPRIORITIZED=1: flash first again",
        SdpaInputs(BF16, 128, 8, 2),
        replace(H100, cudnn_deprioritized=True),
        "flash",
    ),
    (
        "cuDNN 9.15.0 is not newer than 9.15.0: flash first",
        SdpaInputs(BF16, 128, 8, 2),
        replace(H100, cudnn_version=91500),
        "flash",
    ),
    ("cuDNN 9.15.1 is", SdpaInputs(BF16, 128, 8, 2), replace(H100, cudnn_version=91501), "cudnn"),
    (
        "sm80: flash first, cuDNN after math (Context.h order)",
        SdpaInputs(BF16, 128, 8, 2),
        A100,
        "flash",
    ),
    (
        "sm80 without flash and efficient: math before cuDNN",
        SdpaInputs(BF16, 128, 8, 8),
        A100.without("flash").without("efficient"),
        "math",
    ),
    (
        "... and cuDNN once math is off too",
        SdpaInputs(BF16, 128, 8, 8),
        A100.without("flash").without("efficient").without("math"),
        "cudnn",
    ),
    (
        "deterministic algorithms: cuDNN refused (check_cudnn_deterministic)",
        SdpaInputs(BF16, 128, 8, 2),
        replace(H100, deterministic=True),
        "flash",
    ),
    (
        "Hopper: cuDNN head dims up to 256 from cuDNN 9.10",
        SdpaInputs(BF16, 256, 8, 8),
        H100,
        "cudnn",
    ),
    (
        "sm100: cuDNN head dims up to 128 (192 only for DeepSeek's 192/128)",
        SdpaInputs(BF16, 256, 8, 8),
        CudaSdpa((10, 0)),
        "flash",
    ),
    (
        "head dim 264: flash refuses > 256, the efficient kernel takes % 8",
        SdpaInputs(BF16, 264, 8, 8),
        H100,
        "efficient",
    ),
    (
        "... and with GQA nothing fused (the efficient kernel takes equal heads only)",
        SdpaInputs(BF16, 264, 8, 2),
        H100,
        "math",
    ),
    (
        "head dim 18: cuDNN needs % 8; flash pads any head dim <= 256",
        SdpaInputs(BF16, 18, 8, 8),
        H100,
        "flash",
    ),
    ("fp32: only the efficient kernel", SdpaInputs(torch.float32, 64, 8, 8), H100, "efficient"),
    ("fp32 GQA: math", SdpaInputs(torch.float32, 64, 8, 2), H100, "math"),
    ("fp32 head dim 18: % 4 fails", SdpaInputs(torch.float32, 18, 8, 8), H100, "math"),
    (
        "a mask: cuDNN takes it with GQA on sm90",
        SdpaInputs(BF16, 64, 8, 2, has_mask=True, causal=False),
        H100,
        "cudnn",
    ),
    (
        "a mask with GQA on sm80: flash refuses masks, the efficient kernel GQA",
        SdpaInputs(BF16, 64, 8, 2, has_mask=True, causal=False),
        A100,
        "math",
    ),
    (
        "a key sequence of 1: cuDNN refuses",
        SdpaInputs(BF16, 64, 8, 8, causal=False, seq_q=4, seq_k=1),
        H100,
        "flash",
    ),
    (
        "cuDNN 9.12 with dropout: refused (9.11 - 9.13)",
        SdpaInputs(BF16, 64, 8, 8, dropout=0.125),
        replace(H100, cudnn_version=91200).without("flash").without("efficient").without("math"),
        "none",
    ),
    (
        "... without dropout: taken",
        SdpaInputs(BF16, 64, 8, 8),
        replace(H100, cudnn_version=91200).without("flash").without("efficient").without("math"),
        "cudnn",
    ),
    (
        "is_causal with sq != sk: flash refuses",
        SdpaInputs(BF16, 64, 8, 8, seq_q=16, seq_k=32),
        A100,
        "efficient",
    ),
    (
        "sm86 training head dim 200: flash refuses (192, 224]",
        SdpaInputs(BF16, 200, 8, 8),
        CudaSdpa((8, 6)),
        "efficient",
    ),
    (
        "... not without a backward",
        SdpaInputs(BF16, 200, 8, 8, requires_grad=False),
        CudaSdpa((8, 6)),
        "flash",
    ),
    (
        "sm75 bf16: flash needs sm80, the efficient kernel bf16 from sm80",
        SdpaInputs(BF16, 64, 8, 8),
        CudaSdpa((7, 5), cudnn_version=None),
        "math",
    ),
]


@pytest.mark.parametrize("what, inputs, gpu, expected", CASES, ids=[c[0] for c in CASES])
def test_sdpa_choice_follows_torch_2_11_sdp_utils(what, inputs, gpu, expected):
    assert sdpa_choice(inputs, gpu) == expected


def test_megatron_default_dropout_keeps_cudnn_out_and_a_sixteenth_does_not():
    """One of our two changes to torch 2.11's choice: cuDNN rounds the dropout to 1/16 steps."""
    call = AttentionCall(CUDA, BF16, 128, 8, 2, gpu=H100)
    assert attention_kernel(replace(call, dropout=0.1)) == "sdpa flash"
    assert attention_kernel(replace(call, dropout=0.125)) == "sdpa cudnn"
    assert attention_kernel(call) == "sdpa cudnn"
    assert attention_kernel(replace(call, gpu=A100)) == "sdpa flash"


def test_head_dims_above_128_keep_cudnn_out_where_torch_2_11_would_take_them():
    """cuDNN's head-dim limits changed after 2.11: a pin to it could fail on a newer torch."""
    call = AttentionCall(CUDA, BF16, 256, 8, 8, gpu=H100)
    assert sdpa_choice(SdpaInputs(BF16, 256, 8, 8), H100) == "cudnn"
    assert attention_kernel(call) == "sdpa flash"
    assert attention_kernel(replace(call, head_dim=128)) == "sdpa cudnn"


def _torch_2_11_takes(backend, dtype, d, hq, hk, dropout, gpu: CudaSdpa) -> bool:
    """An independent transcription of sdp_utils.cpp's can_use_* for the model's calls (dense
    q/k/v with stride-1 rows, is_causal on square sequences of > 1 token, a backward)."""
    half = dtype in (torch.float16, torch.bfloat16)
    sm = gpu.capability
    if backend == "cudnn":
        v = gpu.cudnn_version or 0
        limit = 256 if sm == (9, 0) and v >= 91000 else 128
        return (
            half
            and (8, 0) <= sm <= (12, 1)
            and v >= 90000
            and not gpu.deterministic
            and not (dropout > 0 and 91100 < v < 91400)
            and d % 8 == 0
            and d <= limit
            and hq % hk == 0
        )
    if backend == "flash":
        return half and (8, 0) <= sm <= (12, 1) and d <= 256 and hq % hk == 0
    if backend == "efficient":
        return (dtype == torch.float32 or half) and d % (8 if half else 4) == 0 and hq == hk
    return True


@pytest.mark.parametrize("gpu", (H100, A100), ids=("sm90", "sm80"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_no_model_shape_reaches_the_math_kernel_on_cuda(dtype, gpu):
    """Every model call names a fused kernel; where it is SDPA's, torch 2.11 would take the
    call on it (after our k/v expansion) and would pick no earlier backend of its order."""
    order = ("cudnn", "flash", "efficient") if gpu.prefers_cudnn() else ("flash", "efficient")
    for (hq, hk), d, docs, window, ring, dropout in itertools.product(
        HEADS, HEAD_DIMS, (False, True), (None, 64), (False, True), (0.0, 0.1, 0.125)
    ):
        call = AttentionCall(CUDA, dtype, d, hq, hk, docs, window, ring, dropout=dropout, gpu=gpu)
        kernel = select(call)
        if not isinstance(kernel, TorchSdpa):
            continue
        backend = kernel.backend
        assert backend not in ("math", "none"), (call, kernel)
        kv = hq if sdpa_expands_kv(CUDA, dtype, d, hq, hk, dropout=dropout, gpu=gpu) else hk
        assert backend != "efficient" or kv == hq, call  # the kernel takes equal heads only
        assert _torch_2_11_takes(backend, dtype, d, hq, kv, dropout, gpu), (call, kernel)
        allowed = [b for b in order if b != "cudnn" or ((dropout * 16) % 1 == 0 and d <= 128)]
        earlier = allowed[: allowed.index(backend)]
        assert not any(_torch_2_11_takes(b, dtype, d, hq, kv, dropout, gpu) for b in earlier)


def test_fp32_gqa_on_cuda_expands_kv_and_names_the_efficient_kernel():
    assert sdpa_expands_kv(CUDA, torch.float32, 64, 8, 2, gpu=H100)
    assert not sdpa_expands_kv(CUDA, torch.bfloat16, 64, 8, 2, gpu=H100)  # flash takes GQA
    assert not sdpa_expands_kv(torch.device("cpu"), torch.float32, 64, 8, 2)
    call = AttentionCall(CUDA, torch.float32, 64, 8, 2, gpu=H100)
    assert attention_kernel(call) == "sdpa efficient"
    assert sdpa_cuda_backend(torch.float32, 64, 8, 2, False) == "math"  # without expanding


def test_fused_sdp_choice_integers_name_torchs_backends():
    from torch.nn.attention import SDPBackend

    names = {"MATH": "math", "FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient"}
    names.update(CUDNN_ATTENTION="cudnn")
    for member, name in names.items():
        assert sdpa_backend_name(int(getattr(SDPBackend, member).value)) == name


def test_the_pin_enables_exactly_the_decided_backend():
    switches = torch.backends.cuda
    read = {
        "cudnn": switches.cudnn_sdp_enabled,
        "flash": switches.flash_sdp_enabled,
        "efficient": switches.mem_efficient_sdp_enabled,
        "math": switches.math_sdp_enabled,
    }
    for backend in read:
        with sdpa_backend_pinned(backend):
            assert [b for b, on in read.items() if on()] == [backend]
    assert all(on() for on in read.values())
    with sdpa_backend_pinned(None):
        assert all(on() for on in read.values())


def test_dry_run_names_each_path_with_the_runs_dropout():
    call = AttentionCall(CUDA, BF16, 128, 32, 8, use_flash_attn=True, dropout=0.1)
    assert planned_kernel(call) == (
        "flash-attn where flash-attn is installed, else sdpa flash; in evaluation (no "
        "dropout): flash-attn where flash-attn is installed, else sdpa cudnn on sm90 "
        "(H100/H200), sdpa flash on sm80 (A100)"
    )
    assert planned_kernel(replace(call, dropout=0.0, use_flash_attn=False)) == (
        "sdpa cudnn on sm90 (H100/H200), sdpa flash on sm80 (A100)"
    )
    docs = replace(call, documents=True, dropout=0.0)
    assert planned_kernel(docs) == (
        "flash-attn varlen where flash-attn is installed, else document tiles"
    )
    ring = AttentionCall(CUDA, torch.float32, 64, 8, 2, ring=True)
    assert planned_kernel(ring) == "ring: sdpa-efficient"
    masked = AttentionCall(CUDA, BF16, 64, 8, 2, True, 64, True)
    assert planned_kernel(masked) == "ring: sdpa-efficient / sdpa-efficient"
    kernels = planned_kernels(replace(call, dropout=0.0))
    assert kernels[("sm90 (H100/H200)", True)] == "flash-attn"
    assert kernels[("sm90 (H100/H200)", False)] == "sdpa cudnn"


def _logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention:")]


def test_the_log_names_each_path_once_with_the_decided_kernel(monkeypatch, caplog):
    """Each path in use gets one line, 'attention: <path> = <attention_kernel> (<device>)', the
    first time it runs; calling again logs nothing new."""
    import logging

    from megatron_ul.model.attention import backends as attention
    from megatron_ul.model.attention.documents import DocumentMask
    from megatron_ul.model.attention.layer import (
        document_attention,
        local_attention,
        ring_attention,
    )
    from megatron_ul.model.attention.ring import Ring
    from megatron_ul.mpu.random import MODEL_PARALLEL_RNG, get_rng_tracker

    monkeypatch.setattr(attention, "_announced", set())
    get_rng_tracker().reset("cpu")
    get_rng_tracker().add(MODEL_PARALLEL_RNG, 0)
    cpu = torch.device("cpu")
    q, k, v = (torch.randn(16, 1, 4, 8) for _ in range(3))
    documents = DocumentMask(torch.tensor([0, 5, 16], dtype=torch.int32), 1)
    alone = Ring(None, 0, 1, 0, 0)
    runs = [
        (
            lambda: local_attention(q, k, v, backend="sdpa", dropout_p=0.0),
            AttentionCall(cpu, torch.float32, 8, 4, 4),
            "causal",
        ),
        (
            lambda: document_attention(
                q, k, v, backend="sdpa", dropout_p=0.0, documents=documents, window=4
            ),
            AttentionCall(cpu, torch.float32, 8, 4, 4, True, 4),
            "documents + window 4",
        ),
        (
            lambda: ring_attention(q, k, v, alone, documents=documents),
            AttentionCall(cpu, torch.float32, 8, 4, 4, True, ring=True),
            "ring unit kernel",
        ),
    ]
    with caplog.at_level(logging.INFO, logger=attention.__name__):
        for run, _, _ in runs + runs:
            run()
    kernels = [attention_kernel(call).removeprefix("ring: ") for _, call, _ in runs]
    assert kernels == ["sdpa cpu-flash", "document blocks", "cpu-flash / cpu-flash"]
    assert _logged(caplog) == [
        f"attention: {path} = {kernel} (cpu)" for (_, _, path), kernel in zip(runs, kernels)
    ]


@pytest.mark.parametrize(
    "kernel, kv_heads_seen",
    [("sdpa cudnn", 2), ("sdpa flash", 2), ("sdpa efficient", 8), ("sdpa math", 2)],
)
def test_local_attention_runs_sdpa_pinned_to_the_decided_backend(
    monkeypatch, kernel, kv_heads_seen
):
    """Whatever decide names for a CUDA call, local_attention calls SDPA with exactly that
    backend switched on, and k/v repeated to the query heads for the efficient kernel only
    (decide answers as on a GPU; SDPA then runs on the CPU with every backend on again)."""
    from megatron_ul.model.attention import backends, layer, local
    from megatron_ul.mpu.random import MODEL_PARALLEL_RNG, get_rng_tracker

    get_rng_tracker().reset("cpu")
    get_rng_tracker().add(MODEL_PARALLEL_RNG, 0)
    chosen = TorchSdpa(kernel.removeprefix("sdpa "), kernel == "sdpa efficient", kernel)
    monkeypatch.setattr(backends, "decide", lambda call: chosen)
    switches = torch.backends.cuda
    seen = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        on = [
            name
            for name, flag in (
                ("cudnn", switches.cudnn_sdp_enabled()),
                ("flash", switches.flash_sdp_enabled()),
                ("efficient", switches.mem_efficient_sdp_enabled()),
                ("math", switches.math_sdp_enabled()),
            )
            if flag
        ]
        seen.append((on, k.shape[1], kw["enable_gqa"]))
        with sdpa_backend_pinned("math"):
            return real_sdpa(q, k, v, **kw)

    monkeypatch.setattr(local.F, "scaled_dot_product_attention", spy)
    q = torch.randn(16, 1, 8, 8)
    k, v = torch.randn(16, 1, 2, 8), torch.randn(16, 1, 2, 8)
    out = layer.local_attention(q, k, v, backend="sdpa", dropout_p=0.0)
    reference = real_sdpa(
        q.permute(1, 2, 0, 3),
        k.repeat_interleave(4, 2).permute(1, 2, 0, 3),
        v.repeat_interleave(4, 2).permute(1, 2, 0, 3),
        is_causal=True,
    ).permute(2, 0, 1, 3)
    assert seen == [([kernel.removeprefix("sdpa ")], kv_heads_seen, kv_heads_seen != 8)]
    torch.testing.assert_close(out, reference)


def test_the_runtime_facts_are_read_from_torch_and_the_environment(monkeypatch):
    """cuda_sdpa_facts on a (faked) H100: capability and cuDNN from torch, the environment
    variable as torch's check_env reads it ("1"), deterministic mode unless warn_only, and the
    torch.backends.cuda switches as sdpa_kernel leaves them."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron_ul.model.attention.dispatch import cuda_sdpa_facts

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    assert cuda_sdpa_facts(CUDA) == H100
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert cuda_sdpa_facts(CUDA).cudnn_deprioritized
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "0")
    assert not cuda_sdpa_facts(CUDA).cudnn_deprioritized
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        assert cuda_sdpa_facts(CUDA).enabled == {"flash", "efficient"}
    was = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert cuda_sdpa_facts(CUDA).deterministic
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert not cuda_sdpa_facts(CUDA).deterministic
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn_only)


def test_the_log_names_the_gpu_and_the_dropout_on_cuda(monkeypatch, caplog):
    import logging

    from megatron_ul.model.attention import backends as attention
    from megatron_ul.model.attention.backends import decide

    monkeypatch.setattr(attention, "_announced", set())
    with caplog.at_level(logging.INFO, logger=attention.__name__):
        decide(AttentionCall(CUDA, BF16, 128, 8, 2, dropout=0.1, gpu=H100))
        decide(AttentionCall(CUDA, BF16, 128, 8, 2, requires_grad=False, gpu=H100))
    assert _logged(caplog) == [
        "attention: causal = sdpa flash (cuda sm90, cuDNN 91900; dropout 0.1)",
        "attention: causal = sdpa cudnn (cuda sm90, cuDNN 91900)",
    ]


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64))
@pytest.mark.parametrize("dropout", (0.0, 0.1))
@pytest.mark.parametrize("heads", ((4, 4), (4, 2)))
def test_the_cpu_kernel_named_is_the_one_torch_chooses(dtype, dropout, heads):
    """On the CPU the name comes from torch itself (aten::_fused_sdp_choice on a real call's
    inputs), not from our rules: its flash kernel refuses dropout and falls to math."""
    q_heads, kv_heads = heads
    q = torch.randn(1, q_heads, 32, 16, dtype=dtype, requires_grad=True)
    k = torch.randn(1, kv_heads, 32, 16, dtype=dtype, requires_grad=True)
    choice = torch.ops.aten._fused_sdp_choice(
        q, k, k, None, dropout, True, enable_gqa=q_heads != kv_heads
    )
    named = attention_kernel(
        AttentionCall(torch.device("cpu"), dtype, 16, q_heads, kv_heads, dropout=dropout)
    )
    torch_name = sdpa_backend_name(choice)
    assert named == ("sdpa cpu-flash" if torch_name == "flash" else f"sdpa {torch_name}")
