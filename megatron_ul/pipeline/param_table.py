"""The parameter-metadata table: for every global parameter name of a model in a given layout,
its full shape, how TP splits it (partition dim and stride, fused row layout, padded vocabulary
rows: mpu/param_spec.py), which pipeline stage and model chunk hold it, and which parameter a
tied replica copies.

There is one source for these facts: the modules themselves. `parameter_table` builds the
model's stages on the meta device (no memory, no communication) with the same builder the
trainer uses (pipeline.model.build_stage_chunks) and reads the specs the layers attached;
`local_parameter_table` reads them from a live rank's model. Checkpoint metadata, resharding,
conversion, ZeRO state naming and the Hugging Face / Megatron-LM mappings consume this table
instead of guessing from names.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..config import ResolvedModelConfig
from ..mpu.parallel_state import single_rank_dims
from ..mpu.param_init import deferred
from ..mpu.param_spec import full_shape, param_spec
from .model import (
    REPLICA_PREFIX,
    PipelineStageModel,
    build_stage_chunks,
    chunk_named_parameters,
    chunks_per_stage,
    replicated_name,
)


def _entry(p: torch.Tensor, tp: int, stage: int, chunk: int, name: str) -> dict:
    return {
        "shape": full_shape(p, tp),
        **param_spec(p).to_json(),
        "stage": stage,
        "chunk": chunk,
        "replica_of": replicated_name(name) if name.startswith(REPLICA_PREFIX) else None,
    }


def local_parameter_table(model: nn.Module, tp: int, pp_rank: int) -> dict[str, dict]:
    """The table's entries for the parameters this rank holds (shapes merged over TP `tp`;
    ZeRO-3 DTensors report their global shape)."""
    return {
        name: _entry(p, tp, pp_rank, chunk, name)
        for chunk, name, p in chunk_named_parameters(model)
    }


def parameter_table(
    model_cfg: ResolvedModelConfig, tp: int = 1, pp: int = 1, layers_per_chunk: int | None = None
) -> dict[str, dict]:
    """The whole model's table for TP `tp` × PP `pp` (chunks of `layers_per_chunk` layers when
    interleaved). ValueError when the layers do not split into those stages."""
    chunks = chunks_per_stage(model_cfg.num_layers, pp, layers_per_chunk)
    cfg = replace(model_cfg, use_flash_attn=False)
    table = {}
    with torch.device("meta"), deferred():  # shapes and specs only: nothing is computed
        for stage in range(pp):
            built = build_stage_chunks(
                cfg, 0, False, pp, stage, chunks, device=None, dims=single_rank_dims()
            )
            for chunk, name, p in chunk_named_parameters(PipelineStageModel(built)):
                table[name] = _entry(p, 1, stage, chunk, name)
    for entry in table.values():  # built at TP1: pad the vocabulary for TP `tp`
        if entry["vocab_padded"]:
            entry["shape"][0] = model_cfg.padded_vocab_size(tp)
    return table


def stage_parameter_names(table: dict[str, dict], stage: int) -> list[str]:
    return [name for name, entry in table.items() if entry["stage"] == stage]
