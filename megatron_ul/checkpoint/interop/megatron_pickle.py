"""Reading Megatron-LM's torch-saved files (model_optim_rng.pt, common.pt) without running code.

Megatron pickles more than tensors: `args` is an argparse.Namespace holding enums
(args.model_type = megatron.core.enums.ModelType, args.attention_backend =
megatron.core.transformer.enums.AttnBackend, the CUDA-graph settings' enums of the same
module, args.exit_signal = signal.Signals) and the RNG
state holds numpy's MT19937 state array. torch's weights_only unpickler admits exactly the
globals named in ALLOWED below and nothing else; Megatron's enums are rebuilt as plain
stand-ins (name and value kept), so neither the megatron package nor any code from the file
is needed. Anything else pickled in the file is refused with an error naming the file.
"""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import re
import signal
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..files import CheckpointError


class MegatronEnum:
    """A pickled Megatron enum member, rebuilt from its value (Enum pickles as Cls(value))."""

    enum_name = "?"

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return type(other) is type(self) and other.value == self.value

    def __hash__(self):
        return hash((self.enum_name, self.value))

    def __repr__(self):
        return f"{self.enum_name}({self.value!r})"


def _enum_stand_in(qualified: str) -> type:
    name = qualified.rsplit(".", 1)[1]
    return type(name, (MegatronEnum,), {"enum_name": qualified, "__module__": __name__})


class MegatronRecord:
    """A pickled Megatron dataclass instance (OptimizerConfig), rebuilt as its fields only."""

    record_name = "?"

    def __setstate__(self, state):
        self.__dict__.update(state if isinstance(state, dict) else {})

    def __repr__(self):
        return f"{self.record_name}({self.__dict__!r})"


def _record_stand_in(qualified: str) -> type:
    name = qualified.rsplit(".", 1)[1]
    return type(name, (MegatronRecord,), {"record_name": qualified, "__module__": __name__})


# The enums Megatron-LM 0.16 to 0.19 leave in args: ModelType and AttnBackend (all), the
# --cuda-graph-scope list (CudaGraphScope, 0.16-0.17), --cuda-graph-modules (CudaGraphModule,
# 0.18+) and --inference-cuda-graph-scope (InferenceCudaGraphScope, always set from 0.18).
_TRANSFORMER_ENUMS = "megatron.core.transformer.enums."
_MEGATRON_ENUMS = ["megatron.core.enums.ModelType"] + [
    _TRANSFORMER_ENUMS + name
    for name in ("AttnBackend", "CudaGraphScope", "CudaGraphModule", "InferenceCudaGraphScope")
]
# Beyond args, what megatron-core itself admits when it loads its checkpoints with
# weights_only (megatron/core/safe_globals.py, 0.16 to 0.19): the rerun state machine's enums
# (saved when its mode is on), OptimizerConfig, and plain SimpleNamespace, PosixPath, BytesIO.
_MEGATRON_ENUMS += [
    "megatron.core.rerun_state_machine." + name
    for name in ("RerunMode", "RerunState", "RerunDiagnostic")
]
_MEGATRON_RECORDS = ["megatron.core.optimizer.optimizer_config.OptimizerConfig"]
_numpy_core = getattr(np, "_core", None) or np.core
# The one allowlist: (object, the global's name as the pickle spells it). numpy 1.x pickles
# its array reconstructor as numpy.core.*, numpy 2.x as numpy._core.*.
ALLOWED: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
    (argparse.Namespace, "argparse.Namespace"),
    (signal.Signals, "signal.Signals"),
    (np.ndarray, "numpy.ndarray"),
    (np.dtype, "numpy.dtype"),
    (_numpy_core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
    (_numpy_core.multiarray._reconstruct, "numpy._core.multiarray._reconstruct"),
    (type(np.dtype(np.uint32)), "numpy.dtypes.UInt32DType"),
    (types.SimpleNamespace, "types.SimpleNamespace"),
    (pathlib.PosixPath, "pathlib.PosixPath"),
    (io.BytesIO, "_io.BytesIO"),
    *[(_enum_stand_in(name), name) for name in _MEGATRON_ENUMS],
    *[(_record_stand_in(name), name) for name in _MEGATRON_RECORDS],
]


def load(path: str, trust_pickle: bool = False) -> dict:
    """A Megatron-LM torch file on CPU; only ALLOWED globals unless `trust_pickle`."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing; the Megatron-LM checkpoint is incomplete")
    with open(path, "rb") as f:
        return load_stream(f, path, trust_pickle)


def load_stream(stream, what: str, trust_pickle: bool = False):
    """load() of an open binary stream (a file, or bytes stored inside another file) that
    error messages call `what`."""
    if trust_pickle:
        try:
            return torch.load(stream, map_location="cpu", weights_only=False)
        except ModuleNotFoundError as e:
            raise CheckpointError(
                f"{what}: full unpickling needs the module {e.name!r}, which "
                f"is not installed; without --trust-pickle the restricted "
                f"loader reads Megatron's own enums without it"
            ) from e
        except Exception as e:
            raise CheckpointError(
                f"{what}: full unpickling failed ({type(e).__name__}: {str(e)[:200]}); the "
                f"installed packages do not define what the file names (another Megatron "
                f"release wrote it?). Without --trust-pickle the restricted loader reads "
                f"Megatron's own enums without them"
            ) from e
    with torch.serialization.safe_globals(ALLOWED):
        try:
            return torch.load(stream, map_location="cpu", weights_only=True)
        except Exception as e:
            refused = re.search(r"GLOBAL (\S+)", str(e))
            why = (
                f"it pickles {refused.group(1)}, which is not among the tensors, args, "
                f"enums and numpy RNG state Megatron-LM writes"
                if refused
                else f"{type(e).__name__}: {str(e)[:200]}"
            )
            raise CheckpointError(
                f"{what}: cannot be read safely ({why}). If the file comes from a source you "
                f"trust, pass --trust-pickle (full unpickling runs code from the file)"
            ) from e
