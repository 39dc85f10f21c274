"""A strict CPU stand-in of torch's memory-efficient CUDA attention operators (sm80+), for tests:

  aten::_scaled_dot_product_efficient_attention(query, key, value, attn_bias?,
      compute_log_sumexp, dropout_p=0., is_causal=False, *, scale=None)
      -> (output, log_sumexp, philox_seed, philox_offset)
  aten::_scaled_dot_product_efficient_attention_backward(grad_out_, query, key, value,
      attn_bias, out, logsumexp, philox_seed, philox_offset, dropout_p, grad_input_mask[4],
      is_causal=False, *, scale=None) -> (grad_query, grad_key, grad_value, grad_bias)

Install with `monkeypatch.setattr(lse_kernels, "cuda_ops", EfficientOps())`.

Every rule below was read in torch's sources (aten/src/ATen/native/transformers/cuda/:
attention.cu, attention_backward.cu, mem_eff_attention/kernel_forward.h, kernel_backward.h,
gemm_kernel_utils.h, and the operators' meta functions in torch/_meta_registrations.py; no
v2.11.0 checkout was reachable, so the files were read as stored: attention_backward.cu at
pytorch 00afd8f, kernel_backward.h at 00f993d, kernel_forward.h at 01b4eae, the forward's
`_efficient_attention_forward` in attention.cu at e129513 and in a later mem_eff_api copy of
it, whose seed/offset code is the same; the meta functions in the installed torch). Both
operators view [b, h, s, d] inputs as [b, s, h, d] ("BMHK", a transpose, no copy) and hand
that to the CUTLASS kernels; strides below are of those views.

Addressing (the stand-in reads through the kernel's own addressing with as_strided, so a
wrong layout gives the kernel's wrong numbers, not an error):
  * out, backward: kernel_backward.h `Params::o_strideM()` is head_dim_value * num_heads,
    whatever out's strides; attention_backward.cu `_efficient_attention_backward` passes only
    out's batch and head strides (o_strideB, o_strideH). `computeDelta` reads out row by row
    with that stride. So out must be laid out [b, s, h, d] (what the forward returns); any
    other layout reads other rows, and past the buffer (modelled as NaN: memory the call does
    not own).
  * delta = rowsum(grad_out · out): computed INSIDE the kernel from that addressing when
    `kKernelComputesDelta` (kernel_backward.h: half types, and on sm80+ always), else by
    torch ops on the real tensors in `_efficient_attention_backward` (fp32): fp32 is
    unaffected by out's layout.
  * grad_out: `_efficient_attention_backward` makes it contiguous in BMHK first and passes
    all its strides: any layout is right (one that is already [b, s, h, d] saves that copy).
  * logsumexp, backward: read as float at lse_strideB, lse_strideH and unit stride along the
    queries (`advance_to_block`, `accumApplyLSEToSmem`); its dtype is never checked.
  * q, k, v, bias: read through their own strides (checked below).

Checks (raise, as the kernel's TORCH_CHECKs do):
  * dtypes fp32/fp16/bf16 (gemm_kernel_utils.h DISPATCH_TYPES), q/k/v one dtype; bias of
    query's dtype ("invalid dtype for bias - should match query's dtype").
  * 4-d inputs, equal head counts for q, k, v: no GQA (`_efficient_attention_forward` and
    `_efficient_attention_backward`: query.size(2) == key.size(2) in BMHK).
  * last dimension contiguous (CHECK_NOSPARSE_LASTCONTIGUOUS_CUDA) for q, k, v and the bias.
  * alignment, forward (kernel_forward.h `check_supported`; attention.cu picks the aligned
    kernel, alignment 128 bits = 8 half / 4 fp32 elements, when the head strides of q and k
    allow it, else the unaligned one with kMinimumAlignment = 4): q/k row strides, head
    strides (more than one head), batch strides (more than one batch) and the bias's
    batch/head/row strides a multiple of it.
  * alignment, backward (kernel_backward.h `check_supported`, kMinimumAlignment = 4 on sm80
    for fp32 and half, gemm_kernel_utils.h `DefaultGemmType`): q/k/v row, head and batch
    strides and the bias's batch/head/row strides multiples of 4; logsumexp head and batch
    strides multiples of 8 ("LSE is not correctly aligned"). That is why the forward pads
    log_sumexp to [b, h, ceil(s / 32) * 32] (kernel_forward.h kAlignLSE = 32, the padding
    +inf) and why a caller padding its own lse to 32 is safe.
  * bias: the forward views it as [b, h, sq, sk] by broadcasting (attention.cu
    `get_bias_4d_view`); the backward wants exactly [b, h, sq, sk] sizes (broadcast strides
    allowed) ("attn_bias: wrong shape").
  * dropout in the backward: more than 65535 batches refuse it
    (`_scaled_dot_product_efficient_attention_backward_cuda`); philox_seed/offset are read on
    the HOST (`*philox_seed.data_ptr<int64_t>()` outside graph capture): int64 one-element
    CPU tensors.

Dropout, as the kernels draw it (kernel_forward.h `attention_kernel`, kernel_backward.h
`processBlockIJ`, attention.cu `_fill_mem_eff_dropout_mask_`): the forward takes
philox_cuda_state(B * H * M * N) from the default generator of the device and returns the seed
and offset as 0-dim int64 CPU tensors (`_efficient_attention_forward`; uninitialised when
dropout_p is 0). Element (b, h, i, j) of the probabilities is kept iff its uniform number at
counter offset + ((b * H + h) * M + i) * N + j exceeds dropout_p, and kept values are scaled
by 1 / (1 - p). The forward drops the NORMALISED probabilities: the row sum and the
log-sum-exp are those without dropout. The backward redraws the mask from the seed and offset
it is given. The stand-in keeps that structure with its own counter-based hash (not curand's
Philox numbers) and draws the (seed, offset) pair from torch's default CPU generator, the
device these tensors live on, so restoring that generator's state replays them as restoring
the CUDA generator does on a GPU. A row that sees no key: out 0, lse -inf (epilogue
`MemoryEfficientAttentionNormalize` divides by 1 for a zero row sum); the padding lse +inf.

Computed in fp32 with the softmax written out; pre-sm80 GPUs (other alignments, delta by
torch ops on V100) are not modelled.
"""

