"""The model chunks one pipeline rank holds, their global parameter names, and the tied
embedding's gradient all-reduce between the first and last stage.

Layer assignment follows Megatron: without interleaving, pp rank r holds the r-th contiguous
block of num_layers/PP layers; with --num-layers-per-virtual-pipeline-stage n, the model is cut
into PP·v blocks of n layers and virtual stage (model chunk) c on pp rank r holds block c·PP + r.
"""

from __future__ import annotations

import re
from typing import cast

from torch import nn

from ..config import ResolvedConfig, ResolvedModelConfig
from ..model.chunks import model_chunks
from ..model.gpt import GPTModel
from ..model.transformer import TransformerLayer
from ..mpu.parallel_state import ParallelDims
from ..mpu.param_spec import param_spec, set_param_spec
from ..timers import NO_TIMERS, Timers


def num_model_chunks(cfg: ResolvedConfig) -> int:
    """Virtual pipeline stages per pp rank (1 without interleaving)."""
    p = cfg.parallel
    return chunks_per_stage(
        cfg.model.num_layers,
        p.pipeline_model_parallel_size,
        p.num_layers_per_virtual_pipeline_stage,
    )


def chunks_per_stage(num_layers: int, pipeline_size: int, layers_per_chunk: int | None) -> int:
    """Model chunks per pp rank when chunks hold `layers_per_chunk` layers (None: one chunk);
    ValueError when the layers do not split that way (config_rules.validate says it with flags)."""
    if num_layers % pipeline_size != 0:
        raise ValueError(
            f"--num-layers {num_layers} is not divisible by the pipeline size {pipeline_size}"
        )
    if layers_per_chunk is None:
        return 1
    if pipeline_size == 1 or num_layers % (pipeline_size * layers_per_chunk) != 0:
        raise ValueError(
            f"--num-layers {num_layers} does not split into {pipeline_size} "
            f"pipeline stages of chunks of {layers_per_chunk} layers; the virtual "
            f"pipeline size needs PP > 1 and num_layers divisible by "
            f"PP x {layers_per_chunk}"
        )
    return num_layers // (pipeline_size * layers_per_chunk)


def chunk_layer_numbers(
    num_layers: int, pipeline_size: int, chunks: int, pp_rank: int, chunk: int
) -> list[int]:
    """1-based global layer numbers of model chunk `chunk` on pp rank `pp_rank`."""
    per_block = num_layers // (pipeline_size * chunks)
    block = chunk * pipeline_size + pp_rank
    return list(range(block * per_block + 1, (block + 1) * per_block + 1))


class PipelineStageModel(nn.Module):
    """The model chunks of one pp rank, in virtual-stage order; `chunks[c]` is a GPTModel."""

    def __init__(self, chunks: list[GPTModel]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.padded_vocab_size = chunks[0].padded_vocab_size
        self.dims = chunks[0].dims


def build_pipeline_model(
    cfg: ResolvedConfig, device, timers: Timers = NO_TIMERS, *, dims: ParallelDims
) -> PipelineStageModel:
    """This rank's model chunks."""
    return PipelineStageModel(
        build_stage_chunks(
            cfg.model,
            cfg.train.seed,
            cfg.parallel.sequence_parallel,
            dims.pp,
            dims.pp_rank,
            num_model_chunks(cfg),
            device,
            timers,
            dims=dims,
        )
    )


def build_stage_chunks(
    model_cfg: ResolvedModelConfig,
    seed: int,
    sequence_parallel: bool,
    pp: int,
    rank: int,
    chunks: int,
    device,
    timers: Timers = NO_TIMERS,
    *,
    dims: ParallelDims,
) -> list[GPTModel]:
    """The model chunks of pp rank `rank` (of `pp`, `chunks` chunks each) — the one rule that
    places layers, embeddings and heads on stages (pipeline/param_table.py reads it too). The
    tied output copy on the last stage is marked as a replica so the gradient norm counts the
    embedding once."""
    out = []
    for c in range(chunks):
        pre = rank == 0 and c == 0
        post = rank == pp - 1 and c == chunks - 1
        chunk = GPTModel(
            model_cfg,
            seed=seed,
            sequence_parallel=sequence_parallel,
            pre_process=pre,
            post_process=post,
            layer_numbers=chunk_layer_numbers(model_cfg.num_layers, pp, chunks, rank, c),
            device=device,
            timers=timers,
            dims=dims,
        )
        if post and not pre and hasattr(chunk, "word_embeddings"):
            set_param_spec(chunk.word_embeddings.weight, tied_replica=True)
        out.append(chunk)
    return out


_LAYER = re.compile(r"^layers\.(\d+)\.")
REPLICA_PREFIX = "replica."


def global_named_parameters(model: nn.Module):
    """(name, parameter) pairs with layout-independent names — the one naming scheme of
    equivalence tests, checkpoints, layout conversion and Hugging Face mappings.

    Chunk prefixes are dropped and `layers.{i}` is renumbered to the 0-based global layer
    index (layer_number - 1), so the names are exactly the PP=1 GPTModel's module names. The
    last stage's tied embedding replica is yielded as `replica.word_embeddings.weight`."""
    for _, name, p in chunk_named_parameters(model):
        yield name, p


def chunk_named_parameters(model: nn.Module):
    """(model chunk index, global name, parameter) triples; see global_named_parameters."""
    for index, chunk in enumerate(model_chunks(model)):
        for name, p in chunk.named_parameters():
            match = _LAYER.match(name)
            if match:
                layer = cast(TransformerLayer, cast(GPTModel, chunk).layers[int(match.group(1))])
                name = f"layers.{layer.layer_number - 1}." + name[match.end() :]
            if param_spec(p).tied_replica:
                name = REPLICA_PREFIX + name
            yield index, name, p


def replicated_name(name: str) -> str:
    """The parameter a global name holds a copy of (itself unless it is a tied replica)."""
    return name.removeprefix(REPLICA_PREFIX)


def stage_layer_indices(
    num_layers: int, pipeline_size: int, chunks: int, pp_rank: int
) -> list[int]:
    """0-based global indices (as in parameter names) of every layer pp rank `pp_rank` holds,
    over all its model chunks."""
    return [
        n - 1
        for c in range(chunks)
        for n in chunk_layer_numbers(num_layers, pipeline_size, chunks, pp_rank, c)
    ]
