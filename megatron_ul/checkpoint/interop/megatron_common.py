"""What Megatron-LM's legacy model and megatron-core's GPTModel checkpoints share: the tracker
and iteration directory, the args (read into our ModelConfig, written for a model of ours, and
the flags that load it), the torch-format stage files (iter_N/mp_rank_TT[_PPP]/
model_optim_rng.pt) read and merged by the parameter table or cut and written, the layer
placement of pipeline stages. The two formats' own names and tensors are in megatron_lm.py and
megatron_core.py."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from dataclasses import asdict
from typing import Any

import torch

from ...config import ModelConfig
from ...pipeline.model import chunk_layer_numbers
from .. import files
from ..files import CheckpointError
from ..full import FullCheckpoint
from ..group_progress import stage_file_size, tensor_groups
from ..layout import reshard
from . import megatron_pickle
from .base import Check, Options, Source, weights_only
from .settings import refuse_megatron_settings

log = logging.getLogger("megatron_ul")


_TIED_REPLICA = "replica.word_embeddings.weight"


# Megatron-LM's legacy model never passes --rotary-base to its RotaryEmbedding: it computes
# with this base whatever its args record.
LEGACY_ROTARY_BASE = 10000


def _load(path: str, trust_pickle: bool) -> dict:
    return megatron_pickle.load(path, trust_pickle)


def megatron_iteration_dir(load_dir: str, iteration: int | None) -> tuple[str, int]:
    if iteration is None:
        tracker = os.path.join(load_dir, files.TRACKER)
        if not os.path.isfile(tracker):
            raise CheckpointError(
                f"{tracker}: missing; --load-dir must be a Megatron-LM checkpoint directory"
            )
        with open(tracker, "rb") as f:
            text = f.read(100).decode(errors="replace").strip()
        if text == "release":
            return os.path.join(load_dir, "release"), 0
        if not text.isascii() or not text.isdigit():
            raise CheckpointError(
                f"{tracker}: expected an iteration or 'release', found {text[:40]!r}"
            )
        iteration = int(text)
    return os.path.join(load_dir, files.iteration_dir_name(iteration)), iteration


def model_config_from_args(args, true_vocab_size: int | None = None, core: bool = False) -> dict:
    """Our ModelConfig fields for the args of a legacy Megatron-LM GPT (of a megatron-core
    GPTModel with `core`); refuses what we do not compute the same way."""

    def get(name: str, default: Any = None) -> Any:  # Megatron's args: fields vary by version
        return getattr(args, name, default)

    refuse_megatron_settings(args, "megatron-core checkpoint" if core else "Megatron-LM checkpoint")
    unsupported = [
        (get("add_qkv_bias") and not get("add_bias_linear", True), "--add-qkv-bias"),
        (
            not core
            and get("transformer_impl", "local") not in ("local", None)
            and not get("use_legacy_models", True),
            "a megatron-core GPTModel (import it with python -m "
            "tools.checkpoint.megatron_core import)",
        ),
    ]
    if core:
        unsupported += _core_unsupported(get)
    refused = [what for flag, what in unsupported if flag]
    if refused:
        raise CheckpointError(
            f"the Megatron-LM checkpoint uses {', '.join(refused)}, which "
            f"megatron_ul does not implement"
        )
    heads, hidden = args.num_attention_heads, args.hidden_size
    kv = get("kv_channels")
    vocab = true_vocab_size or megatron_vocab_size(args)
    swiglu, bias = bool(get("swiglu")), get("add_bias_linear", True)
    # Megatron's GELU is tanh-approximated in its fused bias-gelu kernel (used only with
    # biases); the legacy model also with --openai-gelu, which megatron-core never reads
    fused = bias and get("bias_gelu_fusion", True)
    tanh = not swiglu and (fused or (not core and get("openai_gelu")))
    rope = get("position_embedding_type") == "rope" or get("use_rotary_position_embeddings")
    return {
        "num_layers": args.num_layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "ffn_hidden_size": get("ffn_hidden_size"),
        "num_query_groups": (get("num_query_groups") if get("group_query_attention") else None),
        "kv_channels": kv if kv and kv * heads != hidden else None,
        "seq_length": args.seq_length,
        "max_position_embeddings": get("max_position_embeddings") or args.seq_length,
        "vocab_size": vocab,
        "make_vocab_size_divisible_by": get("make_vocab_size_divisible_by", 128),
        "position_embedding_type": "rope" if rope else "learned_absolute",
        "rotary_base": float(
            (get("rotary_base", 10000) if core else _legacy_rotary_base(args)) if rope else 10000
        ),
        "normalization": get("normalization", "LayerNorm"),
        "norm_epsilon": get("norm_epsilon", get("layernorm_epsilon", 1e-5)),
        "swiglu": swiglu,
        "add_bias_linear": bias,
        "untie_embeddings_and_output_weights": bool(get("untie_embeddings_and_output_weights")),
        "gelu_approximate": "tanh" if tanh else "none",
        "window_size": _window(args, core),
    }


def _window(args, core: bool) -> list[int] | None:
    """--window-size LEFT,RIGHT of a megatron-core model; the legacy model never reads it
    (it computes full attention whatever the args record)."""
    window = getattr(args, "window_size", None)
    if not window or window[0] < 0:
        return None
    if not core:
        log.warning(
            "the Megatron-LM checkpoint records --window-size %s, which its legacy model "
            "ignores (it computes full attention); importing with full attention",
            tuple(window),
        )
        return None
    if window[1] != 0:
        raise CheckpointError(
            f"the megatron-core checkpoint uses --window-size {tuple(window)}: a window "
            f"reaching {window[1]} tokens ahead; megatron_ul computes causal windows only "
            f"(RIGHT 0)"
        )
    return [int(window[0]), 0]


def _core_unsupported(get) -> list[tuple]:
    """megatron-core GPTModel features this model does not compute (besides the table of
    interop_settings)."""
    return [
        (
            get("position_embedding_type", "learned_absolute") not in ("rope", "learned_absolute"),
            f"--position-embedding-type {get('position_embedding_type')}",
        ),
    ]


def megatron_vocab_size(args) -> int:
    """The rows of the softmax that are real tokens. Megatron-LM's NullTokenizer up to 0.17
    has --vocab-size V ids plus EOD = V (V + 1 rows); from 0.18 it has V rows, EOD = V - 1 (or
    --null-tokenizer-eod-id), and those releases record args.null_tokenizer_eod_id. Other
    tokenizers leave args.vocab_size unset, so the padded size (all of which Megatron's
    softmax includes)."""
    if getattr(args, "tokenizer_type", None) == "NullTokenizer" and args.vocab_size:
        return args.vocab_size + (0 if hasattr(args, NULL_TOKENIZER_EOD_ARG) else 1)
    return getattr(args, "vocab_size", None) or args.padded_vocab_size


# Recorded by Megatron-LM from 0.18 on, whose NullTokenizer has --vocab-size rows in all.
NULL_TOKENIZER_EOD_ARG = "null_tokenizer_eod_id"


def _legacy_rotary_base(args) -> int:
    recorded = getattr(args, "rotary_base", LEGACY_ROTARY_BASE) or LEGACY_ROTARY_BASE
    if recorded != LEGACY_ROTARY_BASE:
        log.warning(
            "the Megatron-LM checkpoint records --rotary-base %s, which its legacy model "
            "ignores (it computes with %d); importing with %d, as Megatron computed",
            recorded,
            LEGACY_ROTARY_BASE,
            LEGACY_ROTARY_BASE,
        )
    return LEGACY_ROTARY_BASE


def stage_layer_numbers(args, pp_rank: int, chunk: int) -> list[int]:
    """1-based global numbers of the layers of model chunk `chunk` of pipeline rank `pp_rank`
    in a Megatron-LM run with `args`: Megatron's even split, interleaved by chunk, or its
    uneven one (--decoder-first/last-pipeline-num-layers: those stages hold that many layers,
    the others split the rest evenly; megatron-core's get_transformer_layer_offset)."""
    chunks = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    pp = args.pipeline_model_parallel_size
    first, last = uneven_split(args)
    if pp == 1 or (first is None and last is None):
        return chunk_layer_numbers(args.num_layers, pp, chunks, pp_rank, chunk)
    if chunks > 1:
        raise CheckpointError(
            "the checkpoint splits its layers unevenly (--decoder-first/last-pipeline-num-"
            "layers) over virtual pipeline stages; only the uneven split without virtual "
            "stages is read (or save it with --ckpt-format torch_dist)"
        )
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = args.num_layers - (first or 0) - (last or 0)
    per = middle_layers // middle_stages if middle_stages else 0
    if (
        middle_layers < 0
        or (middle_stages and middle_layers % middle_stages)
        or (not middle_stages and middle_layers)
    ):
        raise CheckpointError(
            f"the checkpoint's args split {args.num_layers} layers over {pp} stages with "
            f"{first} in the first and {last} in the last; the rest does not divide evenly"
        )
    if pp_rank == 0 and first is not None:
        return list(range(1, first + 1))
    if pp_rank == pp - 1 and last is not None:
        return list(range(args.num_layers - last + 1, args.num_layers + 1))
    start = (first or 0) + (pp_rank - (first is not None)) * per
    return list(range(start + 1, start + per + 1))


def uneven_split(args) -> tuple[int | None, int | None]:
    """(layers of the first stage, of the last stage) when Megatron split them unevenly."""
    return (
        getattr(args, "decoder_first_pipeline_num_layers", None),
        getattr(args, "decoder_last_pipeline_num_layers", None),
    )


def read_stage_files(
    load_dir: str,
    iteration: int | None,
    trust_pickle: bool,
    config_from_args,
    stage_tensors,
    source: str,
    check: Check = lambda source: None,
) -> FullCheckpoint:
    """A Megatron-LM torch-format checkpoint (iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt)
    merged to TP1/PP1: `config_from_args(args)` gives our ModelConfig fields, and
    `stage_tensors(model_state, args, pp_rank, chunk, path)` one model chunk's
    {our global name: TP shard}."""
    iter_dir, iteration = megatron_iteration_dir(load_dir, iteration)
    first = (
        _load(files.model_file(iter_dir, 0, 0, 1), trust_pickle)
        if os.path.isfile(files.model_file(iter_dir, 0, 0, 1))
        else None
    )
    if first is None:  # PP > 1 names even stage 0 with its pipeline rank
        first = _load(files.model_file(iter_dir, 0, 0, 2), trust_pickle)
    args = first.get("args")
    if args is None:
        raise CheckpointError(
            f"{iter_dir}: the checkpoint holds no 'args'; cannot tell its model and layout"
        )
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    chunks = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    model_cfg = asdict(ModelConfig(**config_from_args(args)))
    check(Source(model_cfg, iteration, {"tp": tp, "pp": pp}))
    uneven = pp > 1 and uneven_split(args) != (None, None)
    # an uneven split has no table of its own: its tensors carry global names by then, so the
    # TP merge only needs one stage's table (and the tied head's replica is checked here)
    table = reshard.layout_table(
        {"model": model_cfg},
        tp,
        1 if uneven else pp,
        args.num_layers // (pp * chunks) if chunks > 1 else None,
    )
    shards: dict[str, list] = {}
    parts = [(s, t) for s in range(pp) for t in range(tp)]
    size = stage_file_size(iter_dir, pp)
    for s, t in tensor_groups(parts, len(parts), f"reading {iter_dir}", size=size):
        path = files.model_file(iter_dir, t, s, pp)
        state = first if (t, s) == (0, 0) else _load(path, trust_pickle)
        keys = ["model"] if chunks == 1 else [f"model{c}" for c in range(chunks)]
        for c, key in enumerate(keys):
            if key not in state:
                raise CheckpointError(f"{path}: no {key!r} entry")
            for name, tensor in stage_tensors(state[key], args, s, c, path).items():
                shards.setdefault(name, []).append(tensor)
        del state
    replica = shards.pop(_TIED_REPLICA, None) if uneven else None
    if replica is not None and not all(
        torch.equal(a, b) for a, b in zip(replica, shards["word_embeddings.weight"])
    ):
        log.warning(
            "%s: the last stage's tied output weight differs from the first stage's table; "
            "keeping the first stage's",
            iter_dir,
        )
    params = merge_shards(shards, table, model_cfg["vocab_size"], iter_dir)
    return full_checkpoint(params, model_cfg, args, iteration, f"{source} {iter_dir}")


def merge_shards(shards: dict[str, list], table: dict, vocab: int, where: str) -> dict:
    """{our name: full TP1 tensor} from each parameter's TP shards (replicas checked, dropped);
    CheckpointError when the names do not fit the model's table."""
    missing = sorted(set(table) - set(shards))
    unexpected = sorted(set(shards) - set(table))
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: the tensors do not fit the model its args describe:"
            f" missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    params: dict = {}
    for name, info in table.items():
        merged = reshard.merge_one(shards[name], info, vocab)
        if info["replica_of"]:
            if not torch.equal(merged, params.get(info["replica_of"], merged)):
                log.warning(
                    "%s: the last stage's tied output weight differs from the first "
                    "stage's table; keeping the first stage's",
                    where,
                )
            continue
        params[name] = merged.float().contiguous()
    return params


def full_checkpoint(params: dict, model_cfg: dict, args, iteration: int, source: str):
    """Imported weights as a TP1/PP1 FullCheckpoint (no optimizer state, no RNG), at the data
    position the args record."""
    return weights_only(
        params,
        model_cfg,
        iteration,
        source,
        getattr(args, "consumed_train_samples", 0) or 0,
        getattr(args, "consumed_valid_samples", 0) or 0,
    )


def _tokenizer(data_args: dict, vocab_size: int) -> dict:
    """Megatron's tokenizer args for the run's tokenizer. A tokenizer-less (mock-data) run or a
    NullTokenizer one has EOD = vocab_size - 1, which is Megatron's NullTokenizer with
    --vocab-size vocab_size - 1 (its ids plus EOD)."""
    kind = data_args.get("tokenizer_type") or "NullTokenizer"
    if kind == "NullTokenizer":
        return {"tokenizer_type": kind, "vocab_size": vocab_size - 1}
    return {
        "tokenizer_type": kind,
        "vocab_size": vocab_size,
        "vocab_file": data_args.get("vocab_file"),
        "merge_file": data_args.get("merge_file"),
        "tokenizer_model": data_args.get("tokenizer_model"),
    }


# The --normalization values Megatron-LM and megatron-core build: a norm of ours without a
# counterpart there would be written under their norms' names and read as one of them.
MEGATRON_NORMS = ("LayerNorm", "RMSNorm")


def check_norm_exportable(m: dict) -> None:
    if m["normalization"] not in MEGATRON_NORMS:
        raise CheckpointError(
            f"the model uses --normalization {m['normalization']}; Megatron-LM and "
            f"megatron-core build only {' and '.join(MEGATRON_NORMS)}"
        )


def megatron_args(
    m: dict, tp: int, pp: int, iteration: int, common: dict, core: tuple[str, str] | None = None
) -> argparse.Namespace:
    """The args a legacy Megatron-LM GPT with model `m` runs with (flags must match them; the
    ones its check_checkpoint_args compares are all present). `core` = (checkpoint format,
    transformer impl) of a megatron-core GPTModel instead."""
    heads = m["num_attention_heads"]
    data = (common.get("args") or {}).get("data") or {}
    tanh = m["gelu_approximate"] == "tanh" and not m["swiglu"]
    left = ModelConfig(**m).attention_window
    window = None if left is None else (left, 0)
    return argparse.Namespace(
        num_layers=m["num_layers"],
        hidden_size=m["hidden_size"],
        ffn_hidden_size=ModelConfig(**m).ffn_size,
        num_attention_heads=heads,
        kv_channels=m["kv_channels"] or m["hidden_size"] // heads,
        group_query_attention=m["num_query_groups"] is not None,
        num_query_groups=m["num_query_groups"] or heads,
        seq_length=m["seq_length"],
        max_position_embeddings=m["max_position_embeddings"],
        **_tokenizer(data, m["vocab_size"]),
        padded_vocab_size=ModelConfig(**m).padded_vocab_size(tp),
        make_vocab_size_divisible_by=m["make_vocab_size_divisible_by"],
        position_embedding_type=m["position_embedding_type"],
        add_position_embedding=True,  # Megatron's default (its --no-position-embedding)
        rotary_base=int(m["rotary_base"]) if core else LEGACY_ROTARY_BASE,
        rotary_percent=1.0,
        normalization=m["normalization"],
        norm_epsilon=m["norm_epsilon"],
        swiglu=m["swiglu"],
        add_bias_linear=m["add_bias_linear"],
        add_qkv_bias=m["add_bias_linear"],
        untie_embeddings_and_output_weights=m["untie_embeddings_and_output_weights"],
        # tanh GELU: Megatron's fused bias-GELU kernel with biases; without, the legacy
        # model's --openai-gelu (megatron-core has none: its exporter refuses that model)
        bias_gelu_fusion=tanh and m["add_bias_linear"],
        openai_gelu=tanh and not m["add_bias_linear"] and core is None,
        window_size=window if core else None,
        apply_residual_connection_post_layernorm=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None,
        data_parallel_random_init=False,
        iteration=iteration,
        consumed_train_samples=common.get("consumed_samples", 0),
        consumed_valid_samples=common.get("consumed_valid_samples", 0),
        params_dtype=torch.float32,
        fp16=False,
        bf16=False,
        use_legacy_models=core is None,
        ckpt_format=core[0] if core else "torch",
        transformer_impl=core[1] if core else "local",
        model_type="GPT",
    )


def export_layout(source: Source, opts: Options) -> tuple[int, int]:
    """The TP × PP an export writes: as given, else the source's."""
    layout = source.layout or {}
    return opts.tp or layout.get("tp", 1), opts.pp or layout.get("pp", 1)


def export_dir(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, files.iteration_dir_name(iteration))


def check_export_target(source: Source, save_dir: str, tp: int, pp: int) -> None:
    """Refuse a layout the trainer would refuse for this model, or an iteration already in
    `save_dir`, before anything is read or written."""
    reshard.check_target_layout({"model": source.model}, tp, pp, 1, 1, None)
    final = export_dir(save_dir, source.iteration)
    if os.path.exists(final):
        raise CheckpointError(f"{final} already exists; choose an empty --save-dir")


def write_stage_files(full: FullCheckpoint, args: argparse.Namespace, final: str, state_of) -> None:
    """Write `full` cut for args' TP × PP as Megatron-LM's torch-format stage files in
    `final` (a temporary directory renamed into place, tracker last); `state_of(tensors, m,
    pp, pp_rank)` is one stage's model state dict from its {our name: TP shard}."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    table = reshard.layout_table(full.metadata, tp, pp, None)
    save_dir = os.path.dirname(final)
    with removed_on_failure(save_dir):
        os.makedirs(save_dir, exist_ok=True)
        _write_stages(full, args, final, state_of, table)
    files.write_tracker(save_dir, args.iteration)


def _write_stages(full, args, final: str, state_of, table: dict) -> None:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    m, iteration = full.metadata["model"], args.iteration
    tmp = f"{final}.tmp-export"
    try:
        parts = [(s, t) for s in range(pp) for t in range(tp)]
        size = stage_file_size(tmp, pp)
        for s, t in tensor_groups(parts, len(parts), f"writing {final}", size=size):
            names = [n for n, e in table.items() if e["stage"] == s]
            tensors, _ = reshard.shard_for(full, table, names, t, tp)
            files.save_torch(
                {
                    "args": args,
                    "checkpoint_version": 3.0,
                    "iteration": iteration,
                    "model": state_of(tensors, m, pp, s),
                },
                files.model_file(tmp, t, s, pp),
            )
    except BaseException:
        files.rmtree_quietly(tmp)
        raise
    os.rename(tmp, final)


@contextlib.contextmanager
def removed_on_failure(save_dir: str):
    """A failed export leaves nothing behind: the --save-dir it created goes too."""
    existed = os.path.exists(save_dir)
    try:
        yield
    except BaseException:
        if not existed:
            files.rmtree_quietly(save_dir)
        raise


def megatron_flags(args: argparse.Namespace) -> list[str]:
    """Megatron-LM flags that build the model of exported `args` and load it (besides the
    layout, data and training flags); each one is an option its argument parser accepts."""
    flags = ["--use-legacy-models"] if args.use_legacy_models else []
    flags += [
        "--ckpt-format",
        args.ckpt_format,
        "--transformer-impl",
        args.transformer_impl,
        "--num-layers",
        args.num_layers,
        "--hidden-size",
        args.hidden_size,
        "--ffn-hidden-size",
        args.ffn_hidden_size,
        "--num-attention-heads",
        args.num_attention_heads,
        "--kv-channels",
        args.kv_channels,
        "--seq-length",
        args.seq_length,
        "--max-position-embeddings",
        args.max_position_embeddings,
        "--position-embedding-type",
        args.position_embedding_type,
        "--normalization",
        args.normalization,
        "--norm-epsilon",
        args.norm_epsilon,
        "--make-vocab-size-divisible-by",
        args.make_vocab_size_divisible_by,
        "--tokenizer-type",
        args.tokenizer_type,
    ]
    files_flags = [
        ("vocab_file", "--vocab-file"),
        ("merge_file", "--merge-file"),
        ("tokenizer_model", "--tokenizer-model"),
    ]
    flags += [
        x
        for field, flag in files_flags
        if getattr(args, field, None)
        for x in (flag, getattr(args, field))
    ]
    if args.tokenizer_type == "NullTokenizer":
        flags += ["--vocab-size", args.vocab_size]
    if args.group_query_attention:
        flags += ["--group-query-attention", "--num-query-groups", args.num_query_groups]
    if not args.use_legacy_models and args.position_embedding_type == "rope":
        flags += ["--rotary-base", args.rotary_base]
    if getattr(args, "window_size", None):
        flags += ["--window-size", f"{args.window_size[0]},{args.window_size[1]}"]
    switches = [
        (args.swiglu, "--swiglu"),
        (not args.add_bias_linear, "--disable-bias-linear"),
        (args.untie_embeddings_and_output_weights, "--untie-embeddings-and-output-weights"),
        (
            not args.swiglu and not args.bias_gelu_fusion and not args.openai_gelu,
            "--no-bias-gelu-fusion",
        ),  # erf GELU, as F.gelu
        (args.openai_gelu, "--openai-gelu"),
    ]  # tanh GELU without the fused kernel
    flags += [flag for on, flag in switches if on]
    return [str(x) for x in flags + ["--no-load-optim", "--no-load-rng"]]
