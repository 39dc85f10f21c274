"""What decides an attention kernel: the call's description (`AttentionCall`) and torch
SDPA's CUDA backend choice as modelled from torch 2.11's source. The selection itself, the
ordered table of backends, is backends.py; nothing here runs a kernel.

On CUDA, torch picks SDPA's backend itself. `sdpa_cuda_backend` models that choice from torch
2.11's source (below), and local_attention runs SDPA pinned to the modelled backend
(`sdpa_backend_pinned`, torch.nn.attention.sdpa_kernel with that one backend), so what the
log and --dry-run name is what runs: were the model wrong on some GPU, torch would refuse the
call with its reasons instead of running another kernel silently. Two choices are ours: cuDNN
is left out where the attention dropout is not a multiple of 1/16, since torch 2.11 hands it
such a probability and cuDNN's kernels round it to 1/16 steps (Megatron's default 0.1 would
train with another dropout; torch 2.12+ leaves cuDNN out there itself, `check_cudnn_dropout`),
and for head dims above 128, where cuDNN's limits changed after 2.11 (a pin to cuDNN would then
fail on a newer torch); flash takes those calls on every release.
"""

from __future__ import annotations

import contextlib
import os
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .block_sparse import SparseHeads


HALF_DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIM_FLAGS = "--kv-channels (or --hidden-size / --num-attention-heads)"

# ---- torch SDPA's CUDA backend choice -------------------------------------------------------
# Read from torch 2.11's aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (its release/2.11
# text: cuDNN first on sm90/sm100 with a run-time cuDNN newer than 9.15.0, Hopper's cuDNN head
# dims up to 256 from cuDNN 9.10, no GQA in the efficient kernel, no 1/16 dropout check) and
# sdp_utils_cpp.h; each rule below names its function there.
SDPA_BACKENDS = ("cudnn", "flash", "efficient", "math")
# The integers of at::SDPBackend, as torch.ops.aten._fused_sdp_choice returns them.
_FUSED_SDP_CHOICE = {
    -1: "error",
    0: "math",
    1: "flash",
    2: "efficient",
    3: "cudnn",
    4: "overrideable",
}
TORCH_2_11_CUDNN = 91900  # the cuDNN (9.19) that torch 2.11's CUDA wheels bundle
CUDNN_DEPRIORITIZED_ENV = "TORCH_CUDNN_SDPA_DEPRIORITIZED"


def sdpa_backend_name(choice: int) -> str:
    """The backend name ('cudnn', 'flash', 'efficient', 'math', ...) of the integer that
    torch.ops.aten._fused_sdp_choice returns (the values of at::SDPBackend)."""
    return _FUSED_SDP_CHOICE.get(int(choice), f"unknown ({choice})")


@dataclass(frozen=True)
class CudaSdpa:
    """What torch's CUDA backend choice reads besides the call itself: the device's compute
    capability, the cuDNN found at run time, TORCH_CUDNN_SDPA_DEPRIORITIZED=1,
    torch.use_deterministic_algorithms (not warn_only) and the torch.backends.cuda.*_sdp
    switches."""

    capability: tuple[int, int] = (9, 0)
    cudnn_version: int | None = TORCH_2_11_CUDNN
    cudnn_deprioritized: bool = False
    deterministic: bool = False
    enabled: frozenset = field(default_factory=lambda: frozenset(SDPA_BACKENDS))

    @property
    def name(self) -> str:
        return f"sm{self.capability[0]}{self.capability[1]}"

    def without(self, backend: str) -> CudaSdpa:
        return replace(self, enabled=self.enabled - {backend})

    def prefers_cudnn(self) -> bool:
        """sdp_utils.cpp `check_prefer_cudnn_attention` (read once per process by
        `priority_order`): cuDNN goes first on sm90 / sm100 / sm103 with a run-time cuDNN
        newer than 9.15.0, unless TORCH_CUDNN_SDPA_DEPRIORITIZED=1; elsewhere torch's default
        order (Context.h `sdp_priority_order`) puts cuDNN last, after math."""
        major, minor = self.capability
        return (
            not self.cudnn_deprioritized
            and self.cudnn_version is not None
            and self.cudnn_version > 91500
            and major in (9, 10)
            and minor in (0, 3)
        )


H100 = CudaSdpa((9, 0))  # H100 / H200 with torch 2.11's bundled cuDNN
A100 = CudaSdpa((8, 0))
MODELLED_GPUS = {"sm90 (H100/H200)": H100, "sm80 (A100)": A100}


