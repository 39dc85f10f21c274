"""The docs name only what exists: every backticked repository path (`megatron_ul/...`,
`tools/...`, `tests/...`, `scripts/...`, `docs/...`) is a file or folder, every backticked
`module.name` under megatron_ul imports and has that attribute, every backticked
`--flag` is one of ours (the training parser, a tool's or script's parser, pytest's options),
a Megatron-LM flag the interop converters read or refuse, or one of the few other programs'
flags the docs name; every relative Markdown link resolves."""

from __future__ import annotations

import importlib
import pkgutil
import re
from fnmatch import fnmatchcase
from functools import cache
from pathlib import Path

import megatron_ul
from megatron_ul.arguments import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(ROOT.glob("docs/**/*.md")) + [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]

# Flags of other programs that the docs name on purpose.
FOREIGN_FLAGS = {
    # Slurm's sbatch/srun and torchrun (docs/operations.md)
    "--signal",
    "--kill-on-bad-exit",
    "--ntasks-per-node",
    "--job-name",
    "--open-mode",
    "--requeue",
    "--standalone",
    # ruff and pip
    "--check",
    "--no-deps",
    "--ignore-requires-python",
    # Megatron-LM's, named where its behaviour is compared
    "--overlap-p2p-comm",
    "--accumulate-allreduce-grads-in-fp32",
    "--barrier-with-L1-time",
    "--exit-on-missing-checkpoint",
    "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers",
    # docs/design.md's placeholder for a gate flag in a flag declaration
    "--switch",
}
# Other repositories' files, and a placeholder, that the docs name on purpose.
FOREIGN_PATHS = {
    "tools/checkpoint/loader_legacy.py",  # Megatron-LM's
    "tools/convert_checkpoint/deepspeed_to_megatron.py",  # Megatron-DeepSpeed's
    "tools/NAME.py",  # docs/design.md: how a tool is run
}

_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(r"(?<![\w./-])((?:megatron_ul|tools|tests|scripts|docs)/[\w./*-]*[\w*])")
# `model/tiled_loss.py`: a path inside the package, named from its top level
_PACKAGE_PATH = re.compile(r"(?<![\w./-])([a-z_]+/[\w./-]*\.py)\b")
_FLAG = re.compile(r"(?<![\w-])(--[A-Za-z][\w*-]*)")  # `--target-*`: a family of flags
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
# Where our own parsers declare their options: argparse, pytest, and the shell scripts' cases.
_DECLARED = re.compile(r"(?:add_argument|addoption)\(([^)]*)\)", re.S)
_SHELL_CASE = re.compile(r"^\s*(--[\w-]+)(?:\|--[\w-]+)*\)", re.M)


@cache
def _our_flags() -> frozenset[str]:
    flags = {s for action in build_parser()._actions for s in action.option_strings}
    for path in [*ROOT.glob("tools/**/*.py"), *ROOT.glob("megatron_ul/**/*.py")] + [
        ROOT / "tests" / "conftest.py"
    ]:
        for call in _DECLARED.findall(path.read_text()):
            flags |= set(re.findall(r"[\"'](--[\w-]+)[\"']", call))
    for script in ROOT.glob("scripts/**/*.sh"):
        flags |= set(_SHELL_CASE.findall(script.read_text()))
    # Megatron-LM's flags that the converters read or refuse: named in their messages
    for path in ROOT.glob("megatron_ul/checkpoint/interop/**/*.py"):
        flags |= set(re.findall(r"--[A-Za-z][\w-]*\w", path.read_text()))
    return frozenset(flags)


@cache
def _package_tops() -> frozenset[str]:
    return frozenset(m.name for m in pkgutil.iter_modules(megatron_ul.__path__))


def _spans(doc: Path):
    name = doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        for span in _CODE_SPAN.findall(line):
            yield f"{name}:{number}", span


def missing_paths(docs: list[Path]) -> list[str]:
    missing = []
    for doc in docs:
        for where, span in _spans(doc):
            for path in _PATH.findall(span):
                if path in FOREIGN_PATHS:
                    continue
                if "*" in path:
                    found = any(ROOT.glob(path))
                else:
                    found = (ROOT / path).exists() or (ROOT / (path + ".py")).exists()
                if not found:
                    missing.append(f"{where}: {path}")
            for path in _PACKAGE_PATH.findall(span):
                top = path.split("/")[0]
                if top in _package_tops() and not (ROOT / "megatron_ul" / path).exists():
                    missing.append(f"{where}: {path}")
    return missing


def unknown_flags(docs: list[Path]) -> list[str]:
    known = _our_flags() | FOREIGN_FLAGS
    return [
        f"{where}: {flag}"
        for doc in docs
        for where, span in _spans(doc)
        for flag in _FLAG.findall(span)
        if not any(fnmatchcase(k, flag) for k in known)
    ]


_DOTTED = re.compile(r"(?:megatron_ul\.)?([a-z_]\w*(?:\.\w+)+)(?:\(.*\))?")
_FILE_SUFFIXES = {"py", "json", "md", "safetensors", "toml", "yaml", "txt", "bin", "idx", "pt"}


def _resolves(parts: list[str]) -> bool:
    """Whether megatron_ul.<parts> names a module or one of its attributes. Only checked when a
    module (not a bare package) is named: `model.dims` is an object's attribute, not a path."""
    for cut in range(len(parts), 0, -1):
        name = "megatron_ul." + ".".join(parts[:cut])
        try:
            obj = importlib.import_module(name)
        except ImportError:
            continue
        if cut == 1 and hasattr(obj, "__path__") and len(parts) > 1:
            return True  # `package.attribute`: an instance's field, not checked
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


def unknown_dotted_names(docs: list[Path]) -> list[str]:
    tops = _package_tops()
    unknown = []
    for doc in docs:
        for where, span in _spans(doc):
            match = _DOTTED.fullmatch(span)
            if match is None:
                continue
            parts = match.group(1).split(".")
            if parts[0] in tops and parts[-1] not in _FILE_SUFFIXES and not _resolves(parts):
                unknown.append(f"{where}: {span}")
    return unknown


def test_backticked_paths_exist():
    missing = missing_paths(DOCS)
    assert missing == [], "docs name paths that do not exist:\n" + "\n".join(missing)


def test_backticked_flags_exist():
    unknown = unknown_flags(DOCS)
    assert unknown == [], "docs name flags no parser declares:\n" + "\n".join(unknown)


def test_backticked_module_names_exist():
    unknown = unknown_dotted_names(DOCS)
    assert unknown == [], "docs name modules or attributes that do not exist:\n" + "\n".join(
        unknown
    )


def test_relative_links_resolve():
    broken = []
    for doc in DOCS:
        for target in _LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == [], "docs link to files that do not exist:\n" + "\n".join(broken)


def test_the_checks_catch_stale_names(tmp_path):
    doc = tmp_path / "page.md"
    doc.write_text(
        "`megatron_ul/model/gpt.py`, `--seq-length`, `ruff format --check`, `timers.NO_TIMERS`\n"
        "`megatron_ul/no_such_module.py` and `--no-such-flag`, `training.pretrain.no_such`\n"
        "`model/tiled_loss.py` and `model/no_such.py`\n"
    )
    assert missing_paths([doc]) == [
        f"{doc}:2: megatron_ul/no_such_module.py",
        f"{doc}:3: model/no_such.py",
    ]
    assert unknown_flags([doc]) == [f"{doc}:2: --no-such-flag"]
    assert unknown_dotted_names([doc]) == [f"{doc}:2: training.pretrain.no_such"]
