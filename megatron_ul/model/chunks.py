"""A rank's model as a list of model chunks: one GPTModel, or under pipelining the GPTModels of
its (virtual) stages, held by pipeline.model.PipelineStageModel in `.chunks`.

Lives in model/ so that the optimizers (ZeRO-3 shards each chunk) and the schedules can ask for
the chunks without importing the pipeline package.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn


def model_chunks(model: nn.Module) -> list[nn.Module]:
    chunks = getattr(model, "chunks", None)
    return list(chunks) if isinstance(chunks, nn.ModuleList) else [model]


def tied_embedding_weights(model: nn.Module) -> list[nn.Parameter]:
    """Word-embedding weights this rank holds that are tied across the first and last stage
    (the optimizers defer their reduction until the stages have summed them)."""
    return [
        cast(nn.Parameter, cast(nn.Module, chunk.word_embeddings).weight)
        for chunk in model_chunks(model)
        if chunk.share_embeddings
        and hasattr(chunk, "word_embeddings")
        and (chunk.pre_process or chunk.post_process)
    ]


def model_dims(model: nn.Module):
    """The rank grid (ParallelDims) the model was built on: every chunk holds it."""
    return model_chunks(model)[0].dims


def activation_dtype(model: nn.Module) -> torch.dtype:
    """What the residual stream carries between layers and pipeline stages (GPTModel's
    activation_dtype: the parameters' dtype, or fp32 under --fp32-residual-connection)."""
    return cast(torch.dtype, model_chunks(model)[0].activation_dtype)
