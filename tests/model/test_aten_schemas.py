"""Every `torch.ops.aten` operator megatron_ul and its tools call has the schema of torch 2.11
(the declared floor), recorded from its native_functions.yaml in tests/fixtures: this torch's
schema must equal it (a torch that renames, reorders or retypes an argument fails here, not
on a GPU), and every call site binds to it: statically (argument count, keyword names,
required arguments, for each call in the source) and by running the calls (the CUDA-only ones
on the meta device, whose kernels check shapes and dtypes)."""

import ast
import json
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_ul.model.attention import lse_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = json.load(open(os.path.join(ROOT, "tests", "fixtures", "aten_schemas_torch_2_11.json")))
SCHEMAS = {
    name: torch._C.parse_schema("aten::" + text) for name, text in FIXTURE["schemas"].items()
}
UNDEFINED_OK = {k: v for k, v in FIXTURE["_undefined_tensor_ok"].items() if k != "_note"}
# How the source names torch.ops.aten: directly, or through these module-level aliases
# (lse_kernels.cuda_ops, which tests replace with a stand-in; the benches' _aten).
ALIASES = {"cuda_ops", "_aten"}


def _aten_name(node) -> str | None:
    """NAME of `torch.ops.aten.NAME`, `torch.ops.aten.NAME.default` or `<alias>.NAME`."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    parts.reverse()
    if parts[:3] == ["torch", "ops", "aten"] and len(parts) > 3:
        return parts[3]
    if parts[0] in ALIASES and len(parts) > 1:
        return parts[1]
    return None


def _uses():
    """(file, line, op name, the Call when the name is called, else None) of every aten
    operator the source names."""
    found = []
    for top in ("megatron_ul", "tools"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for file in (f for f in files if f.endswith(".py")):
                path = os.path.join(folder, file)
                tree = ast.parse(open(path).read(), path)
                calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
                for node in ast.walk(tree):
                    name = _aten_name(node) if isinstance(node, ast.Attribute) else None
                    if name is not None:
                        rel = os.path.relpath(path, ROOT)
                        found.append((rel, node.lineno, name, calls.get(id(node))))
    return found


def _outermost(uses):
    """One entry per chain (torch.ops.aten.mm.default is one use of mm, not two)."""
    seen = {}
    for rel, line, name, call in uses:
        key = (rel, line, name)
        if key not in seen or call is not None:
            seen[key] = call
    return [(rel, line, name, call) for (rel, line, name), call in seen.items()]


USES = _outermost(_uses())


def test_the_scan_finds_the_known_call_sites():
    names = {(rel, name) for rel, _, name, _ in USES}
    assert (
        "megatron_ul/model/attention/lse_kernels.py",
        "_scaled_dot_product_efficient_attention",
    ) in names
    assert (
        "megatron_ul/model/attention/lse_kernels.py",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
    ) in names


def test_every_aten_operator_used_has_a_recorded_2_11_schema():
    missing = sorted({f"{rel}:{line} {name}" for rel, line, name, _ in USES if name not in SCHEMAS})
    assert not missing, f"record these operators' torch 2.11 schemas in the fixture: {missing}"


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_this_torch_has_the_2_11_schema(name):
    runtime = getattr(torch.ops.aten, name).default._schema
    assert runtime == SCHEMAS[name], f"torch {torch.__version__}: {runtime}\n2.11: {SCHEMAS[name]}"


def _binding_errors(schema, positional: int, keywords: list) -> list:
    args = list(schema.arguments)
    slots = [a for a in args if not a.kwarg_only]
    errors = []
    if positional > len(slots):
        errors.append(f"{positional} positional arguments, the schema takes {len(slots)}")
    given = {a.name for a in slots[:positional]}
    names = {a.name for a in args}
    for keyword in keywords:
        if keyword not in names:
            errors.append(f"no argument named {keyword!r}")
        elif keyword in given:
            errors.append(f"{keyword!r} given twice")
        given.add(keyword)
    errors += [
        f"{a.name!r} missing" for a in args if a.name not in given and not a.has_default_value()
    ]
    return errors


def test_every_call_site_binds_to_the_2_11_schema():
    checked, errors = 0, []
    for rel, line, name, call in USES:
        if call is None or name not in SCHEMAS:
            continue
        where = f"{rel}:{line} {name}"
        if any(isinstance(a, ast.Starred) for a in call.args) or any(
            k.arg is None for k in call.keywords
        ):
            errors.append(f"{where}: *args / **kwargs cannot be checked; spell the arguments out")
            continue
        keywords = [k.arg for k in call.keywords]
        errors += [
            f"{where}: {e}" for e in _binding_errors(SCHEMAS[name], len(call.args), keywords)
        ]
        checked += 1
    assert checked >= 4 and not errors, errors


def test_the_binding_check_can_fail():
    schema = SCHEMAS["_scaled_dot_product_efficient_attention"]
    assert _binding_errors(schema, 5, ["scale"]) == []
    assert _binding_errors(schema, 4, []) == ["'compute_log_sumexp' missing"]
    assert _binding_errors(schema, 5, ["scal"]) == ["no argument named 'scal'"]
    assert _binding_errors(schema, 9, []) == ["9 positional arguments, the schema takes 7"]


class _Recorder(TorchDispatchMode):
    """Every aten call with its arguments as the dispatcher bound them."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def _check_values(func, args, kwargs):
    """Tensor arguments get tensors (None only where the kernel takes an undefined one)."""
    name = func.overloadpacket.__name__
    bound = dict(zip((a.name for a in func._schema.arguments), args))
    bound.update(kwargs)
    for arg in func._schema.arguments:
        value = bound.get(arg.name)
        if str(arg.type) == "Tensor" and value is None:
            assert arg.name in UNDEFINED_OK.get(name, ()), f"{name}: {arg.name} is None"


@pytest.mark.parametrize("kernel", ["cpu-flash", "sdpa-efficient"])
@pytest.mark.parametrize("bias", [False, True])
def test_unit_kernels_call_the_operators_with_valid_arguments(kernel, bias, monkeypatch):
    """The ring's unit kernels through the real operators: the CPU flash kernel on CPU, torch's
    CUDA efficient kernel on the meta device (its meta kernel checks shapes and dtypes)."""
    monkeypatch.setattr(lse_kernels, "cuda_ops", torch.ops.aten)
    device = torch.device("meta" if kernel == "sdpa-efficient" else "cpu")
    dtype = torch.bfloat16
    q, k, v = (torch.randn(2, h, 24, 16, dtype=dtype, device=device) for h in (4, 2, 2))
    mask = torch.zeros(2, 1, 24, 32, dtype=dtype, device=device)[..., :24] if bias else None
    unit = lse_kernels.kernel_named(kernel)
    with _Recorder() as recorder:
        out, lse = unit.forward(q, k, v, not bias, mask, 0.25)
        grads = unit.backward(out, q, k, v, out, lse, not bias, mask, 0.25)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    ran = [f for f, _, _ in recorder.seen if f.overloadpacket.__name__ in SCHEMAS]
    assert len(ran) == 2, ran
    for func, args, kwargs in recorder.seen:
        if func.overloadpacket.__name__ in SCHEMAS:
            assert func._schema == SCHEMAS[func.overloadpacket.__name__]
            _check_values(func, args, kwargs)
