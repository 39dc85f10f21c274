"""The repository is a package: installable, importable without path hacks, tools run as modules."""

import importlib
import os
import pkgutil
import re
import subprocess
import sys

import pytest
import tomllib

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
    offenders = [
        os.path.relpath(p, ROOT)
        for p in python_files()
        if p != os.path.abspath(__file__) and pattern.search(open(p).read())
    ]
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
        name for extra in dynamic["optional-dependencies"].values() for name in extra["file"]
    ]
    assert set(dynamic["optional-dependencies"]) >= {"hf", "data", "dev"}
    for name in files:
        with open(os.path.join(ROOT, name)) as f:  # pip options would break pyproject's reading
            assert all(not line.startswith("-") for line in f), name


@pytest.mark.parametrize(
    "module",
    sorted(m.name for m in pkgutil.walk_packages([os.path.join(ROOT, "tools")], prefix="tools.")),
)
def test_every_tool_imports_as_a_module(module):
    tool = importlib.import_module(module)
    assert tool.__doc__, f"{module}: say in a docstring what it does and how to run it"


def _script_tools() -> list[str]:
    """Tools a user may run as `python tools/NAME.py`: a main, the package imported at the top,
    no import of the (uninstalled) tools package."""
    found = []
    for path in python_files():
        rel = os.path.relpath(path, ROOT)
        text = open(path).read()
        if (
            rel.startswith("tools")
            and "__main__" in text
            and re.search(r"^(from|import) megatron_ul\b", text, re.M)
            and not re.search(r"^(from|import) tools\b", text, re.M)
        ):
            found.append(rel)
    return sorted(found)


def _run(args: list[str], cwd, pythonpath: str | None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_script_tools_without_the_package_say_what_to_run(tmp_path):
    if _run(["-c", "import megatron_ul"], tmp_path, None).returncode == 0:
        pytest.skip("megatron_ul is installed in this interpreter")
    tools = _script_tools()
    assert "tools/preprocess_data.py" in tools and "tools/checkpoint/convert.py" in tools
    for rel in tools:
        result = _run([os.path.join(ROOT, rel), "--help"], tmp_path, None)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and lines == [
            "megatron_ul is not installed: run `bash scripts/install.sh` (or pip install -e .)"
        ], (rel, result.stderr)


def test_script_tools_run_once_the_package_is_importable(tmp_path):
    # an editable install puts the checkout on the path, as PYTHONPATH does here
    for rel in ("tools/merge_datasets.py", "tools/checkpoint/convert.py"):
        result = _run([os.path.join(ROOT, rel), "--help"], tmp_path, ROOT)
        assert result.returncode == 0 and "usage:" in result.stdout, (rel, result.stderr)
