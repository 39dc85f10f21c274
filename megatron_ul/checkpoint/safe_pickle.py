"""Unpickling that runs no code from the file: only the globals a caller names are admitted.

A pickle can name any importable callable and call it while it loads (`__reduce__`), so a file
we did not write is read with `restricted_load`, which refuses every global outside `allowed`
before it is imported. Admit only classes whose construction and `__setstate__` do nothing but
store data (dataclasses, enums, torch.Size, dtypes).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable
from typing import BinaryIO

from .files import CheckpointError


class UnsafePickleError(CheckpointError):
    """A pickle names a global outside the admitted set; the message names file and global."""


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: BinaryIO, allowed: frozenset, what: str):
        super().__init__(file)
        self._allowed, self._what = allowed, what

    def find_class(self, module: str, name: str):
        if (module, name) not in self._allowed:
            raise UnsafePickleError(
                f"{self._what}: refused to unpickle {module}.{name} (not "
                f"among the types this file may hold); the file was not "
                f"written by this program or was tampered with — not "
                f"loaded"
            )
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise UnsafePickleError(
            f"{self._what}: holds a persistent reference ({str(pid)[:60]}), "
            f"which this file never has; not loaded"
        )


def restricted_load(file: BinaryIO | bytes, allowed: Iterable[tuple[str, str]], what: str):
    """Unpickle `file` (a binary file or bytes) admitting only the (module, name) globals in
    `allowed`. UnsafePickleError naming `what` and the global for anything else; CheckpointError
    naming `what` for a damaged pickle."""
    stream = io.BytesIO(file) if isinstance(file, (bytes, bytearray)) else file
    try:
        return _RestrictedUnpickler(stream, frozenset(allowed), what).load()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(
            f"{what}: cannot be read ({type(e).__name__}: {e}); the file is corrupt or truncated"
        ) from e
