"""Which attention kernel a GPU-check row actually ran, recorded on the row's own inputs.

`SdpaRecorder` is a TorchFunctionMode: while it is active, every call of
`F.scaled_dot_product_attention` is asked `torch.ops.aten._fused_sdp_choice` with that call's
own arguments (the backend SDPA's dispatcher picks for exactly those tensors, under the
`sdpa_kernel` restrictions and priority order in force at the call), and every direct call of
a fused attention op (`aten::_scaled_dot_product_efficient_attention`, as the ring units and
the document tiles make through model/attention/lse_kernels.py) is counted by its op name.
Nothing is read from our own dispatch rules: those are what the check verifies.

The op's schema (torch 2.11, aten/src/ATen/native/native_functions.yaml):
  _fused_sdp_choice(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None,
                    float dropout_p=0., bool is_causal=False, *, float? scale=None,
                    bool enable_gqa=False) -> int
Its result is an `SDPBackend` (aten/src/ATen/SDPBackend.h; torch.nn.attention.SDPBackend is
torch._C._SDPBackend): ERROR -1, MATH 0, FLASH_ATTENTION 1, EFFICIENT_ATTENTION 2,
CUDNN_ATTENTION 3, OVERRIDEABLE 4. The names are read from the running torch's enum, that
table is the fallback. On the CPU the op answers too (FLASH_ATTENTION is the CPU flash kernel,
MATH the composite), so the reduced mode exercises the same call.

The mode is thread-local: on CUDA autograd runs backward on its own thread, so a row records
its forward calls (the backward of each runs the matching backward kernel). Its Python hook
costs microseconds per torch call, so rows record in an untimed pass.
"""

from __future__ import annotations

import inspect
from collections import Counter

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from megatron_ul.model.attention.dispatch import sdpa_backend_name

TORCH_2_11_SDP_VALUES = range(-1, 5)  # at::SDPBackend's values in torch 2.11 (SDPBackend.h)

_SHORT = {
    "ERROR": "error",
    "MATH": "math",
    "FLASH_ATTENTION": "flash",
    "EFFICIENT_ATTENTION": "efficient",
    "CUDNN_ATTENTION": "cudnn",
    "OVERRIDEABLE": "overrideable",
}
# fused attention ops that callers may invoke directly (not through SDPA's dispatcher)
DIRECT_OPS = {
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_flash_attention_for_cpu": "cpu flash",
    "_efficient_attention_forward": "efficient",
    "_flash_attention_forward": "flash",
}
_SDPA = inspect.Signature(
    [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
        for name, default in (
            ("query", inspect.Parameter.empty),
            ("key", inspect.Parameter.empty),
            ("value", inspect.Parameter.empty),
            ("attn_mask", None),
            ("dropout_p", 0.0),
            ("is_causal", False),
            ("scale", None),
            ("enable_gqa", False),
        )
    ]
)


def backend_names() -> dict[int, str]:
    """SDPBackend value -> short name, from the running torch's enum (else torch 2.11's, as
    attention_dispatch.sdpa_backend_name has them)."""
    try:
        from torch.nn.attention import SDPBackend

        members = SDPBackend.__members__.items()
        names = {int(member.value): _SHORT.get(name, name.lower()) for name, member in members}
    except (ImportError, AttributeError, TypeError):
        names = {}
    return names or {value: sdpa_backend_name(value) for value in TORCH_2_11_SDP_VALUES}


def fused_sdp_choice(*args, **kwargs) -> str:
    """The backend SDPA picks for these arguments (SDPA's own signature), by name."""
    bound = _SDPA.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    choice = torch.ops.aten._fused_sdp_choice(
        a["query"],
        a["key"],
        a["value"],
        a["attn_mask"],
        float(a["dropout_p"]),
        bool(a["is_causal"]),
        scale=a["scale"],
        enable_gqa=bool(a["enable_gqa"]),
    )
    return backend_names().get(int(choice)) or sdpa_backend_name(choice)


def _op_name(func) -> tuple[str, str]:
    """(namespace, op name) of a torch.ops packet or overload, else ("", "")."""
    qualified = getattr(func, "_qualified_op_name", None) or getattr(
        getattr(func, "_schema", None), "name", None
    )
    if not isinstance(qualified, str) or "::" not in qualified:
        return "", ""
    namespace, name = qualified.split("::", 1)
    return namespace, name


class SdpaRecorder(TorchFunctionMode):
    """Counts the attention kernels that ran while active, as 'sdpa <backend>' (an SDPA call,
    its backend from _fused_sdp_choice), '<kernel> (direct)' (a fused op called directly) or
    'flash-attn' (a flash_attn custom op, flash-attn >= 2.7)."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls[self._sdpa(args, kwargs)] += 1
        else:
            namespace, name = _op_name(func)
            if namespace == "aten" and name in DIRECT_OPS:
                self.calls[f"{DIRECT_OPS[name]} (direct)"] += 1
            elif namespace == "flash_attn":
                self.calls["flash-attn"] += 1
        return func(*args, **kwargs)

    @staticmethod
    def _sdpa(args, kwargs) -> str:
        try:
            name = fused_sdp_choice(*args, **kwargs)
        except Exception as e:
            return f"sdpa ? ({type(e).__name__})"
        query = args[0] if args else kwargs.get("query")
        device = query.device.type if isinstance(query, torch.Tensor) else "?"
        return f"sdpa {name}" + ("" if device == "cuda" else f" ({device})")

    def add(self, name: str, count: int = 1) -> None:
        """Count calls that no torch function shows (a Python stand-in of a CUDA op)."""
        if count:
            self.calls[name] += count


def summary(calls: Counter) -> str:
    """'sdpa cudnn', 'efficient (direct) ×12, sdpa flash ×2', or '-' when nothing ran."""
    if not calls:
        return "-"
    if len(calls) == 1:
        return next(iter(calls))
    return ", ".join(f"{name} ×{n}" for name, n in calls.most_common())


def recorded(calls: Counter) -> str | None:
    """The distinct backends, most used first (the JSON's sdpa_backend), or None."""
    return ", ".join(name for name, _ in calls.most_common()) or None