from __future__ import annotations

import torch

HALF = (torch.float16, torch.bfloat16)
LSE_PAD = 32  # kernel_forward.h kAlignLSE
MIN_ALIGN = 4  # gemm_kernel_utils.h DefaultGemmType::kMinimumAlignment (sm80, fp32 and half)
LSE_ALIGN = 8  # kernel_backward.h check_supported: lse_strideH, lse_strideB
MAX_DROPOUT_BATCH = (1 << 16) - 1
_M32 = 0xFFFFFFFF


def _aligned_128(dtype: torch.dtype) -> int:
    return 8 if dtype in HALF else 4


# ---- checks ----------------------------------------------------------------------------------
def _check_inputs(q, k, v, bias, op):
    if q.dtype not in (torch.float32, *HALF):
        raise RuntimeError(f"{op}: Only fp32, half & bf16 supported at the moment (got {q.dtype})")
    if not (q.dtype == k.dtype == v.dtype):
        raise RuntimeError(f"{op}: query, key and value must share a dtype")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise RuntimeError(f"{op}: expects [batch, heads, seq, dim] inputs")
    if not (q.shape[1] == k.shape[1] == v.shape[1]):
        raise RuntimeError(
            f"{op}: query.size(2) == key.size(2) == value.size(2) failed: equal numbers of "
            f"query and key/value heads required, no GQA (got {q.shape[1]}, {k.shape[1]}, "
            f"{v.shape[1]})"
        )
    if q.shape[0] != k.shape[0] or k.shape[2] != v.shape[2] or q.shape[3] != k.shape[3]:
        raise RuntimeError(f"{op}: inconsistent batch, key length or head dim")
    for name, t in (("query", q), ("key", k), ("value", v), ("attn_bias", bias)):
        if t is not None and t.stride(-1) != 1 and t.size(-1) != 1:
            raise RuntimeError(f"{op}: {name}: last dimension must be contiguous")
    if bias is not None and bias.dtype != q.dtype:
        raise RuntimeError(f"{op}: invalid dtype for bias - should match query's dtype")


def _check_strides(op, alignment, b, h, sq, named):
    """Batch, row and head strides of each tensor a multiple of `alignment` (q/k/v: of their
    BMHK views; the bias [b, h, sq, sk]: its own), batch and head only where there is more
    than one, the bias's rows only with more than one query; data pointers aligned."""
    for name, t in named:
        if name == "attn_bias":
            strides = [("strideB", t.stride(0), b > 1), ("strideH", t.stride(1), h > 1)]
            strides.append(("strideM", t.stride(2), sq > 1))
        else:
            bmhk = t.transpose(1, 2)
            strides = [("strideB", bmhk.stride(0), b > 1), ("strideM", bmhk.stride(1), True)]
            strides.append(("strideH", bmhk.stride(2), h > 1))
        for which, stride, applies in strides:
            if applies and stride % alignment:
                raise RuntimeError(
                    f"{op}: {name} is not correctly aligned ({which}): {stride} is not a "
                    f"multiple of {alignment}"
                )
        if t.data_ptr() % alignment:
            raise RuntimeError(f"{op}: {name} pointer is not correctly aligned")