def cuda_sdpa_facts(device: torch.device) -> CudaSdpa:
    """The CudaSdpa of this process on `device` (host-side queries only: no device sync)."""
    switches = torch.backends.cuda
    enabled = {
        name
        for name, on in (
            ("cudnn", switches.cudnn_sdp_enabled()),
            ("flash", switches.flash_sdp_enabled()),
            ("efficient", switches.mem_efficient_sdp_enabled()),
            ("math", switches.math_sdp_enabled()),
        )
        if on
    }
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return CudaSdpa(
        tuple(torch.cuda.get_device_capability(device)),  # type: ignore[arg-type]
        cudnn,
        os.environ.get(CUDNN_DEPRIORITIZED_ENV) == "1",  # c10::utils::check_env: "1" is true
        torch.are_deterministic_algorithms_enabled()
        and not torch.is_deterministic_algorithms_warn_only_enabled(),
        frozenset(enabled),
    )


@dataclass(frozen=True)
class SdpaInputs:
    """One SDPA call as the backend choice sees it: q [b, hq, sq, d], k, v [b, hk, sk, d]
    with last-dim stride 1, enable_gqa where hq != hk, a dense bool mask or is_causal."""

    dtype: torch.dtype
    head_dim: int
    q_heads: int
    kv_heads: int
    has_mask: bool = False
    dropout: float = 0.0
    causal: bool = True
    seq_q: int | None = None  # None: not known, taken as more than one token
    seq_k: int | None = None
    requires_grad: bool = True


