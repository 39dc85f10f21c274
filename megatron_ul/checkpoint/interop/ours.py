"""megatron_ul's own checkpoints as a converter: read any iteration (any layout, either storage
format) merged to TP1/PP1, write one cut for a target layout (torch storage format). From
megatron_ul to megatron_ul this is the layout conversion; from or to another family, the import
and the export."""

from __future__ import annotations

import os

from .. import files
from ..files import CheckpointError
from ..full import FullCheckpoint
from ..layout import reshard
from .base import Check, Options, Source, Written


class MegatronUl:
    name = "megatron_ul"
    help = "a megatron_ul checkpoint (any layout and storage format; written as torch files)"
    notes: tuple[str, ...] = ()

    def read(self, load_dir: str, opts: Options, check: Check) -> FullCheckpoint:
        iteration = files.read_tracker(load_dir) if opts.iteration is None else opts.iteration
        if iteration is None:
            raise CheckpointError(
                f"{os.path.join(load_dir, files.TRACKER)}: missing; {load_dir} "
                f"holds no complete checkpoint"
            )
        iter_dir = files.find_iteration_dir(load_dir, iteration)
        meta = files.read_metadata(iter_dir)
        check(Source(meta["model"], iteration, meta["layout"]))
        full = reshard.read_full(iter_dir, opts.with_optim, progress=True)
        full.common["iteration"] = iteration
        return full

    def check(self, source: Source, save_dir: str, opts: Options) -> None:
        tp, pp, sp, dp = self._layout(source.layout, opts)
        sequence_parallel = bool(source.layout and source.layout.get("sequence_parallel"))
        # the trainer's own validation, before any tensor is read or anything written
        reshard.check_target_layout(
            {"model": source.model}, tp, pp, sp, dp, opts.vp, sequence_parallel
        )

    def write(self, full: FullCheckpoint, save_dir: str, opts: Options) -> Written:
        tp, pp, sp, dp = self._layout(full.metadata["layout"], opts)
        with_optim = opts.with_optim and full.optim_state is not None
        iteration = full.common["iteration"]
        path = reshard.write_target(full, save_dir, iteration, tp, pp, sp, dp, with_optim, opts.vp)
        return Written(path, [str(x) for x in model_flags(full.metadata["model"])])

    @staticmethod
    def _layout(source_layout: dict | None, opts: Options) -> tuple[int, int, int, int]:
        """(TP, PP, SP, DP) of the target: TP and PP as given (default 1), SP and DP the
        source's when not given (they only change the metadata)."""
        layout = source_layout or {}
        return (
            opts.tp or 1,
            opts.pp or 1,
            opts.sp or layout.get("sp", 1),
            opts.dp or layout.get("dp", 1),
        )


def model_flags(m: dict) -> list[str]:
    """The pretrain_gpt.py flags that build the model described by ModelConfig fields `m`."""
    flags = [
        "--num-layers",
        m["num_layers"],
        "--hidden-size",
        m["hidden_size"],
        "--num-attention-heads",
        m["num_attention_heads"],
        "--vocab-size",
        m["vocab_size"],
        "--max-position-embeddings",
        m["max_position_embeddings"],
        "--position-embedding-type",
        m["position_embedding_type"],
        "--normalization",
        m["normalization"],
        "--norm-epsilon",
        m["norm_epsilon"],
        "--make-vocab-size-divisible-by",
        m["make_vocab_size_divisible_by"],
    ]
    optional = [("ffn_hidden_size", "--ffn-hidden-size"), ("kv_channels", "--kv-channels")]
    flags += [x for field, flag in optional if m.get(field) for x in (flag, m[field])]
    if m.get("num_query_groups"):
        flags += ["--group-query-attention", "--num-query-groups", m["num_query_groups"]]
    if m["position_embedding_type"] == "rope":
        flags += ["--rotary-base", m["rotary_base"]]
    switches = [
        (m["swiglu"], "--swiglu"),
        (not m["add_bias_linear"], "--disable-bias-linear"),
        (m["untie_embeddings_and_output_weights"], "--untie-embeddings-and-output-weights"),
    ]
    flags += [flag for on, flag in switches if on]
    if m.get("gelu_approximate", "none") != "none":
        flags += ["--gelu-approximate", m["gelu_approximate"]]
    return [str(x) for x in flags]