# ---- addressing --------------------------------------------------------------------------------
def read_as_kernel(t: torch.Tensor, size, stride) -> torch.Tensor:
    """t's storage read at t's storage offset with (size, stride), as a kernel given t's data
    pointer and those strides does; elements past the end of the storage read as NaN."""
    itemsize = t.element_size()
    total = t.untyped_storage().nbytes() // itemsize
    flat = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, (total,), (1,))
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= total:
        pad = torch.full((last + 1 - total,), float("nan"), dtype=t.dtype)
        flat = torch.cat([flat, pad])
    return flat.as_strided(size, stride, t.storage_offset())


def _out_as_backward_reads(out: torch.Tensor) -> torch.Tensor:
    """out [b, h, s, dv] as kernel_backward.h addresses it: batch and head strides of its
    BMHK view, row stride head_dim_value * num_heads, unit element stride."""
    b, h, s, dv = out.shape
    bmhk = out.transpose(1, 2)
    view = read_as_kernel(out, (b, s, h, dv), (bmhk.stride(0), dv * h, bmhk.stride(2), 1))
    return view.transpose(1, 2)


def _lse_as_backward_reads(lse: torch.Tensor, sq: int) -> torch.Tensor:
    b, h = lse.shape[:2]
    return read_as_kernel(lse, (b, h, sq), (lse.stride(0), lse.stride(1), 1))


# ---- dropout ---------------------------------------------------------------------------------
def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors (multipliers < 2**31: no int64 overflow)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def uniforms(seed: int, offset: int, shape) -> torch.Tensor:
    """fp32 uniforms in [0, 1) for the elements of a [B, H, M, N] attention matrix, element
    (b, h, i, j) at counter offset + ((b*H + h)*M + i)*N + j (the kernels' numbering)."""
    count = 1
    for n in shape:
        count *= n
    counter = torch.arange(count, dtype=torch.int64) + offset
    lo, hi = counter & _M32, (counter >> 32) & _M32
    key0, key1 = _mix32(torch.tensor(seed & _M32)), _mix32(torch.tensor((seed >> 32) & _M32) ^ 1)
    x = _mix32(_mix32(lo ^ key0) ^ hi ^ key1)
    return ((x >> 8).double() / float(1 << 24)).float().view(shape)


def keep_scale(seed: int, offset: int, shape, dropout_p: float) -> torch.Tensor:
    """Z of the kernels: 1 / (1 - p) where the uniform exceeds p, else 0 (fp32)."""
    keep = uniforms(seed, offset, shape) > dropout_p
    return keep.float() / (1.0 - dropout_p)


def _draw_philox() -> tuple[torch.Tensor, torch.Tensor]:
    """(seed, offset) from torch's default CPU generator, advancing it once per call."""
    seed, offset = torch.randint(0, 1 << 40, (2,), dtype=torch.int64).tolist()
    return torch.tensor(seed, dtype=torch.int64), torch.tensor(offset, dtype=torch.int64)


def _scores(q, k, bias, causal, scale):
    s = q.float() @ k.float().transpose(-1, -2) * scale
    if bias is not None:
        s = s + bias.float()
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s


