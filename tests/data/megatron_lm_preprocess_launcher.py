"""Runs Megatron-LM's own tools/preprocess_data.py (a checkout on PYTHONPATH) on a machine
without triton and on Python 3.11, for the byte comparisons of
tests/data/test_preprocess_tokenizer_paths_vs_megatron_lm.py:

    PYTHONPATH=MEGATRON_LM_DIR python megatron_lm_preprocess_launcher.py \
        MEGATRON_LM_DIR/tools/preprocess_data.py FLAGS...

Import-time stand-ins only, none of which preprocessing calls: every megatron module of the
checkout that imports triton at module level (GPU kernels) is an empty module whose names are
no-op classes, and typing.override (Python 3.12, an identity decorator) is the identity.
"""

import importlib.abc
import importlib.machinery
import os
import re
import runpy
import sys
import types
import typing


def _triton_modules(root: str) -> set:
    """Dotted names of the checkout's megatron modules that import triton unconditionally
    (at module level; guarded imports inside try blocks cope without it)."""
    found = set()
    for folder, _, names in os.walk(os.path.join(root, "megatron")):
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8", errors="replace") as f:
                if not re.search(r"^(import triton|from triton)", f.read(), re.M):
                    continue
            dotted = os.path.relpath(path, root)[: -len(".py")].replace(os.sep, ".")
            found.add(dotted.removesuffix(".__init__"))
    return found


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {"__init__": lambda self, *a, **k: None})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: set):
        self.names = names

    def find_spec(self, name, path, target=None):
        if name in self.names:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Stub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


if __name__ == "__main__":
    script = sys.argv[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(script)))
    if not hasattr(typing, "override"):
        typing.override = lambda f: f  # type: ignore[attr-defined]
    sys.meta_path.insert(0, _StubFinder(_triton_modules(root)))
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
