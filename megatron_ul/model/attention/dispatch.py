"""Which attention kernel runs: one decision, made per call, reported by the log and --dry-run.

The mask travels from the data to the kernel in one form: the documents' offsets
(DocumentMask, cu_seqlens) and the window (--window-size LEFT,0). `attention_kernel` maps a
call (device, dtype, head dim, heads, documents, window, ring, dropout, --use-flash-attn) to one
of

  flash-attn            flash_attn_func (causal, window_size)
  flash-attn varlen     flash_attn_varlen_func (documents, window_size)
  sdpa cudnn            torch SDPA, its cuDNN kernel (CUDA fp16/bf16; first on sm90 and sm100)
  sdpa flash            torch SDPA, its flash kernel (CUDA fp16/bf16; GQA inside the kernel)
  sdpa efficient        torch SDPA, its memory-efficient kernel (CUDA fp32; GQA by expanding
                        k/v first, since the kernel takes equal head counts only)
  sdpa math             torch SDPA's math kernel (the N×N scores; refused for a run)
  sdpa cpu-flash        torch SDPA on CPU (its fused flash kernel, any float dtype; its math
                        kernel with attention dropout, where the log says "sdpa math")
  document tiles        documents / window on CUDA without flash-attn: query tiles of 512 on
                        torch's efficient kernel, a few calls per tile whatever the number
                        of documents (tiled_document_attention.py)
  document blocks       documents / window on the CPU (and fp64 with attention dropout): SDPA
                        once per document or query block (document_attention.py)
  ring: <dense>/<masked> the ring's unit kernels (lse_kernels.py) for unmasked units and for
                        units the window or documents cut through

Every call site (local_attention, document_attention, ring_attention) runs what `decide`
returns, and `decide` logs it once per attention path and kernel, so the log names what ran:

  attention: causal = sdpa cpu-flash (cpu)
  attention: causal = sdpa flash (cuda sm90, cuDNN 91900; dropout 0.1)
  attention: documents + window 64 = document blocks (cpu)
  attention: ring unit kernel = cpu-flash / cpu-flash (cpu; --use-flash-attn given, but ...)

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
from dataclasses import dataclass, field, replace
from typing import ContextManager, Optional

import torch

from .local import FLASH_DTYPES, announce_once, input_refusal, flash_attn_refusal

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
    cudnn_version: Optional[int] = TORCH_2_11_CUDNN
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
    seq_q: Optional[int] = None  # None: not known, taken as more than one token
    seq_k: Optional[int] = None
    requires_grad: bool = True


def _in_range(cap: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> bool:
    return low <= cap <= high  # sdp_utils.cpp `check_sm_version`


def _common_refusal(x: SdpaInputs) -> Optional[str]:
    """sdp_utils_cpp.h `check_nonzero_sequence_lengths_dense` (the 4-D shape, last-dim stride
    1 and equal batch sizes hold for every call we make)."""
    if x.seq_q == 0 or x.seq_k == 0:
        return "a zero sequence length"
    return None


def _gqa_refusal(x: SdpaInputs, takes_gqa: bool) -> Optional[str]:
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


def _half_dtype_refusal(x: SdpaInputs, gpu: CudaSdpa) -> Optional[str]:
    """sdp_utils.cpp `check_dtypes_low_precision`: fp16/bf16 from sm80 on, fp16 before."""
    allowed = HALF_DTYPES if gpu.capability >= (8, 0) else (torch.float16,)
    return None if x.dtype in allowed else f"{x.dtype} (takes {allowed})"


def cudnn_refusal(x: SdpaInputs, gpu: CudaSdpa) -> Optional[str]:
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


def flash_refusal(x: SdpaInputs, gpu: CudaSdpa) -> Optional[str]:
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


def efficient_refusal(x: SdpaInputs, gpu: CudaSdpa) -> Optional[str]:
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
    seq_length: Optional[int] = None,
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


def _gpu_of(device: torch.device, gpu: Optional[CudaSdpa]) -> CudaSdpa:
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
    seq_length: Optional[int] = None,
    requires_grad: bool = True,
    gpu: Optional[CudaSdpa] = None,
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


def sdpa_backend_pinned(kernel: str) -> ContextManager:
    """For a CUDA SDPA kernel ('sdpa cudnn', 'sdpa flash', 'sdpa efficient', 'sdpa math'):
    torch.nn.attention.sdpa_kernel with that one backend, so that torch runs it or refuses;
    for any other kernel, nothing."""
    backend = _TORCH_SDPA_BACKENDS.get(kernel.removeprefix("sdpa "))
    if not kernel.startswith("sdpa ") or backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, backend)])


def kv_for_kernel(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads_dim=2):
    """k, v repeated to q's heads where the decided kernel takes equal head counts only (SDPA's
    efficient kernel); else unchanged (the other kernels take GQA through enable_gqa)."""
    hq, hk = q.shape[heads_dim], k.shape[heads_dim]
    if kernel != "sdpa efficient" or hq == hk:
        return k, v
    return (
        k.repeat_interleave(hq // hk, dim=heads_dim),
        v.repeat_interleave(hq // hk, dim=heads_dim),
    )


def _flash_attn_runs(
    device: torch.device, dtype: torch.dtype, installed: Optional[bool], has_mask: bool = False
) -> bool:
    """flash-attn's kernels run here on this dtype: looked up (installed None) or as if it
    were installed or not (--dry-run plans both)."""
    if installed is None:
        return flash_attn_refusal(device, dtype, has_mask) is None
    return installed and device.type == "cuda" and input_refusal(dtype, has_mask) is None


def _flash_attn_unit_ok(device, dtype, head_dim, installed: Optional[bool] = None) -> bool:
    """flash-attn's private forward/backward (no padding of the head dim, unlike its public
    functions) run here on this dtype and head dim."""
    return _flash_attn_runs(device, dtype, installed) and head_dim % 8 == 0 and head_dim <= 256


def ring_unit_kernels(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    use_flash_attn: bool,
    flash_attn_installed: Optional[bool] = None,
) -> tuple[str, str]:
    """(kernel for unmasked units, kernel for units with a bias) of the ring, by name in
    lse_kernels.KERNELS. Raises ValueError where no fused kernel takes the head dim.
    flash_attn_installed: None to look flash-attn up, else as if it were (not) installed."""
    flash = use_flash_attn and _flash_attn_unit_ok(device, dtype, head_dim, flash_attn_installed)
    if device.type == "cpu":
        return ("flash-attn" if flash else "cpu-flash"), "cpu-flash"
    if device.type != "cuda" or dtype == torch.float64:
        return "reference", "reference"
    alignment = 8 if dtype in HALF_DTYPES else 4
    if dtype not in (torch.float32, *HALF_DTYPES) or head_dim % alignment:
        raise ValueError(
            f"ring attention on CUDA needs fp32/fp16/bf16 activations and a head "
            f"dim divisible by {alignment} (got {head_dim} in "
            f"{str(dtype).replace('torch.', '')}): change {HEAD_DIM_FLAGS}"
        )
    if flash:
        return "flash-attn", "sdpa-efficient"
    return "sdpa-efficient", "sdpa-efficient"


@dataclass(frozen=True)
class AttentionCall:
    """What decides the kernel of one attention call."""

    device: torch.device
    dtype: torch.dtype
    head_dim: int
    q_heads: int
    kv_heads: int
    documents: bool = False
    window: Optional[int] = None
    ring: bool = False
    use_flash_attn: bool = False
    dropout: float = 0.0  # attention dropout probability of this call (0 in evaluation)
    dense_mask: bool = False  # a dense [b, 1, N, N] mask (tests only): SDPA with a mask
    seq_length: Optional[int] = None  # tokens attended (query = key length); None: unknown
    requires_grad: bool = True  # a backward will follow (grad mode on, inputs need grad)
    gpu: Optional[CudaSdpa] = None  # None: this process's GPU, else the modelled H100
    flash_attn_installed: Optional[bool] = None  # None: look flash-attn up


def attention_kernel(call: AttentionCall) -> str:
    """The kernel that runs `call` (the names in this module's docstring)."""
    if call.ring:
        dense, masked = ring_unit_kernels(
            call.device, call.dtype, call.head_dim, call.use_flash_attn, call.flash_attn_installed
        )
        return f"ring: {dense}" + (
            f" / {masked}" if call.documents or call.window is not None else ""
        )
    flash = (
        call.use_flash_attn
        and not call.dense_mask
        and _flash_attn_runs(call.device, call.dtype, call.flash_attn_installed)
    )
    if call.documents or call.window is not None:
        if flash:
            return "flash-attn varlen" if call.documents else "flash-attn"
        tiles = call.device.type == "cuda" and not (call.dropout and call.dtype == torch.float64)
        return "document tiles" if tiles else "document blocks"
    if flash:
        return "flash-attn"
    if call.device.type == "cpu":
        # sdp_utils_cpp.cpp `use_flash_attention_cpp` runs `check_for_dropout`: with attention
        # dropout torch's CPU SDPA takes its math kernel.
        return "sdpa math" if call.dropout > 0 else "sdpa cpu-flash"
    if call.device.type != "cuda":
        return "sdpa"
    return "sdpa " + _cuda_sdpa_backend(call)


def _cuda_sdpa_backend(call: AttentionCall) -> str:
    """The SDPA backend local_attention pins for a CUDA call: torch's own choice among the
    backends we allow (`_our_gpu`), on k/v expanded to the query heads where only that keeps
    the call off the math kernel (fp32 GQA: the efficient kernel takes equal heads only)."""
    our = _our_gpu(_gpu_of(call.device, call.gpu), call.dropout, call.head_dim)
    x = _causal_inputs(
        call.dtype,
        call.head_dim,
        call.q_heads,
        call.kv_heads,
        call.dense_mask,
        call.dropout,
        call.seq_length,
        call.requires_grad,
    )
    return _choice_expanding_kv(x, our)[0]


def kernel_refusal(call: AttentionCall) -> Optional[str]:
    """Why `call` has no fused kernel (a message naming the flags to change), or None: on
    CUDA a head dim that SDPA's fused kernels all refuse would run its math kernel (the N×N
    scores), and the ring's unit kernels refuse it outright."""
    try:
        kernel = attention_kernel(call)
    except ValueError as refused:
        return str(refused)
    if call.device.type != "cuda" or kernel not in ("sdpa math", "sdpa none"):
        return None
    wanted = "at most 256 or a multiple of 8" if call.dtype in HALF_DTYPES else "a multiple of 4"
    return (
        f"no fused attention kernel on CUDA takes head dim {call.head_dim} in "
        f"{str(call.dtype).replace('torch.', '')}: torch SDPA would run its math kernel "
        f"(N×N scores); change {HEAD_DIM_FLAGS} so that the head dim is {wanted}"
    )


def attention_path(call: AttentionCall) -> str:
    """The path a call belongs to, for the log: causal, documents, window W, ring unit kernel."""
    if call.ring:
        return "ring unit kernel"
    parts = (["documents"] if call.documents else []) + (
        [f"window {call.window}"] if call.window is not None else []
    )
    return " + ".join(parts) or "causal"


def decide(call: AttentionCall) -> str:
    """attention_kernel(call), logged once per path and kernel with the device (on CUDA its
    capability and cuDNN, and the dropout) and, where --use-flash-attn was given and
    flash-attn does not run, why."""
    kernel = attention_kernel(call)
    where = call.device.type
    if call.device.type == "cuda":
        gpu = _gpu_of(call.device, call.gpu)
        where += f" {gpu.name}, cuDNN {gpu.cudnn_version}"
        if call.dropout > 0:
            where += f"; dropout {call.dropout:g}"
    if call.use_flash_attn and "flash-attn" not in kernel:
        why = (
            flash_attn_refusal(call.device, call.dtype, call.dense_mask)
            or "flash-attn refuses this head dim"
        )
        where += f"; --use-flash-attn given, but {why}"
    announce_once(f"{attention_path(call)} = {kernel.removeprefix('ring: ')} ({where})")
    return kernel


def planned_kernels(call: AttentionCall) -> dict[tuple[str, bool], str]:
    """{(GPU, flash-attn installed): kernel} of `call` on each modelled GPU (MODELLED_GPUS,
    torch 2.11's bundled cuDNN) with and without flash-attn: attention_kernel's answers."""
    cuda = torch.device("cuda")
    return {
        (name, installed): attention_kernel(
            replace(call, device=cuda, gpu=gpu, flash_attn_installed=installed)
        )
        for name, gpu in MODELLED_GPUS.items()
        for installed in (False, True)
    }


def _per_gpu(kernels: dict[tuple[str, bool], str], installed: bool) -> str:
    """One kernel, or 'K1 on GPU1, K2 on GPU2' where the GPUs differ."""
    by_gpu = {name: k for (name, inst), k in kernels.items() if inst == installed}
    if len(set(by_gpu.values())) == 1:
        return next(iter(by_gpu.values()))
    return ", ".join(f"{k} on {name}" for name, k in by_gpu.items())


def _planned_text(call: AttentionCall) -> str:
    kernels = planned_kernels(call)
    without = _per_gpu(kernels, False)
    if not call.use_flash_attn:
        return without
    if call.dtype not in FLASH_DTYPES:
        return f"{without} (--use-flash-attn given, but {input_refusal(call.dtype, False)})"
    with_flash = _per_gpu(kernels, True)
    if with_flash == without:
        return without
    return f"{with_flash} where flash-attn is installed, else {without}"


def planned_kernel(call: AttentionCall) -> str:
    """What --dry-run reports for the run's attention call (its own dropout; the device is
    ignored): the kernel on each modelled GPU, with and without flash-attn, and the kernel of
    evaluation (no dropout, no backward) where it differs."""
    training = _planned_text(call)
    if call.dropout == 0:
        return training
    evaluation = _planned_text(replace(call, dropout=0.0, requires_grad=False))
    if evaluation == training:
        return training
    return f"{training}; in evaluation (no dropout): {evaluation}"
