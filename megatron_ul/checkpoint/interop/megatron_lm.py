"""Legacy Megatron-LM / Megatron-DeepSpeed checkpoints <-> megatron_ul checkpoints.

The legacy format ("torch" checkpoints of Megatron-LM's legacy GPT model, checkpoint_version
3.0, also written by Megatron-DeepSpeed when DeepSpeed's engine is not used), as derived from
Megatron-LM's source (megatron/legacy/model/{gpt_model,language_model,transformer}.py,
megatron/training/checkpointing.py, tools/checkpoint/loader_legacy.py, before their removal):

    DIR/latest_checkpointed_iteration.txt          an iteration number, or "release"
    DIR/iter_0000100/mp_rank_TT[_PPP]/model_optim_rng.pt   (or DIR/release/...)
      {"args": argparse.Namespace, "checkpoint_version": 3.0, "iteration": N,
       "model": {...}  (or "model0", "model1", ... with virtual pipeline stages),
       "optimizer", "opt_param_scheduler", "rng_state" (not read, not written)}
    model = {"language_model": {
                 "embedding": {"word_embeddings": {"weight"},          (first stage)
                               "position_embeddings": {"weight"}},     (learned positions)
                 "encoder": {"layers.{local}.{name}": tensor, "final_norm.{weight,bias}"},
                 "output_layer": {"weight"}},                          (untied, last stage)
             "word_embeddings_for_head": {"weight"}}                   (tied, last stage, PP>1)

Layers are numbered locally per model chunk; global = the pipeline's own placement
(pipeline.model.chunk_layer_numbers: Megatron's offsets). Names per layer (Megatron-DeepSpeed
and older Megatron-LM spell the norms `*_layernorm`; both are read, Megatron-LM's are written):

    input_norm | input_layernorm                    -> layers.i.input_norm
    self_attention.query_key_value                  -> layers.i.attention.qkv
    self_attention.dense                            -> layers.i.attention.proj
    post_attention_norm | post_attention_layernorm  -> layers.i.post_attention_norm
    mlp.dense_h_to_4h                               -> layers.i.mlp.fc1
    mlp.dense_4h_to_h                               -> layers.i.mlp.fc2
    final_norm | final_layernorm                    -> final_norm

Tensor layouts are the same as ours, so tensors move unchanged once TP shards are merged by the
parameter table: the fused QKV rows are [query groups, q_per_group + 2, head_dim] per TP rank
(Megatron's `view(sq, b, ng, (np/ng + 2) * hn)` then split; for MHA that is [q, k, v] per head),
SwiGLU's dense_h_to_4h is [gate_r; up_r] per TP rank (our stride-2 fc1), the vocabulary is
padded to a multiple of make_vocab_size_divisible_by × TP in both. One difference: Megatron's
softmax includes the padded vocabulary rows and ours excludes them; importing keeps the real
rows (NullTokenizer: args.vocab_size + 1, its EOD included; else args.vocab_size when recorded),
else the padded size (so the imported model computes exactly what Megatron computed).
"""

from __future__ import annotations

import logging
import re

from ...pipeline.model import chunk_layer_numbers
from ..files import CheckpointError
from ..full import FullCheckpoint
from .base import Check, Options, Source, Written, convert
from .megatron_common import (
    LEGACY_ROTARY_BASE,
    check_export_target,
    check_norm_exportable,
    export_dir,
    export_layout,
    megatron_args,
    megatron_flags,
    model_config_from_args,
    read_stage_files,
    stage_layer_numbers,
    write_stage_files,
)
from .ours import MegatronUl
from .settings import check_carried

log = logging.getLogger("megatron_ul")

# (Megatron-LM's legacy name, our name); the first spelling of each is written on export.
LAYER_NAMES = [
    ("input_norm", "input_norm"),
    ("input_layernorm", "input_norm"),
    ("self_attention.query_key_value", "attention.qkv"),
    ("self_attention.dense", "attention.proj"),
    ("post_attention_norm", "post_attention_norm"),
    ("post_attention_layernorm", "post_attention_norm"),
    ("mlp.dense_h_to_4h", "mlp.fc1"),
    ("mlp.dense_4h_to_h", "mlp.fc2"),
]
FINAL_NORM = ("final_norm", "final_layernorm")
_LOCAL_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")


# ---- reading ---------------------------------------------------------------------------------


def _our_name(legacy: str) -> str | None:
    for theirs, ours in LAYER_NAMES:
        if legacy == theirs:
            return ours
    return None


