"""Module-level mutable state is pinned: every piece the package keeps outside the objects it
hands around is listed here with the reason it is module-level (docs/design.md, "Where each
kind of state lives"). A new global, cache or registry makes this test fail until it is either
turned into something that is handed over (the ParallelDims, the Timers, the model) or added
here with its reason, and the design page says why."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "megatron_ul")

PINNED = {
    (
        "mpu/random.py",
        "_TRACKER",
    ): "named states of torch's default generator, itself one per process; seeded from the "
    "ParallelDims it is handed, saved in checkpoints",
    (
        "mpu/comm_stats.py",
        "_counts",
    ): "byte counter, None unless a benchmark opens `with count_communication()`; restored "
    "when the block ends",
    (
        "model/attention/ring.py",
        "_times",
    ): "ring time split, None unless a benchmark opens `with measure_ring_time()`",
    ("model/attention/backends.py", "_announced"): "log lines said once per process",
    ("model/norms.py", "_announced"): "log lines said once per process",
    (
        "exit_signals.py",
        "_signal_received",
    ): "set by the SIGTERM/SIGUSR1 handler; signal handlers are per process",
    (
        "checkpoint/files.py",
        "_held_locks",
    ): "this process's flock on each save directory (the lock belongs to the process)",
    (
        "checkpoint/training/load.py",
        "last_load_report",
    ): "what this process's last torch_dist load read (a measurement tests and benchmarks "
    "read after a run; nothing in the package reads it)",
    (
        "mpu/host_staging.py",
        "_pending_streams",
    ): "streams with device-to-host copies into host-held gradients not yet waited for; "
    "emptied by the one wait of each step (a CUDA stream is per process)",
    (
        "mpu/param_init.py",
        "_deferred",
    ): "True only inside `with deferred()` (ZeRO-3's meta build, materialised after "
    "sharding); restored when the block ends",
    ("timers.py", "NO_TIMERS"): "the shared do-nothing Timers (log level 0 records nothing)",
    **{
        ("model/attention/lse_kernels.py", name): (
            "a frozen descriptor of one unit kernel (immutable)"
        )
        for name in ("CPU_FLASH", "FLASH_ATTN", "SDPA_EFFICIENT", "REFERENCE")
    },
    **{
        ("model/attention/dispatch.py", name): "a frozen descriptor of one modelled GPU "
        "(immutable), what --dry-run plans for"
        for name in ("H100", "A100")
    },
    **{
        key: "a table of the settings a converter maps or refuses, built once at import from "
        "the config classes and never written after"
        for key in (
            ("checkpoint/interop/hf.py", "HF_KEYS"),
            ("checkpoint/interop/settings.py", "CORE_FIELDS"),
            ("checkpoint/interop/settings.py", "_FLAGS"),
        )
    },
    (
        "mpu/offload.py",
        "_SOLE_HOLDER_USES",
    ): "the use counts of a gradient nothing else holds, measured once per process (they "
    "depend on the torch release, one per process)",
    (
        "mpu/offload.py",
        "_PROBE",
    ): "None except while that one measurement runs; restored when it ends",
}

_CONTAINER_CALLS = {
    "set",
    "dict",
    "list",
    "defaultdict",
    "OrderedDict",
    "deque",
    "Counter",
    "bytearray",
}
_MUTATORS = {
    "add",
    "append",
    "extend",
    "update",
    "setdefault",
    "pop",
    "popitem",
    "clear",
    "remove",
    "discard",
    "insert",
    "__setitem__",
}


def _is_constant_name(name: str) -> bool:
    return name.isupper() or (name.startswith("__") and name.endswith("__"))


def _mutated_names(tree: ast.AST) -> set[str]:
    """Names (or attributes) that are item-assigned, augmented or called with a mutator."""
    out = set()

    def receiver(node):
        if isinstance(node, ast.Name):
            return node.id
        return node.attr if isinstance(node, ast.Attribute) else None

    for node in ast.walk(tree):
        targets = (
            node.targets
            if isinstance(node, (ast.Assign, ast.Delete))
            else [node.target]
            if isinstance(node, (ast.AugAssign, ast.AnnAssign))
            else []
        )
        for t in targets:
            if isinstance(t, ast.Subscript):
                out.add(receiver(t.value))
            elif isinstance(node, ast.AugAssign):
                out.add(receiver(t))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _MUTATORS
        ):
            out.add(receiver(node.func.value))
    return out - {None}


def module_state(source: str, package_classes: set[str], mutated: set[str]) -> set[str]:
    """Module-level names in `source` that hold mutable state: rebound by a `global`
    statement, or bound to a container or an instance of a package class, except constant
    tables (UPPER_CASE names that nothing mutates)."""
    tree = ast.parse(source)
    rebound = {n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names}
    found = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            if not isinstance(target, ast.Name):
                continue
            name = target.id
            call = value.func if isinstance(value, ast.Call) else None
            called = (
                call.id
                if isinstance(call, ast.Name)
                else call.attr
                if isinstance(call, ast.Attribute)
                else None
            )
            container = (
                isinstance(
                    value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
                )
                or called in _CONTAINER_CALLS
            )
            if name in rebound or called in package_classes:
                found.add(name)
            elif container and not (_is_constant_name(name) and name not in mutated):
                found.add(name)
    return found | rebound  # a global first bound inside a function counts too


def _sources() -> dict[str, str]:
    out = {}
    for folder, _, names in os.walk(PACKAGE):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    out[os.path.relpath(path, PACKAGE).replace(os.sep, "/")] = f.read()
    return out


def package_state() -> set[tuple[str, str]]:
    sources = _sources()
    trees = {rel: ast.parse(src) for rel, src in sources.items()}
    classes = {c.name for t in trees.values() for c in ast.walk(t) if isinstance(c, ast.ClassDef)}
    mutated = set().union(*(_mutated_names(t) for t in trees.values()))
    return {
        (rel, name) for rel, src in sources.items() for name in module_state(src, classes, mutated)
    }


def test_module_level_state_is_pinned():
    found = package_state()
    assert found - set(PINNED) == set(), (
        "new module-level state: hand it over (ParallelDims, Timers, the model) or pin it "
        f"here with its reason and in docs/design.md: {sorted(found - set(PINNED))}"
    )
    assert set(PINNED) - found == set(), f"gone, drop from PINNED: {sorted(set(PINNED) - found)}"


def test_the_scan_sees_globals_registries_and_holders():
    source = (
        "_AXES = ('tp', 'sp')\nTABLE = {'a': 1}\nCACHE = {}\n_groups = {}\n"
        "_state = None\n_holder = Holder()\nlog = logging.getLogger(__name__)\n"
        "def init(dims):\n    global _state\n    _state = dims\n    CACHE['x'] = 1\n"
    )
    mutated = _mutated_names(ast.parse(source))
    assert module_state(source, {"Holder"}, mutated) == {"CACHE", "_groups", "_state", "_holder"}
