"""Parallel groups are explicit: code takes the rank grid from the ParallelDims it is handed
(docs/design.md, "The rank grid"). mpu/parallel_state.py builds that object and keeps nothing:
it has no module-level getters and no module-level state, so there is no process-wide grid to
reach for; nothing in the package, the tests or the tools uses anything else from it."""

import ast
import os

from tests.test_module_state import module_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARALLEL_STATE = os.path.join(ROOT, "megatron_ul", "mpu", "parallel_state.py")

# All of mpu/parallel_state.py's public names: the grid's type, the one function that creates
# process groups, and the grid of one rank (no groups) for builds without communication.
API = {"ParallelDims", "GridGroups", "initialize_model_parallel", "single_rank_dims"}


def _public_names(source: str) -> set[str]:
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return {n for n in names if not n.startswith("_")}


def _keeps_state(source: str) -> set[str]:
    """Module-level names that hold anything but an immutable literal (a group, a grid, a
    registry), or that a function rebinds."""
    tree = ast.parse(source)
    found = module_state(source, package_classes=set(), mutated=set())
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                value = []  # not a literal: a call, a name, ...
            if not isinstance(value, (tuple, str, int, float, frozenset)):
                found |= {t.id for t in targets if isinstance(t, ast.Name)}
    return found


def _uses(path: str) -> set[str]:
    """Names this module takes from parallel_state (through `ps.x`, `parallel_state.x` or
    `from ...parallel_state import x`); megatron-core's own parallel_state (a test reference)
    is not ours."""
    with open(path) as f:
        tree = ast.parse(f.read())
    aliases, used = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if not (node.level > 0 or (node.module or "").startswith("megatron_ul")):
                continue
            if (node.module or "").endswith("parallel_state"):
                used |= {a.name for a in node.names}
            elif any(a.name == "parallel_state" for a in node.names):
                aliases |= {a.asname or a.name for a in node.names if a.name == "parallel_state"}
        elif isinstance(node, ast.Import):
            aliases |= {
                a.asname or a.name
                for a in node.names
                if a.name.startswith("megatron_ul") and a.name.endswith("parallel_state")
            }
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
        ):
            used.add(node.attr)
    return used


def test_parallel_state_has_no_getters_and_no_state():
    with open(PARALLEL_STATE) as f:
        source = f.read()
    assert _public_names(source) == API, "parallel_state builds the grid; it does not serve it"
    assert _keeps_state(source) == set(), "parallel_state must not keep the grid or its groups"


def test_nothing_uses_anything_else_from_parallel_state():
    offenders = {}
    for top in ("megatron_ul", "tests", "tools", "scripts"):
        for folder, _, names in os.walk(os.path.join(ROOT, top)):
            for name in names:
                path = os.path.join(folder, name)
                if name.endswith(".py") and path != PARALLEL_STATE:
                    bad = _uses(path) - API
                    if bad:
                        offenders[os.path.relpath(path, ROOT)] = sorted(bad)
    assert not offenders, f"use the ParallelDims you are handed: {offenders}"


def test_the_checks_see_a_getter_and_a_module_level_grid(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "from ..mpu import parallel_state as ps\n"
        "def f():\n    return ps.get_tensor_model_parallel_rank()\n"
    )
    assert _uses(str(module)) - API == {"get_tensor_model_parallel_rank"}
    with open(PARALLEL_STATE) as f:
        source = f.read()
    reintroduced = source + "\n_state = None\n\ndef get_parallel_dims():\n    return _state\n"
    assert _public_names(reintroduced) - API == {"get_parallel_dims"}
    assert _keeps_state(reintroduced) == {"_state"}
    assert _keeps_state(source + "\n_GROUPS = {}\n") == {"_GROUPS"}
    assert _keeps_state(source + "\n_TP_GROUP = dist.new_group([0])\n") == {"_TP_GROUP"}