def _in_range(cap: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> bool:
    return low <= cap <= high  # sdp_utils.cpp `check_sm_version`


def _common_refusal(x: SdpaInputs) -> str | None:
    """sdp_utils_cpp.h `check_nonzero_sequence_lengths_dense` (the 4-D shape, last-dim stride
    1 and equal batch sizes hold for every call we make)."""
    if x.seq_q == 0 or x.seq_k == 0:
        return "a zero sequence length"
    return None


def _gqa_refusal(x: SdpaInputs, takes_gqa: bool) -> str | None:
    """sdp_utils_cpp.h `check_batch_size_and_num_heads_dense` / `check_grouped_query_attention`:
    with enable_gqa a backend that takes GQA needs the kv heads to divide the query heads; one
    that does not needs equal head counts."""
    if x.q_heads == x.kv_heads:
        return None
    if not takes_gqa:
        return f"{x.q_heads} query heads and {x.kv_heads} kv heads (equal counts only)"
    if x.q_heads % x.kv_heads:
        return f"{x.kv_heads} kv heads do not divide {x.q_heads} query heads"
    return None


def _half_dtype_refusal(x: SdpaInputs, gpu: CudaSdpa) -> str | None:
    """sdp_utils.cpp `check_dtypes_low_precision`: fp16/bf16 from sm80 on, fp16 before."""
    allowed = HALF_DTYPES if gpu.capability >= (8, 0) else (torch.float16,)
    return None if x.dtype in allowed else f"{x.dtype} (takes {allowed})"


def cudnn_refusal(x: SdpaInputs, gpu: CudaSdpa) -> str | None:
    """Why sdp_utils.cpp `can_use_cudnn_attention` refuses the call, or None."""
    version = gpu.cudnn_version
    if version is None or version < 90000:  # built without cuDNN, or older than 9.0
        return "no cuDNN 9"
    if x.dropout > 0 and 91100 < version < 91400:  # dropout broken on cuDNN 9.11 - 9.13
        return f"dropout on cuDNN {version}"
    if gpu.deterministic:  # `check_cudnn_deterministic`
        return "deterministic algorithms requested (cuDNN attention is not deterministic)"
    refusal = _half_dtype_refusal(x, gpu)
    if refusal:
        return refusal
    # `check_attn_mask_shape`: our masks are [b, 1, sq, sk] bool without grad: taken.
    if not _in_range(gpu.capability, (8, 0), (12, 1)):  # `check_cudnn_hardware_support`
        return f"{gpu.name} (cuDNN attention runs on sm80 - sm121)"
    refusal = _common_refusal(x) or _gqa_refusal(x, takes_gqa=True)
    if refusal:
        return refusal
    # `check_cudnn_tensor_shapes` (runtime cuDNN version): head dim limits, then lengths.
    limit = 128
    if version >= 91000 and gpu.capability == (9, 0):
        limit = 256
    if version >= 91100 and gpu.capability[0] == 10 and x.head_dim == 192:
        limit = 192  # DeepSeek's (192, 128): d_v differs, which our calls never have
    if x.head_dim > limit:
        return f"head dim {x.head_dim} (cuDNN takes up to {limit} on {gpu.name})"
    if x.head_dim % 8:
        return f"head dim {x.head_dim} (cuDNN takes multiples of 8)"
    if x.seq_k == 1:
        return "a key sequence of 1"
    if x.seq_q == 1 and x.dropout > 0:
        return "a query sequence of 1 with dropout"
    return None


def flash_refusal(x: SdpaInputs, gpu: CudaSdpa) -> str | None:
    """Why sdp_utils.cpp `can_use_flash_attention` refuses the call, or None."""
    if x.has_mask:  # `check_for_attn_mask`
        return "an explicit mask"
    if x.head_dim > 256:  # `check_head_dim_size_flash` (any size below: the call pads to 8)
        return f"head dim {x.head_dim} (flash takes up to 256)"
    if not _in_range(gpu.capability, (8, 0), (12, 1)):  # `check_flash_attention_hardware_support`
        return f"{gpu.name} (flash runs on sm80 - sm121)"
    # `check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120`
    small_smem = _in_range(gpu.capability, (8, 6), (8, 9)) or _in_range(
        gpu.capability, (12, 0), (12, 1)
    )
    if x.requires_grad and small_smem:
        if 192 < x.head_dim <= 224 or (x.head_dim > 224 and x.dropout > 0):
            return f"training head dim {x.head_dim} on {gpu.name}"
    # `check_flash_causal_non_square_seqlens`
    if x.causal and x.seq_q is not None and x.seq_k is not None and x.seq_q != x.seq_k:
        return "is_causal with query and key sequences of different lengths"
    return _half_dtype_refusal(x, gpu) or _gqa_refusal(x, takes_gqa=True) or _common_refusal(x)


def efficient_refusal(x: SdpaInputs, gpu: CudaSdpa) -> str | None:
    """Why sdp_utils.cpp `can_use_mem_efficient_attention` refuses the call, or None."""
    major = gpu.capability[0]
    # `check_mem_efficient_hardware_support`
    if not _in_range(gpu.capability, (5, 0), (12, 1)):
        return f"{gpu.name} (the efficient kernel runs on sm50 - sm121)"
    # `check_head_dim_size_mem_efficient`: `minimum_gemm_alignment`
    half = x.dtype in HALF_DTYPES
    tensor_cores = major >= 8 or (major >= 7 and half)  # `use_tensor_cores`
    alignment = 4 if major >= 8 else 1
    if tensor_cores:
        alignment = max(alignment, 128 // (16 if half else 32))
    if x.head_dim % alignment:
        return f"head dim {x.head_dim} (the efficient kernel takes multiples of {alignment})"
    # dense constraints: no GQA in torch 2.11's efficient kernel (supports_gqa false)
    refusal = _common_refusal(x) or _gqa_refusal(x, takes_gqa=False)
    if refusal:
        return refusal
    allowed = (torch.float16, torch.float32) + ((torch.bfloat16,) if major >= 8 else ())
    return None if x.dtype in allowed else f"{x.dtype} (takes {allowed})"


_REFUSALS = {"cudnn": cudnn_refusal, "flash": flash_refusal, "efficient": efficient_refusal}


def sdpa_choice(x: SdpaInputs, gpu: CudaSdpa = H100) -> str:
    """sdp_utils.cpp `select_sdp_backend`: the first backend in the priority order that is
    switched on and takes the call ('cudnn', 'flash', 'efficient', 'math'), or 'none' (torch
    raises "No available kernel")."""
    order = (
        ("cudnn", "flash", "efficient", "math")
        if gpu.prefers_cudnn()
        else ("flash", "efficient", "math", "cudnn")
    )
    for backend in order:
        if backend not in gpu.enabled:
            continue
        if backend == "math" or _REFUSALS[backend](x, gpu) is None:
            return backend
    return "none"


def sdpa_cuda_backend(
    dtype: torch.dtype,
    head_dim: int,
    q_heads: int,
    kv_heads: int,
    has_mask: bool,
    *,
    dropout: float = 0.0,
    seq_length: int | None = None,
    requires_grad: bool = True,
    gpu: CudaSdpa = H100,
) -> str:
    """sdpa_choice for a causal self-attention call (is_causal on square sequences, or a
    dense mask)."""
    x = _causal_inputs(
        dtype, head_dim, q_heads, kv_heads, has_mask, dropout, seq_length, requires_grad
    )
    return sdpa_choice(x, gpu)


def _causal_inputs(
    dtype, head_dim, q_heads, kv_heads, has_mask, dropout, seq_length, requires_grad
) -> SdpaInputs:
    """The SdpaInputs of local_attention's call: is_causal on square sequences, or a mask."""
    causal = not has_mask
    return SdpaInputs(
        dtype,
        head_dim,
        q_heads,
        kv_heads,
        has_mask,
        dropout,
        causal,
        seq_length,
        seq_length,
        requires_grad,
    )


def _gpu_of(device: torch.device, gpu: CudaSdpa | None) -> CudaSdpa:
    """`gpu`, else this process's GPU where CUDA is available, else the modelled H100."""
    if gpu is not None:
        return gpu
    if device.type == "cuda" and torch.cuda.is_available():
        return cuda_sdpa_facts(device)
    return H100


def _our_gpu(gpu: CudaSdpa, dropout: float, head_dim: int) -> CudaSdpa:
    """The backends we let torch choose from: without cuDNN where it would round the dropout
    probability to a multiple of 1/16, or where the head dim is above 128 (torch 2.11 takes
    up to 256 on sm90, later releases only with cuDNN 9.23 and only some sizes in backward:
    pinned to cuDNN there, a newer torch would refuse the call); the module docstring says why."""
    if (dropout > 0 and (dropout * 16) % 1) or head_dim > 128:
        return gpu.without("cudnn")
    return gpu


def sdpa_expands_kv(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    q_heads: int,
    kv_heads: int,
    has_mask: bool = False,
    *,
    dropout: float = 0.0,
    seq_length: int | None = None,
    requires_grad: bool = True,
    gpu: CudaSdpa | None = None,
) -> bool:
    """True where SDPA would fall to its math kernel because of GQA alone (fp32 on CUDA):
    the caller repeats k/v to the query heads, so that the efficient kernel takes the call."""
    if device.type != "cuda" or q_heads == kv_heads:
        return False
    our = _our_gpu(_gpu_of(device, gpu), dropout, head_dim)
    x = _causal_inputs(
        dtype, head_dim, q_heads, kv_heads, has_mask, dropout, seq_length, requires_grad
    )
    return _choice_expanding_kv(x, our)[1]


def _choice_expanding_kv(x: SdpaInputs, gpu: CudaSdpa) -> tuple[str, bool]:
    """(backend, whether k/v are repeated to the query heads first): sdpa_choice of `x`, or of
    `x` with equal head counts where only that keeps the call off the math kernel (the
    efficient kernel takes equal heads only)."""
    backend = sdpa_choice(x, gpu)
    if backend == "math" and x.q_heads != x.kv_heads:
        if sdpa_choice(replace(x, kv_heads=x.q_heads), gpu) == "efficient":
            return "efficient", True
    return backend, False


_TORCH_SDPA_BACKENDS = {
    "cudnn": "CUDNN_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}


def sdpa_backend_pinned(backend: str | None) -> AbstractContextManager:
    """torch.nn.attention.sdpa_kernel with that one CUDA SDPA backend ('cudnn', 'flash',
    'efficient', 'math'), so that torch runs it or refuses; None: nothing (the CPU)."""
    if backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, _TORCH_SDPA_BACKENDS[backend])])


