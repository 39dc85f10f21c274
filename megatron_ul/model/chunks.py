"""A rank's model as a list of model chunks: one GPTModel, or under pipelining the GPTModels of
its (virtual) stages, held by pipeline.model.PipelineStageModel in `.chunks`.

Lives in model/ so that the optimizers (ZeRO-3 shards each chunk) and the schedules can ask for
the chunks without importing the pipeline package.
"""
from __future__ import annotations

from torch import nn


def model_chunks(model: nn.Module) -> list[nn.Module]:
    chunks = getattr(model, "chunks", None)
    return list(chunks) if isinstance(chunks, nn.ModuleList) else [model]


def model_dims(model: nn.Module):
    """The rank grid (ParallelDims) the model was built on: every chunk holds it."""
    return model_chunks(model)[0].dims
