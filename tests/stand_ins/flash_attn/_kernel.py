"""The CUDA extension `flash_attn_2_cuda` as the stand-in models it: the input checks of
csrc/flash_attn/flash_api.cpp (`mha_fwd`, `mha_bwd`, `mha_varlen_fwd`; tags v2.5.9.post1,
v2.6.3, v2.7.4.post1, v2.8.3) and FlashAttention-2's arithmetic, written out in fp32.

Semantics read from the kernel sources:
  - window (`set_params_fprop`, `mha_fwd`): query i sees keys j with
    i + sk - sq - left <= j <= i + sk - sq + right; -1 or a size >= seqlen_k means unbounded;
    `causal` sets right = 0 (so the causal mask is bottom-right aligned);
  - a row that sees no key: output 0 and lse +inf (softmax.h `normalize_softmax_lse`), so that
    backward's exp(S - lse) is 0;
  - softcap (2.6+): S = softcap * tanh(S / softcap) before the mask; not with dropout;
  - ALiBi (alibi.h): causal adds slope * j (the row's constant drops out of the softmax but
    not out of lse), otherwise -slope * |i + sk - sq - j|;
  - dropout: probabilities dropped with p and kept ones scaled by 1 / (1 - p); the pattern
    comes from rng_state = (seed, offset), which the forward draws from the default generator
    and the backward must be given to drop the same entries (the kernel's Philox; the stand-in
    seeds a torch.Generator instead, so patterns differ from the GPU's but the contract holds);
  - backward (flash_bwd_preprocess_kernel.h `dot_do_o`): D = rowsum(dout * out) * (1 - p),
    written to softmax_d [b, h, round_up(sq, 128)]; dS = P * (dP - D) with P = exp(S - lse) from
    the lse it is given; GQA's dk, dv summed over the query heads of a group (`mha_bwd`).
Not modelled: paged KV, the seqlen_q == 1 head swap (no visible difference), sm-dependent rules.
"""

import math
import os

import torch

# The name of megatron_ul's documented test hook (megatron_ul/model/attention/flash_attn.py);
# duplicated here rather than imported so that this package stays a drop-in for the real one.
FLASH_ON_CPU_ENV = "MEGATRON_UL_TEST_FLASH_ATTN_ON_CPU"
HALF = (torch.float16, torch.bfloat16)


def round_multiple(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def check(ok: bool, message: str) -> None:
    """TORCH_CHECK: the kernels raise RuntimeError."""
    if not ok:
        raise RuntimeError(message)


def check_device(*tensors: torch.Tensor) -> None:
    """CHECK_DEVICE: CUDA only; with the test hook also the CPU."""
    cpu_ok = os.environ.get(FLASH_ON_CPU_ENV) == "1"
    for t in tensors:
        ok = t.device.type == "cuda" or (t.device.type == "cpu" and cpu_ok)
        check(
            ok,
            f"FlashAttention only supports CUDA tensors (got {t.device}; CPU tests set "
            f"{FLASH_ON_CPU_ENV}=1)",
        )
    check(len({t.device for t in tensors}) == 1, "FlashAttention: all inputs on one device")


def check_shape(name: str, t: torch.Tensor, *shape: int) -> None:
    check(tuple(t.shape) == shape, f"{name} must have shape {shape} (got {tuple(t.shape)})")


def check_qkv(q, k, v) -> None:
    """mha_fwd / mha_varlen_fwd / mha_bwd: dtype, device and last-dimension rules."""
    check(q.dtype in HALF, f"FlashAttention only support fp16 and bf16 data type (got {q.dtype})")
    check(k.dtype == q.dtype, "query and key must have the same dtype")
    check(v.dtype == q.dtype, "query and value must have the same dtype")
    check_device(q, k, v)
    for t in (q, k, v):
        check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")


def check_heads(num_heads: int, num_heads_k: int) -> None:
    check(
        num_heads_k > 0 and num_heads % num_heads_k == 0,
        "Number of heads in key/value must divide number of heads in query",
    )


def check_window(left, right) -> tuple[int, int]:
    """The kernel takes two ints; the stand-in also refuses what no caller means (< -1)."""
    ok = all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in (left, right))
    check(ok, f"window_size must be ints >= -1 (got {(left, right)})")
    return left, right


def check_dropout_softcap(dropout_p: float, softcap: float) -> None:
    check(dropout_p < 1.0, "dropout_p must be < 1")
    if softcap > 0.0:
        check(dropout_p == 0.0, "Softcapping does not support dropout for now")


def check_alibi(alibi_slopes, batch_size: int, num_heads: int) -> None:
    """set_params_alibi."""
    if alibi_slopes is None:
        return
    check(alibi_slopes.dtype == torch.float32, "ALiBi slopes must have dtype fp32")
    check_device(alibi_slopes)
    check(alibi_slopes.stride(-1) == 1, "ALiBi slopes tensor must have contiguous last dimension")
    check(
        tuple(alibi_slopes.shape) in ((num_heads,), (batch_size, num_heads)),
        "ALiBi slopes must have shape (num_heads) or (batch_size, num_heads)",
    )


def check_like(name: str, t, like: torch.Tensor, shape: tuple) -> None:
    """dq, dk, dv (mha_bwd): given by the caller, written in place."""
    check(t.dtype == like.dtype, f"{name} must have the same dtype as q")
    check_device(t)
    check(t.stride(-1) == 1, f"{name} must have contiguous last dimension")
    check_shape(name, t, *shape)