def _stage_tensors(model: dict, args, pp_rank: int, chunk: int, path: str) -> dict:
    """{our global name: tensor} of one model chunk of a legacy stage file."""
    lm = model.get("language_model")
    if lm is None:
        raise CheckpointError(
            f"{path}: no 'language_model' in the model state; not a legacy "
            f"Megatron-LM GPT checkpoint (a megatron-core GPTModel's? python -m "
            f"tools.checkpoint.megatron_core import reads those)"
        )
    out = {}
    embedding = lm.get("embedding") or {}
    for key in ("word_embeddings", "position_embeddings"):
        if key in embedding:
            out[f"{key}.weight"] = embedding[key]["weight"]
    encoder = lm.get("encoder", lm.get("transformer")) or {}
    numbers = stage_layer_numbers(args, pp_rank, chunk)
    for key, tensor in encoder.items():
        if tensor is None or key.endswith("_extra_state"):
            continue
        match = _LOCAL_LAYER.match(key)
        if match:
            ours = _our_name(match.group(2))
            if ours is None:
                raise CheckpointError(f"{path}: unknown layer tensor {key!r}")
            local = int(match.group(1))
            out[f"layers.{numbers[local] - 1}.{ours}.{match.group(3)}"] = tensor
        elif key.split(".")[0] in FINAL_NORM:
            out["final_norm." + key.split(".")[-1]] = tensor
        else:
            raise CheckpointError(f"{path}: unknown encoder tensor {key!r}")
    if "output_layer" in lm:
        out["output_layer.weight"] = lm["output_layer"]["weight"]
    if "word_embeddings_for_head" in model:
        out["replica.word_embeddings.weight"] = model["word_embeddings_for_head"]["weight"]
    return out


# ---- writing -----------------------------------------------------------------------------------


def check_exportable(m: dict) -> None:
    """Refuse, before anything is written, a model Megatron-LM's legacy model would compute
    otherwise."""
    check_carried(m, "megatron_lm", "Megatron-LM's legacy GPT model")
    check_norm_exportable(m)
    if m["position_embedding_type"] == "rope" and m["rotary_base"] != LEGACY_ROTARY_BASE:
        raise CheckpointError(
            f"the model uses --rotary-base {m['rotary_base']:g}; Megatron-LM's legacy model "
            f"always computes RoPE with base {LEGACY_ROTARY_BASE}, so it would compute other "
            f"logits. Export it as a megatron-core checkpoint instead "
            f"(python -m tools.checkpoint.megatron_core export)"
        )


def _legacy_state(tensors: dict, m: dict, pp: int, pp_rank: int) -> dict:
    """Our names of one stage (TP-cut) -> the legacy nested state dict."""
    to_theirs = {ours: theirs for theirs, ours in reversed(LAYER_NAMES)}
    numbers = chunk_layer_numbers(m["num_layers"], pp, 1, pp_rank, 0)
    local = {n - 1: i for i, n in enumerate(numbers)}
    embedding, encoder, lm, model = {}, {}, {}, {}
    for name, tensor in tensors.items():
        if name.startswith("replica."):
            model["word_embeddings_for_head"] = {"weight": tensor}
        elif name.startswith(("word_embeddings.", "position_embeddings.")):
            embedding[name.split(".")[0]] = {"weight": tensor}
        elif name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            module, kind = rest.rsplit(".", 1)
            encoder[f"layers.{local[int(index)]}.{to_theirs[module]}.{kind}"] = tensor
        elif name.startswith("final_norm."):
            encoder[name] = tensor
        elif name == "output_layer.weight":
            lm["output_layer"] = {"weight": tensor}
        else:
            raise CheckpointError(f"no Megatron-LM name for parameter {name}")
    if embedding:
        lm["embedding"] = embedding
    lm["encoder"] = encoder
    model["language_model"] = lm
    return model


class MegatronLM:
    name = "megatron_lm"
    help = "a legacy Megatron-LM / Megatron-DeepSpeed GPT checkpoint (torch stage files)"
    notes: tuple[str, ...] = ()

    def read(self, load_dir: str, opts: Options, check: Check) -> FullCheckpoint:
        """Merged to TP1/PP1 in our names (weights only)."""
        return read_stage_files(
            load_dir,
            opts.iteration,
            opts.trust_pickle,
            lambda args: model_config_from_args(args, opts.true_vocab_size),
            _stage_tensors,
            "megatron-lm legacy checkpoint",
            check,
        )

    def check(self, source: Source, save_dir: str, opts: Options) -> None:
        check_export_target(source, save_dir, *export_layout(source, opts))
        check_exportable(source.model)

    def write(self, full: FullCheckpoint, save_dir: str, opts: Options) -> Written:
        """TP × PP stage files (default: the source's layout), weights only."""
        iteration, m = full.common["iteration"], full.metadata["model"]
        source = Source(m, iteration, full.metadata["layout"])
        tp, pp = export_layout(source, opts)
        args = megatron_args(m, tp, pp, iteration, full.common)
        final = export_dir(save_dir, iteration)
        write_stage_files(full, args, final, _legacy_state)
        return Written(final, [str(x) for x in megatron_flags(args)], "Megatron-LM flags")


def import_megatron(load_dir: str, save_dir: str, **options) -> str:
    """Write a legacy Megatron-LM checkpoint as a megatron_ul checkpoint (weights only; train
    on with --finetune, or --no-load-optim to keep the iteration); `options` are Options
    fields (tp, pp, vp, iteration, true_vocab_size, trust_pickle)."""
    return convert(MegatronLM(), MegatronUl(), load_dir, save_dir, Options(**options)).path


def export_megatron(
    load_dir: str, save_dir: str, tp: int | None = None, pp: int | None = None
) -> tuple[str, list[str]]:
    """Write the latest iteration of a megatron_ul checkpoint (any layout) as a legacy
    Megatron-LM checkpoint with TP × PP shards (default: the source's), weights only.
    Returns (the iteration directory, the Megatron-LM flags that load it)."""
    out = convert(MegatronUl(), MegatronLM(), load_dir, save_dir, Options(tp=tp, pp=pp))
    return out.path, out.flags
