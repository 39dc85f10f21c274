"""Parallel groups are explicit: megatron_ul code takes the rank grid from the ParallelDims it
is handed, never from mpu.parallel_state's module-level getters (docs/design.md, "The rank
grid"). Only the lifecycle functions and the ParallelDims type may be used from outside."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "megatron_ul")

ALLOWED = {"ParallelDims", "initialize_model_parallel", "destroy_model_parallel",
           "model_parallel_is_initialized", "single_rank_dims", "single_rank_view"}
# Modules still reading the process-wide grid, to be converted (issue 16): each entry must go,
# none may be added.
NOT_YET_CONVERTED = {"mpu/layers.py", "mpu/mappings.py", "optim/grads.py",
                     "optim/distributed_optimizer.py", "optim/zero3.py"}


def _uses(path: str) -> set[str]:
    """Names this module takes from parallel_state (through `ps.x`, `parallel_state.x` or
    `from ...parallel_state import x`)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    aliases, used = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if (node.module or "").endswith("parallel_state"):
                used |= {a.name for a in node.names}
            elif any(a.name == "parallel_state" for a in node.names):
                aliases |= {a.asname or a.name for a in node.names if a.name == "parallel_state"}
        elif isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names
                        if a.name.endswith("parallel_state")}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases):
            used.add(node.attr)
    return used


def test_no_module_reads_the_process_wide_grid():
    offenders = {}
    for folder, _, names in os.walk(PACKAGE):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), PACKAGE)
            if not name.endswith(".py") or rel == os.path.join("mpu", "parallel_state.py"):
                continue
            bad = _uses(os.path.join(folder, name)) - ALLOWED
            if bad and rel not in NOT_YET_CONVERTED:
                offenders[rel] = sorted(bad)
    assert not offenders, f"use the ParallelDims you are handed, not the getters: {offenders}"


def test_the_not_yet_converted_list_only_shrinks():
    still = {rel for rel in NOT_YET_CONVERTED
             if _uses(os.path.join(PACKAGE, rel)) - ALLOWED}
    assert still == NOT_YET_CONVERTED, f"converted: drop {NOT_YET_CONVERTED - still} from the list"


def test_the_check_sees_a_getter_call(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from ..mpu import parallel_state as ps\n"
                      "def f():\n    return ps.get_tensor_model_parallel_rank()\n")
    assert _uses(str(module)) - ALLOWED == {"get_tensor_model_parallel_rank"}