def kernel_window(left, right, causal, seqlen_k) -> tuple[int, int]:
    """mha_fwd / mha_bwd: sizes >= seqlen_k are unbounded; causal means right = 0."""
    left = -1 if left >= seqlen_k else left
    right = -1 if right >= seqlen_k else right
    return (left, 0) if causal else (left, right)


def seed_of(dropout_p: float, rng_state) -> tuple[int, torch.Tensor]:
    """(seed, rng_state [2] int64): the given state, or a fresh draw from the default generator
    (the kernel's philox_cuda_state) when there is none."""
    if rng_state is not None:
        return int(rng_state[0]), rng_state
    seed = int(torch.randint(0, 2**62, (1,))) if dropout_p > 0 else 0
    return seed, torch.tensor([seed, 0], dtype=torch.int64)


def _visible(sq, sk, left, right, device):
    i = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    j = torch.arange(sk, device=device).unsqueeze(0)
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        ok &= j <= i + right
    if left >= 0:
        ok &= j >= i - left
    return ok


def _scores(qf, kf, scale, window, causal, softcap, alibi_slopes):
    """(S after softcap, ALiBi and mask [b, h, sq, sk], tanh of the softcap or None)."""
    b, h, sq, _ = qf.shape
    sk = kf.shape[2]
    s = qf @ kf.transpose(-1, -2) * scale
    tanh = None
    if softcap > 0:
        tanh = torch.tanh(s / softcap)
        s = softcap * tanh
    if alibi_slopes is not None:
        slopes = alibi_slopes.float().reshape(-1, h, 1, 1)
        j = torch.arange(sk, device=s.device).float()
        if causal:
            s = s + slopes * j
        else:
            i = torch.arange(sq, device=s.device).float().unsqueeze(1) + (sk - sq)
            s = s - slopes * (i - j).abs()
    left, right = window
    return s.masked_fill(~_visible(sq, sk, left, right, s.device), float("-inf")), tanh


def _keep(shape, dropout_p, seed, device):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) >= dropout_p).to(device)


def _heads_first(t, heads):
    """[b, s, hk, d] -> fp32 [b, heads, s, d], kv heads repeated over their group."""
    t = t.float().transpose(1, 2)
    return t.repeat_interleave(heads // t.shape[1], 1)


def forward(q, k, v, dropout_p, scale, window, causal, softcap, alibi_slopes, seed):
    """q [b, sq, h, d], k, v [b, sk, hk, d] -> out (q's dtype), lse fp32 [b, h, sq] (+inf where
    a row sees no key), and P with dropped entries negated ([b, h, sq, sk], for S_dmask)."""
    with torch.autocast(q.device.type, enabled=False):
        hq = q.shape[2]
        s, _ = _scores(
            _heads_first(q, hq), _heads_first(k, hq), scale, window, causal, softcap, alibi_slopes
        )
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
        dropped = p
        if dropout_p > 0:
            keep = _keep(p.shape, dropout_p, seed, p.device)
            dropped = p * keep / (1 - dropout_p)
            p = torch.where(keep, p, -p)
        out = (dropped @ _heads_first(v, hq)).transpose(1, 2).to(q.dtype).contiguous()
        lse = lse.masked_fill(torch.isneginf(lse), float("inf")).contiguous()
        return out, lse, p


def backward(dout, q, k, v, out, lse, dropout_p, scale, window, causal, softcap, alibi, seed):
    """fp32 dq [b, sq, h, d], dk, dv [b, sk, hk, d] and D [b, h, sq] from the given out and lse."""
    with torch.autocast(q.device.type, enabled=False):
        b, sq, hq, d = q.shape
        sk, hk = k.shape[1], k.shape[2]
        qf, kf, vf = _heads_first(q, hq), _heads_first(k, hq), _heads_first(v, hq)
        gf, of = _heads_first(dout, hq), _heads_first(out, hq)
        s, tanh = _scores(qf, kf, scale, window, causal, softcap, alibi)
        p = torch.exp(s - lse.unsqueeze(-1))  # 0 where masked and on rows without keys
        keep_scale = torch.ones((), device=q.device)
        if dropout_p > 0:
            keep_scale = _keep(p.shape, dropout_p, seed, p.device) / (1 - dropout_p)
        delta = (gf * of).sum(-1, keepdim=True)
        dv = (p * keep_scale).transpose(-1, -2) @ gf
        ds = p * ((gf @ vf.transpose(-1, -2)) * keep_scale - delta)
        if tanh is not None:
            ds = ds * (1 - tanh * tanh)
        dq = ds @ kf * scale
        dk = ds.transpose(-1, -2) @ qf * scale
        group = hq // hk
        dk, dv = (t.view(b, hk, group, sk, d).sum(2) for t in (dk, dv))
        return (
            dq.transpose(1, 2),
            dk.transpose(1, 2),
            dv.transpose(1, 2),
            delta.squeeze(-1) * (1 - dropout_p),
        )


def read_lse(lse: torch.Tensor, b: int, h: int, sq: int) -> torch.Tensor:
    """softmax_lse as mha_bwd reads it: fp32 at offsets ((b * h) + h) * sq + i from its data
    pointer, whatever its strides (the kernel checks only its device)."""
    check(lse.dtype == torch.float32, f"softmax_lse must be fp32 (got {lse.dtype})")
    check_device(lse)
    end = lse.storage_offset() + b * h * sq
    check(
        lse.untyped_storage().nbytes() >= end * 4,
        f"softmax_lse holds fewer than batch * heads * seqlen_q = {b * h * sq} values: the "
        "kernel would read past it",
    )
    return torch.as_strided(lse, (b, h, sq), (h * sq, sq, 1), lse.storage_offset())


def default_scale(q: torch.Tensor, softmax_scale) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
