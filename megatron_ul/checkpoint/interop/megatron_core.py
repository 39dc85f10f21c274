"""megatron-core GPTModel checkpoints (what Megatron-LM trains today) <-> megatron_ul checkpoints.

Two formats, as Megatron-LM's megatron/training/checkpointing.py writes them:

  --ckpt-format torch       DIR/iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt
      {"args", "checkpoint_version": 3.0, "iteration", "model": GPTModel.state_dict() of the
       stage (or "model0", "model1", ... with virtual stages), ...}; layers numbered locally.
  --ckpt-format torch_dist  DIR/iter_N/{metadata.json, common.pt, .metadata, *.distcp}
      megatron-core's dist_checkpointing on torch.distributed.checkpoint: args and the other
      plain objects in common.pt, each tensor stored once as a layout-free global tensor under
      its sharded key; a layer's tensors stacked on a leading [num_layers] axis.

Names (per layer; the layer-norm names depend on the layer spec: Transformer Engine's fuses the
norm into the next linear, the local spec has its own norm modules; torch_dist always uses the
fused names):

    ours                      local spec            transformer_engine spec / torch_dist
    layers.i.input_norm       input_layernorm       self_attention.linear_qkv.layer_norm_*
    layers.i.attention.qkv    self_attention.linear_qkv
    layers.i.attention.proj   self_attention.linear_proj
    layers.i.post_attention_norm  pre_mlp_layernorm  mlp.linear_fc1.layer_norm_*
    layers.i.mlp.fc1 / fc2    mlp.linear_fc1 / mlp.linear_fc2
    word_embeddings, position_embeddings   embedding.word_embeddings, embedding.position_embeddings
    final_norm                decoder.final_layernorm
    output_layer              output_layer (untied; with tied embeddings and PP > 1 the last
                              stage's output_layer.weight is its copy of the word embeddings)

Tensor layouts are the legacy model's and ours (checkpoint/interop/megatron_lm.py): linear_qkv rows
per TP rank are [local query groups, q_per_group + 2, head_dim], SwiGLU's linear_fc1 is
[gate_r; up_r] per TP rank; torch_dist's global tensors are the TP-merged ones (linear_fc1 as
[gate; up] of the whole width), which is our TP1 layout. The vocabulary rule is the legacy one
(the softmax includes the padded rows; import keeps the real ones).

Only weights travel, both ways: Megatron's optimizer state (its distributed optimizer's
parameter-space shards), RNG state and scheduler are not converted (see WEIGHTS_ONLY).
Reading needs no megatron package and runs no code from the files; writing torch_dist builds
megatron-core's own GPTModel (local spec, CPU) and saves it with its dist_checkpointing, so it
needs megatron-core installed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shutil
import tempfile
from dataclasses import asdict

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from ...config import ModelConfig
from .. import files
from ..files import CheckpointError
from ..full import FullCheckpoint
from ..layout import reshard
from ..safe_pickle import restricted_load
from ..storage import dcp_pieces
from ..storage.dcp_pieces import DCP_METADATA, DCP_METADATA_GLOBALS
from . import megatron_common, megatron_pickle
from .base import Check, Options, Source, Written, convert
from .ours import MegatronUl
from .settings import check_carried

SPECS = ("transformer_engine", "local")
FORMATS = ("torch", "torch_dist")
WEIGHTS_ONLY = (
    "only the model weights are converted; optimizer state, RNG state and the "
    "learning-rate schedule are not (train on with --finetune, or load with "
    "--no-load-optim --no-load-rng)"
)
_LINEARS = [
    ("attention.qkv", "self_attention.linear_qkv"),
    ("attention.proj", "self_attention.linear_proj"),
    ("mlp.fc1", "mlp.linear_fc1"),
    ("mlp.fc2", "mlp.linear_fc2"),
]
_TOP = {
    "word_embeddings.weight": "embedding.word_embeddings.weight",
    "position_embeddings.weight": "embedding.position_embeddings.weight",
    "final_norm.weight": "decoder.final_layernorm.weight",
    "final_norm.bias": "decoder.final_layernorm.bias",
    "output_layer.weight": "output_layer.weight",
}
_TIED_COPY = "replica.word_embeddings.weight"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_DIST_LAYERS = "decoder.layers."


def layer_names(spec: str) -> dict[str, str]:
    """{our per-layer tensor name: megatron-core's} for layer spec `spec`."""
    fused = spec == "transformer_engine"
    names = {}
    for kind in ("weight", "bias"):
        names[f"input_norm.{kind}"] = (
            f"self_attention.linear_qkv.layer_norm_{kind}" if fused else f"input_layernorm.{kind}"
        )
        names[f"post_attention_norm.{kind}"] = (
            f"mlp.linear_fc1.layer_norm_{kind}" if fused else f"pre_mlp_layernorm.{kind}"
        )
        names.update({f"{ours}.{kind}": f"{theirs}.{kind}" for ours, theirs in _LINEARS})
    return names


def _extra_state_modules(spec: str) -> list[str]:
    """The per-layer modules whose (empty) _extra_state a strict load_state_dict expects."""
    linears = [theirs for _, theirs in _LINEARS]
    return linears + (["self_attention.core_attention"] if spec == "transformer_engine" else [])


_OURS = {theirs: ours for spec in SPECS for ours, theirs in layer_names(spec).items()}


# ---- reading -------------------------------------------------------------------------------------
def _our_layer_name(theirs: str, where: str) -> str:
    ours = _OURS.get(theirs)
    if ours is None:
        raise CheckpointError(
            f"{where}: unknown megatron-core layer tensor {theirs!r} (a "
            f"feature megatron_ul does not implement?)"
        )
    return ours


def _our_top_name(key: str, tied_copy: bool, where: str) -> str:
    if key == "output_layer.weight" and tied_copy:
        return _TIED_COPY
    for ours, theirs in _TOP.items():
        if key == theirs:
            return ours
    raise CheckpointError(f"{where}: unknown megatron-core tensor {key!r}")


def _stage_tensors(state: dict, args, pp_rank: int, chunk: int, path: str) -> dict:
    """{our global name: tensor} of one model chunk of a torch-format stage file."""
    numbers = megatron_common.stage_layer_numbers(args, pp_rank, chunk)
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    out = {}
    for key, tensor in state.items():
        if key.endswith("_extra_state") or not isinstance(tensor, torch.Tensor):
            continue
        match = _LAYER.match(key)
        if match:
            local, rest = int(match.group(1)), match.group(2)
            if local >= len(numbers):
                raise CheckpointError(f"{path}: {key} is past this stage's {len(numbers)} layers")
            out[f"layers.{numbers[local] - 1}.{_our_layer_name(rest, path)}"] = tensor
        else:
            out[_our_top_name(key, tied, path)] = tensor
    return out


def _config(args, true_vocab_size: int | None) -> dict:
    return megatron_common.model_config_from_args(args, true_vocab_size, core=True)


def read_core_torch(
    load_dir: str,
    iteration: int | None = None,
    true_vocab_size: int | None = None,
    trust_pickle: bool = False,
    check: Check = lambda source: None,
) -> FullCheckpoint:
    """A megatron-core --ckpt-format torch checkpoint merged to TP1/PP1 (weights only)."""
    return megatron_common.read_stage_files(
        load_dir,
        iteration,
        trust_pickle,
        lambda args: _config(args, true_vocab_size),
        _stage_tensors,
        "megatron-core torch checkpoint",
        check,
    )


# megatron-core's DCP index also caches its save plan (in dataclasses and an enum of DCP's).
_PLANNER = "torch.distributed.checkpoint.planner"
CORE_DCP_GLOBALS = DCP_METADATA_GLOBALS | {
    (_PLANNER, name) for name in ("SavePlan", "WriteItem", "TensorWriteData", "WriteItemType")
}


class _ForeignDcpReader(FileSystemReader):
    """DCP's reader for a checkpoint megatron-core wrote: its index unpickled admitting only
    DCP's own metadata types (torch's reader would run whatever the file names); only tensors
    are ever requested, which DCP reads with torch.load(weights_only=True)."""

    def __init__(self, path: str):
        super().__init__(path)
        index_path = os.path.join(path, DCP_METADATA)
        if not os.path.isfile(index_path):
            raise CheckpointError(f"{index_path}: missing; not a torch_dist checkpoint")
        with open(index_path, "rb") as f:
            self._index = restricted_load(f, CORE_DCP_GLOBALS, index_path)
        if not isinstance(self._index, Metadata):
            raise CheckpointError(f"{index_path}: not DCP's index of the stored pieces")

    def read_metadata(self, *args, **options) -> Metadata:
        if getattr(self._index, "storage_meta", None) is None:
            self._index.storage_meta = StorageMeta()
        self._index.storage_meta.load_id = self.load_id
        return self._index


# megatron-core up to 0.16 writes the plain objects to common.pt; later releases store them as
# one pickled object inside the DCP checkpoint, under this key.
_COMMON_FILE, _COMMON_KEY = "common.pt", "common_state/shard_0_1"


def _common_state(iter_dir: str, index: Metadata, trust_pickle: bool) -> dict:
    """The checkpoint's common (non-sharded) state: args, iteration, ..."""
    legacy = os.path.join(iter_dir, _COMMON_FILE)
    if os.path.isfile(legacy):
        return megatron_pickle.load(legacy, trust_pickle)
    where = [(k, info) for k, info in (index.storage_data or {}).items() if k.fqn == _COMMON_KEY]
    if not where:
        raise CheckpointError(
            f"{iter_dir}: neither {_COMMON_FILE} nor a stored "
            f"{_COMMON_KEY!r}; not a megatron-core torch_dist checkpoint"
        )
    info = where[0][1]
    path = os.path.join(iter_dir, info.relative_path)
    try:
        with open(path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from e
    if len(data) != info.length:
        raise CheckpointError(
            f"{path}: truncated ({info.length} bytes at {info.offset} expected, "
            f"{len(data)} there); the checkpoint is incomplete"
        )
    state = megatron_pickle.load_stream(io.BytesIO(data), f"{path} ({_COMMON_KEY})", trust_pickle)
    return state[0] if isinstance(state, (list, tuple)) else state


def _dist_wanted(index: Metadata, args, where: str) -> dict[str, tuple[str, int | None]]:
    """{stored key: (our name or layer-name template, stacked layers)} of the model tensors;
    optimizer, RNG and _extra_state entries are left out."""
    wanted: dict[str, tuple[str, int | None]] = {}
    for key, md in index.state_dict_metadata.items():
        if (
            not isinstance(md, TensorStorageMetadata)
            or key.endswith("_extra_state")
            or key.startswith(("optimizer.", "rng_state", "common_state"))
        ):
            continue
        if key.startswith(_DIST_LAYERS):
            rest = key[len(_DIST_LAYERS) :]
            if md.size[0] != args.num_layers:
                raise CheckpointError(
                    f"{where}: {key} stacks {md.size[0]} layers, the args say {args.num_layers}"
                )
            wanted[key] = (_our_layer_name(rest, where), args.num_layers)
        else:
            wanted[key] = (_our_top_name(key, False, where), None)
    return wanted


def read_core_dist(
    load_dir: str,
    iteration: int | None = None,
    true_vocab_size: int | None = None,
    trust_pickle: bool = False,
    check: Check = lambda source: None,
) -> FullCheckpoint:
    """A megatron-core --ckpt-format torch_dist checkpoint at TP1/PP1 (weights only), read
    with torch's DCP (no megatron package needed)."""
    iter_dir, iteration = megatron_common.megatron_iteration_dir(load_dir, iteration)
    backend = files.read_json(
        os.path.join(iter_dir, "metadata.json"), "megatron-core checkpoint metadata"
    )
    if backend.get("sharded_backend") != "torch_dist":
        raise CheckpointError(
            f"{iter_dir}/metadata.json: sharded_backend "
            f"{backend.get('sharded_backend')!r}; only torch_dist is read"
        )
    reader = _ForeignDcpReader(iter_dir)
    args = _common_state(iter_dir, reader.read_metadata(), trust_pickle).get("args")
    if args is None:
        raise CheckpointError(
            f"{iter_dir}: its common state holds no 'args'; cannot tell the model"
        )
    model_cfg = asdict(ModelConfig(**_config(args, true_vocab_size)))
    check(Source(model_cfg, iteration, {"tp": 1, "pp": 1}))
    wanted = _dist_wanted(reader.read_metadata(), args, iter_dir)
    index = reader.read_metadata().state_dict_metadata
    loaded = {}
    for k in wanted:
        meta = index[k]
        if not isinstance(meta, TensorStorageMetadata):
            raise CheckpointError(f"{iter_dir}: {k} is stored as bytes, not as a tensor")
        loaded[k] = torch.empty(meta.size, dtype=meta.properties.dtype)
    try:
        dcp.load(loaded, storage_reader=reader, no_dist=True)
    # DCP's CheckpointException derives from BaseException; its text is every traceback.
    except (Exception, CheckpointException) as e:
        raise CheckpointError(
            f"{iter_dir}: the stored tensors cannot be read ({dcp_pieces.causes(e)}); the "
            f"checkpoint's .distcp files are damaged or incomplete"
        ) from e
    shards: dict[str, list] = {}
    for key, (ours, layers) in wanted.items():
        if layers is None:
            shards[ours] = [loaded[key]]
        else:
            for i in range(layers):
                shards[f"layers.{i}.{ours}"] = [loaded[key][i]]
    table = reshard.layout_table({"model": model_cfg}, 1, 1, None)
    params = megatron_common.merge_shards(shards, table, model_cfg["vocab_size"], iter_dir)
    return megatron_common.full_checkpoint(
        params, model_cfg, args, iteration, f"megatron-core torch_dist checkpoint {iter_dir}"
    )


def checkpoint_format(load_dir: str, iteration: int | None = None) -> str:
    """'torch_dist' or 'torch': which one the iteration directory holds."""
    iter_dir, _ = megatron_common.megatron_iteration_dir(load_dir, iteration)
    if os.path.isfile(os.path.join(iter_dir, "metadata.json")):
        return "torch_dist"
    if os.path.isdir(iter_dir):
        return "torch"
    raise CheckpointError(f"{iter_dir}: missing; the tracker names an iteration that is not there")


def import_core(load_dir: str, save_dir: str, **options) -> str:
    """Write a megatron-core GPTModel checkpoint (either format) as a megatron_ul checkpoint,
    weights only; `options` are Options fields (tp, pp, vp, iteration, true_vocab_size,
    trust_pickle)."""
    return convert(MegatronCore(), MegatronUl(), load_dir, save_dir, Options(**options)).path


# ---- writing -------------------------------------------------------------------------------------
def check_exportable(m: dict) -> None:
    """Refuse, before anything is written, a model megatron-core would compute otherwise."""
    check_carried(m, "megatron_core", "a megatron-core GPTModel checkpoint")
    megatron_common.check_norm_exportable(m)
    if not m["swiglu"] and m["gelu_approximate"] == "tanh" and not m["add_bias_linear"]:
        raise CheckpointError(
            "the model uses --gelu-approximate tanh without biases (--disable-bias-linear); "
            "megatron-core computes the tanh GELU only in its fused bias-GELU kernel, which "
            "needs biases (its --openai-gelu is never read), so it would compute erf GELU"
        )
    if m["position_embedding_type"] == "rope" and m["rotary_base"] != int(m["rotary_base"]):
        raise CheckpointError(
            f"the model uses --rotary-base {m['rotary_base']:g}; Megatron-LM's "
            f"--rotary-base takes an integer"
        )


def core_state(tensors: dict, m: dict, pp: int, pp_rank: int, spec: str) -> dict:
    """One stage's GPTModel.state_dict() (layer spec `spec`) from its {our name: TP shard}."""
    args = argparse.Namespace(num_layers=m["num_layers"], pipeline_model_parallel_size=pp)
    local = {n - 1: i for i, n in enumerate(megatron_common.stage_layer_numbers(args, pp_rank, 0))}
    names, state = layer_names(spec), {}
    for name, tensor in tensors.items():
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            state[f"decoder.layers.{local[int(index)]}.{names[rest]}"] = tensor
        else:
            state["output_layer.weight" if name == _TIED_COPY else _TOP[name]] = tensor
    for i in local.values():
        state.update(
            {
                f"decoder.layers.{i}.{module}._extra_state": None
                for module in _extra_state_modules(spec)
            }
        )
    if pp_rank == pp - 1:
        state["output_layer._extra_state"] = None
    return state


class MegatronCore:
    name = "megatron_core"
    help = (
        "a megatron-core GPTModel checkpoint (Megatron-LM's today): torch stage files or torch_dist"
    )
    notes: tuple[str, ...] = (WEIGHTS_ONLY,)

    def read(self, load_dir: str, opts: Options, check: Check) -> FullCheckpoint:
        """Either format (told apart by the iteration directory), merged to TP1/PP1."""
        dist = checkpoint_format(load_dir, opts.iteration) == "torch_dist"
        read = read_core_dist if dist else read_core_torch
        return read(load_dir, opts.iteration, opts.true_vocab_size, opts.trust_pickle, check)

    def check(self, source: Source, save_dir: str, opts: Options) -> None:
        ckpt_format, spec = self._format(opts)
        if ckpt_format == "torch_dist":
            if opts.tp or opts.pp:
                raise CheckpointError(
                    "--ckpt-format torch_dist is layout-free (Megatron reshards it on load); "
                    "--target-*-parallel-size applies to --ckpt-format torch"
                )
            core_modules()  # refuse before reading anything when megatron-core is missing
        megatron_common.check_export_target(source, save_dir, *self._layout(source, opts))
        check_exportable(source.model)

    def write(self, full: FullCheckpoint, save_dir: str, opts: Options) -> Written:
        """torch stage files for TP × PP (default: the source's layout) with the layer names
        of --transformer-impl, or torch_dist (layout-free; needs megatron-core installed)."""
        ckpt_format, spec = self._format(opts)
        iteration, m = full.common["iteration"], full.metadata["model"]
        source = Source(m, iteration, full.metadata["layout"])
        tp, pp = self._layout(source, opts)
        args = megatron_common.megatron_args(
            m, tp, pp, iteration, full.common, core=(ckpt_format, spec)
        )
        final = megatron_common.export_dir(save_dir, iteration)
        if ckpt_format == "torch":
            megatron_common.write_stage_files(
                full, args, final, lambda t, m_, pp_, s: core_state(t, m_, pp_, s, spec)
            )
        else:
            _write_dist(full, args, final)
        flags = [str(x) for x in megatron_common.megatron_flags(args)]
        notes = [dist_layout()] if ckpt_format == "torch_dist" else []
        return Written(final, flags, "Megatron-LM flags", notes + null_tokenizer_note(flags))

    def _layout(self, source: Source, opts: Options) -> tuple[int, int]:
        if self._format(opts)[0] == "torch_dist":
            return 1, 1  # layout-free: TP1/PP1 on disk
        return megatron_common.export_layout(source, opts)

    @staticmethod
    def _format(opts: Options) -> tuple[str, str]:
        ckpt_format = opts.ckpt_format or "torch_dist"
        spec = opts.transformer_impl or "transformer_engine"
        if ckpt_format not in FORMATS or spec not in SPECS:
            raise CheckpointError(
                f"--ckpt-format must be one of {FORMATS} and --transformer-impl one of {SPECS}"
            )
        return ckpt_format, spec


def export_core(
    load_dir: str,
    save_dir: str,
    ckpt_format: str = "torch_dist",
    spec: str = "transformer_engine",
    tp: int | None = None,
    pp: int | None = None,
) -> tuple[str, list[str]]:
    """Write the latest iteration of a megatron_ul checkpoint as a megatron-core GPTModel
    checkpoint, weights only (see MegatronCore.write; torch_dist ignores `tp` and `pp`).
    Returns (the iteration directory, the Megatron-LM flags that load it)."""
    if ckpt_format == "torch_dist":
        tp = pp = None
    opts = Options(tp=tp, pp=pp, ckpt_format=ckpt_format, transformer_impl=spec)
    out = convert(MegatronUl(), MegatronCore(), load_dir, save_dir, opts)
    return out.path, out.flags


# ---- megatron-core itself (torch_dist writing, and the tests' reference) ----------------------
def core_modules():
    """megatron-core's modules the torch_dist writer needs; CheckpointError without it."""
    try:
        import megatron.core  # noqa: F401
        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as e:
        raise CheckpointError(
            f"writing --ckpt-format torch_dist needs megatron-core (pip install --no-deps "
            f"megatron-core psutil; releases from 0.17 also import triton; {e}); "
            f"--ckpt-format torch needs nothing extra"
        ) from e
    return argparse.Namespace(
        dist_checkpointing=dist_checkpointing,
        parallel_state=parallel_state,
        GPTModel=GPTModel,
        local_spec=get_gpt_layer_local_spec,
        TransformerConfig=TransformerConfig,
    )


def core_model(m: dict, tp: int = 1, pre_process: bool = True, post_process: bool = True):
    """megatron-core's GPTModel (local spec, CPU, fp32, no dropout) for our model `m`, built
    from the args our exporter writes for it (core_model_from_args); needs model parallel
    initialised."""
    args = megatron_common.megatron_args(m, tp, 1, 0, {}, core=("torch_dist", "local"))
    return core_model_from_args(args, pre_process, post_process)


def core_model_from_args(args, pre_process: bool = True, post_process: bool = True):
    """megatron-core's GPTModel (local spec, CPU, fp32, no dropout) as Megatron-LM builds it
    from a checkpoint's `args` (megatron/training/arguments.py core_transformer_config_from_args
    and gpt_builders.py): the activation is F.gelu unless --swiglu, and the MLP computes the
    tanh GELU only through bias_activation_fusion (= args.bias_gelu_fusion) with biases;
    --openai-gelu is never read. Fusions that compute the same function unfused are off."""
    core = core_modules()
    swiglu = bool(getattr(args, "swiglu", False))
    window = getattr(args, "window_size", None)
    config = core.TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=(
            args.num_query_groups if args.group_query_attention else args.num_attention_heads
        ),
        kv_channels=args.kv_channels,
        ffn_hidden_size=args.ffn_hidden_size,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=swiglu,
        activation_func=torch.nn.functional.silu if swiglu else torch.nn.functional.gelu,
        bias_activation_fusion=(False if swiglu else bool(getattr(args, "bias_gelu_fusion", True))),
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=getattr(args, "add_qkv_bias", args.add_bias_linear),
        window_size=tuple(window) if window else None,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        pipeline_dtype=torch.float32,
        num_layers_in_first_pipeline_stage=getattr(args, "decoder_first_pipeline_num_layers", None),
        num_layers_in_last_pipeline_stage=getattr(args, "decoder_last_pipeline_num_layers", None),
        use_cpu_initialization=True,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    return core.GPTModel(
        config,
        core.local_spec(normalization=args.normalization),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=int(args.rotary_base),
    )


def _write_dist(full: FullCheckpoint, args: argparse.Namespace, final: str) -> None:
    """torch_dist through megatron-core: our TP1 weights loaded (strictly) into its GPTModel,
    saved with its dist_checkpointing (in a one-process gloo group when none is running)."""
    core = core_modules()
    m = full.metadata["model"]
    table = reshard.layout_table(full.metadata, 1, 1, None)
    tensors, _ = reshard.shard_for(full, table, list(table), 0, 1)
    with _one_process_model_parallel(core):
        model = core_model(m)
        model.load_state_dict(core_state(tensors, m, 1, 0, "local"), strict=True)
        state = {
            "args": args,
            "checkpoint_version": 3.0,
            "iteration": args.iteration,
            "model": model.sharded_state_dict(),
        }
        tmp = f"{final}.tmp-export"
        with megatron_common.removed_on_failure(os.path.dirname(final)):
            os.makedirs(tmp)
            try:
                with _cpu_only_shims():
                    core.dist_checkpointing.save(state, tmp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    os.rename(tmp, final)
    files.write_tracker(os.path.dirname(final), args.iteration)


@contextlib.contextmanager
def _cpu_only_shims():
    """megatron-core's torch_dist writer assumes CUDA in two places that do no arithmetic on
    the checkpoint: it synchronizes CUDA after copying tensors to the host (on a machine
    without CUDA every tensor is already there) and all-reduces a failure flag in a tensor on
    torch.cuda.current_device() (here the CPU, which the gloo group reduces)."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *a, **k: None
    # patched on purpose: megatron-core asks for a CUDA device index; the CPU stands in
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved


def null_tokenizer_note(flags: list[str]) -> list[str]:
    """The --vocab-size Megatron-LM 0.18+ needs: its NullTokenizer counts EOD among the
    --vocab-size ids, where 0.17 and earlier add it (the printed flags are for those)."""
    if "NullTokenizer" not in flags:
        return []
    size = int(flags[flags.index("--vocab-size") + 1])
    return [
        f"the flags give NullTokenizer --vocab-size {size} as Megatron-LM up to 0.17 counts "
        f"it (EOD = {size} added); Megatron-LM 0.18 and later need --vocab-size {size + 1}"
    ]


def dist_layout() -> str:
    """Which torch_dist layout the installed megatron-core writes, and which Megatron-LM
    releases read it (megatron/core/dist_checkpointing: up to 0.18 the plain objects go to
    common.pt; 0.19 stores them inside the DCP checkpoint and still reads common.pt)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("megatron-core")
    except PackageNotFoundError:
        return "torch_dist layout of an unknown megatron-core release"
    major_minor = tuple(int(x) for x in re.findall(r"\d+", found)[:2])
    if major_minor >= (0, 19):
        return (
            f"torch_dist written by megatron-core {found}: the args and other plain objects "
            f"inside the DCP checkpoint (no common.pt); Megatron-LM 0.19 and later read it, "
            f"0.18 and earlier do not"
        )
    return (
        f"torch_dist written by megatron-core {found}: the args and other plain objects in "
        f"common.pt; Megatron-LM releases with torch_dist (0.19 included) read it"
    )


class _one_process_model_parallel:
    """megatron-core's model parallel state for TP1/PP1 in this process, on a gloo group of
    one made here (file store, no port) unless torch.distributed is already initialised."""

    def __init__(self, core):
        self.core, self.store_dir, self.made_state = core, None, False

    def __enter__(self):
        if self.core.parallel_state.model_parallel_is_initialized():
            return self  # a caller's megatron-core run: leave its state alone
        self.made_state = True
        if not torch.distributed.is_initialized():
            self.store_dir = tempfile.mkdtemp(prefix="megatron-core-export-")
            torch.distributed.init_process_group(
                "gloo",
                init_method=f"file://{os.path.join(self.store_dir, 'store')}",
                rank=0,
                world_size=1,
            )
        self.core.parallel_state.initialize_model_parallel(1, 1)
        return self

    def __exit__(self, *exc):
        if not self.made_state:
            return False
        self.core.parallel_state.destroy_model_parallel()
        if self.store_dir is not None:
            torch.distributed.destroy_process_group()
            shutil.rmtree(self.store_dir, ignore_errors=True)
        return False