class EfficientOps:
    """The two operators; `calls` counts them, `philox` lists each forward's (seed, offset,
    [B, H, M, N], dropout_p) in call order."""

    def __init__(self):
        self.calls = {"forward": 0, "backward": 0}
        self.philox: list[tuple[int, int, tuple[int, int, int, int], float]] = []

    def _scaled_dot_product_efficient_attention(
        self, q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None
    ):
        op = "_efficient_attention_forward"
        _check_inputs(q, k, v, attn_bias, op)
        b, h, sq, _ = q.shape
        sk = k.shape[2]
        bias = None
        if attn_bias is not None:
            try:
                bias = attn_bias.expand(b, h, sq, sk)  # get_bias_4d_view
            except RuntimeError as error:
                raise RuntimeError(f"{op}: attn_bias does not broadcast: {error}") from None
        qt, kt = q.transpose(1, 2), k.transpose(1, 2)
        aligned = _aligned_128(q.dtype)
        if qt.stride(2) % aligned or kt.stride(2) % aligned:
            aligned = MIN_ALIGN  # the unaligned kernel
        _check_strides(op, aligned, b, h, sq, [("query", q), ("key", k)])
        if bias is not None:
            _check_strides(op, aligned, b, h, sq, [("attn_bias", bias)])
        self.calls["forward"] += 1
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        s = _scores(q, k, bias, is_causal, scale)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)  # a row without keys: 0
        if dropout_p > 0:
            seed, offset = _draw_philox()
            self.philox.append((int(seed), int(offset), (b, h, sq, sk), dropout_p))
            p = p * keep_scale(int(seed), int(offset), (b, h, sq, sk), dropout_p)
        else:  # uninitialised in the kernel: values that mean nothing
            seed = torch.tensor(-1, dtype=torch.int64)
            offset = torch.tensor(-1, dtype=torch.int64)
        out = torch.empty(b, sq, h, v.shape[-1], dtype=q.dtype).transpose(1, 2)  # BMHK
        out.copy_(p @ v.float())
        padded = torch.full((b, h, -(-sq // LSE_PAD) * LSE_PAD if compute_log_sumexp else 0), 0.0)
        if compute_log_sumexp:
            padded[..., sq:] = float("inf")
            padded[..., :sq] = lse
        return out, padded, seed, offset

    def _scaled_dot_product_efficient_attention_backward(
        self,
        grad_out,
        q,
        k,
        v,
        attn_bias,
        out,
        logsumexp,
        philox_seed,
        philox_offset,
        dropout_p,
        grad_input_mask,
        is_causal=False,
        *,
        scale=None,
    ):
        op = "_efficient_attention_backward"
        _check_inputs(q, k, v, attn_bias, op)
        b, h, sq, _ = q.shape
        sk = k.shape[2]
        for name, t in (("grad_out", grad_out), ("out", out)):
            if t.dim() != 4 or t.shape[:3] != q.shape[:3] or t.shape[3] != v.shape[3]:
                raise RuntimeError(f"{op}: {name} must be [b, h, sq, dv] like query/value")
            if t.dtype != q.dtype:
                raise RuntimeError(f"{op}: {name} must have query's dtype")
        if logsumexp.dim() != 3 or tuple(logsumexp.shape[:2]) != (b, h):
            raise RuntimeError(f"{op}: logsumexp must be [b, h, >= sq]")
        if logsumexp.dtype != torch.float32:
            raise RuntimeError(f"{op}: logsumexp is read as float (got {logsumexp.dtype})")
        if h > 1 and logsumexp.stride(1) % LSE_ALIGN:
            raise RuntimeError(f"{op}: LSE is not correctly aligned (strideH)")
        if b > 1 and logsumexp.stride(0) % LSE_ALIGN:
            raise RuntimeError(f"{op}: LSE is not correctly aligned (strideB)")
        if attn_bias is not None:
            if tuple(attn_bias.shape) != (b, h, sq, sk):
                raise RuntimeError(
                    f"{op}: attn_bias: wrong shape: {tuple(attn_bias.shape)}, the kernel "
                    f"wants exactly [b, h, sq, sk] = {(b, h, sq, sk)}"
                )
        if q.transpose(1, 2).stride(2) % MIN_ALIGN or k.transpose(1, 2).stride(2) % MIN_ALIGN:
            raise RuntimeError(f"{op}: cutlassB: no kernel found to launch!")
        named = [("query", q), ("key", k), ("value", v)]
        _check_strides(op, MIN_ALIGN, b, h, sq, named)
        if attn_bias is not None:
            _check_strides(op, MIN_ALIGN, b, h, sq, [("attn_bias", attn_bias)])
        if dropout_p > 0:
            if b > MAX_DROPOUT_BATCH:
                raise RuntimeError(f"{op}: cannot handle dropout with more than 65535 batches")
            for name, t in (("philox_seed", philox_seed), ("philox_offset", philox_offset)):
                if t.dtype != torch.int64 or t.numel() != 1 or t.device.type != "cpu":
                    raise RuntimeError(
                        f"{op}: {name} must be a one-element int64 CPU tensor (read on the host)"
                    )
        self.calls["backward"] += 1
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        g = grad_out.float()
        if q.dtype in HALF:  # kKernelComputesDelta: from out as the kernel addresses it
            delta = (g * _out_as_backward_reads(out).float()).sum(-1, keepdim=True)
        else:
            delta = (g * out.float()).sum(-1, keepdim=True)
        s = _scores(q, k, attn_bias, is_causal, scale)
        p = torch.exp(s - _lse_as_backward_reads(logsumexp, sq).unsqueeze(-1))
        z = torch.ones(())
        if dropout_p > 0:
            z = keep_scale(int(philox_seed), int(philox_offset), (b, h, sq, sk), dropout_p)
        ds = p * (z * (g @ v.float().transpose(-1, -2)) - delta)
        dq = ds @ k.float() * scale
        dk = ds.transpose(-1, -2) @ q.float() * scale
        dv = (p * z).transpose(-1, -2) @ g
        grads = []
        for grad, like in ((dq, q), (dk, k), (dv, v)):  # BMHK, as the kernel allocates them
            bmhk = torch.empty(like.shape[0], like.shape[2], like.shape[1], grad.shape[-1])
            grads.append(bmhk.to(like.dtype).transpose(1, 2).copy_(grad))
        return grads[0], grads[1], grads[2], None
