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
    "mpu": 1,
    "data": 1,
    "arguments": 1,  # parallel primitives; data; the command line
    "model": 2,
    "initialize": 2,
    "config_rules": 2,
    "config_files": 2,  # the checks of a config (they parse data flags)
    "pipeline": 3,
    "optim": 3,
    "checkpoint": 4,
    "training": 5,
    "inference": 5,
    "local_ranks": 5,
}


def area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports():
    """(importing module, imported module) for every megatron_ul import in the package."""
    for folder, _, names in os.walk(PACKAGE):
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
            package = module if name == "__init__.py" else module.rsplit(".", 1)[0]
            module = module.removesuffix(".__init__")
            with open(path) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    yield module, ".".join(base + ([node.module] if node.module else []))
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