@dataclass(frozen=True)
class AttentionCall:
    """What decides the kernel of one attention call."""

    device: torch.device
    dtype: torch.dtype
    head_dim: int
    q_heads: int
    kv_heads: int
    documents: bool = False
    window: int | None = None
    ring: bool = False
    use_flash_attn: bool = False
    dropout: float = 0.0  # attention dropout probability of this call (0 in evaluation)
    seq_length: int | None = None  # tokens attended (query = key length); None: unknown
    requires_grad: bool = True  # a backward will follow (grad mode on, inputs need grad)
    gpu: CudaSdpa | None = None  # None: this process's GPU, else the modelled H100
    flash_attn_installed: bool | None = None  # None: look flash-attn up
    sparse: SparseHeads | None = None  # block-sparse attention: the layer's pattern and heads


def sdpa_backend_of(call: AttentionCall) -> tuple[str, bool]:
    """(the SDPA backend a CUDA call is pinned to, whether k/v are repeated to the query heads
    first): torch's own choice among the backends we allow (`_our_gpu`), on k/v expanded where
    only that keeps the call off the math kernel (fp32 GQA: the efficient kernel takes equal
    heads only)."""
    our = _our_gpu(_gpu_of(call.device, call.gpu), call.dropout, call.head_dim)
    x = _causal_inputs(
        call.dtype,
        call.head_dim,
        call.q_heads,
        call.kv_heads,
        False,
        call.dropout,
        call.seq_length,
        call.requires_grad,
    )
    return _choice_expanding_kv(x, our)


def gpu_of(call: AttentionCall) -> CudaSdpa:
    """The GPU a CUDA call is judged on: its own, else this process's, else the H100."""
    return _gpu_of(call.device, call.gpu)
