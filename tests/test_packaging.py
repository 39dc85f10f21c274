"""The repository is a package: installable, importable without path hacks, tools run as modules."""
import importlib
import os
import pkgutil
import re
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_files():
    for top in ("megatron_ul", "tools", "tests", "pretrain_gpt.py"):
        path = os.path.join(ROOT, top)
        if path.endswith(".py"):
            yield path
        for folder, _, names in os.walk(path):
            yield from (os.path.join(folder, n) for n in names if n.endswith(".py"))


def test_no_sys_path_manipulation():
    pattern = re.compile(r"sys\.path\.(insert|append|extend)|sys\.path\s*=|site\.addsitedir")
    offenders = [os.path.relpath(p, ROOT) for p in python_files()
                 if p != os.path.abspath(__file__) and pattern.search(open(p).read())]
    assert offenders == [], "run tools as `python -m tools.NAME` (or pip install -e .) instead"


def test_every_package_folder_has_an_init():
    for top in ("megatron_ul", "tools"):
        for folder, dirs, names in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            if any(n.endswith(".py") for n in names):
                assert "__init__.py" in names, os.path.relpath(folder, ROOT)


def test_pyproject_reads_existing_requirement_lists():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    dynamic = project["tool"]["setuptools"]["dynamic"]
    files = dynamic["dependencies"]["file"] + [
        name for extra in dynamic["optional-dependencies"].values() for name in extra["file"]]
    assert set(dynamic["optional-dependencies"]) >= {"hf", "data", "dev"}
    for name in files:
        with open(os.path.join(ROOT, name)) as f:  # pip options would break pyproject's reading
            assert all(not line.startswith("-") for line in f), name


@pytest.mark.parametrize("module", sorted(
    m.name for m in pkgutil.walk_packages([os.path.join(ROOT, "tools")], prefix="tools.")))
def test_every_tool_imports_as_a_module(module):
    tool = importlib.import_module(module)
    assert tool.__doc__, f"{module}: say in a docstring what it does and how to run it"
