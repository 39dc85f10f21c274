"""Imports run one way: config/timers -> mpu -> model -> pipeline/optim -> checkpoint -> training.

Each package area has a level; a module may import its own area and lower levels only (and
pipeline and optim, on one level, not each other). tools/ and tests/ sit on top and may import
anything. A new area must be given a level here (docs/design.md explains the order).
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "megatron_ul")

LEVELS = {
    "config": 0,
    "timers": 0,  # plain data and tools every layer may use
    "exit_signals": 0,  # standard library only: installed first
    "progress": 0,  # standard library only: long operations' progress lines
    "mpu": 1,
    "data": 1,
    "arguments": 1,  # parallel primitives; data; the command line
    "moe_rules": 1,  # the MoE flags' rules (config_rules reads them)
    "sparsity_config": 1,  # the block-sparse patterns as configuration (reads config)
    "model": 2,
    "initialize": 2,
    "config_rules": 2,
    "config_files": 2,  # the checks of a config (they parse data flags)
    "pipeline": 3,
    "optim": 3,
    "checkpoint": 4,
    "training": 5,
    "inference": 5,
}


def area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The module `from {'.' * level}{name} import ...` names inside `module`. A relative
    import counts from the package holding the module; a package's __init__.py holds itself."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - level + 1]
    return ".".join(base + ([name] if name else []))


def test_relative_imports_resolve_like_python():
    from importlib.util import resolve_name

    cases = [  # (module, is a package's __init__, level, name)
        ("megatron_ul.optim", True, 2, "pipeline.model"),
        ("megatron_ul.optim", True, 1, "grads"),
        ("megatron_ul.optim.grads", False, 2, "pipeline.model"),
        ("megatron_ul.optim.grads", False, 1, None),
        ("megatron_ul.checkpoint.interop", True, 3, "model.gpt"),
    ]
    for module, is_package, level, name in cases:
        package = module if is_package else module.rsplit(".", 1)[0]
        expected = resolve_name("." * level + (name or ""), package)
        assert absolute(module, is_package, level, name) == expected.rstrip(".")


def imports():
    """(importing module, imported module) for every megatron_ul import in the package."""
    for folder, _, names in os.walk(PACKAGE):
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
            module = module.removesuffix(".__init__")
            with open(path) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level:
                    yield module, absolute(module, name == "__init__.py", node.level, node.module)
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "megatron_ul"
                ):
                    yield module, node.module
                elif isinstance(node, ast.Import):
                    yield from (
                        (module, a.name) for a in node.names if a.name.startswith("megatron_ul")
                    )


def test_every_area_has_a_level():
    areas = {area(m) for m, _ in imports()} | {area(t) for _, t in imports()}
    assert areas - {""} <= set(LEVELS), f"give {areas - {''} - set(LEVELS)} a level in LEVELS"


def test_no_import_runs_back_up():
    upward = sorted(
        f"{m} -> {t}"
        for m, t in imports()
        if area(t) and area(m) and area(m) != area(t) and LEVELS[area(t)] >= LEVELS[area(m)]
    )
    assert upward == []
