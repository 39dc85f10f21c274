"""Checkpoints of other frameworks (Hugging Face, Megatron-LM, megatron-core) read into and
written from megatron_ul checkpoints, through one interface (base.Converter): any converter
reads into a FullCheckpoint, any converter writes one. CONVERTERS is the table the conversion
command's --from and --to name; a new family is one module with one converter class, added
here."""

from __future__ import annotations

import types

from ..files import CheckpointError
from .base import Converter
from .hf import HuggingFace
from .hf_moe import HuggingFaceMixtral
from .megatron_core import MegatronCore
from .megatron_lm import MegatronLM
from .ours import MegatronUl

CONVERTERS: types.MappingProxyType[str, Converter] = types.MappingProxyType(
    {
        c.name: c
        for c in (MegatronUl(), HuggingFace(), HuggingFaceMixtral(), MegatronLM(), MegatronCore())
    }
)


def converter(name: str, flag: str) -> Converter:
    """The converter `flag name` names (--from / --to)."""
    try:
        return CONVERTERS[name]
    except KeyError:
        raise CheckpointError(f"{flag} {name!r}: choose one of {', '.join(CONVERTERS)}") from None
