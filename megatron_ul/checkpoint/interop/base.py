"""The one interface every converter implements: read a checkpoint into a FullCheckpoint (one
iteration merged to TP1/PP1, keyed by our canonical names) and write one out. A conversion is
`convert(source, target, ...)`: the source's reader, then the target's writer, whichever two
they are (megatron_ul itself is one of them), so a new family is one module with one class,
added to the table in checkpoint/interop/__init__.py."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from .. import files
from ..files import CheckpointError
from ..full import FullCheckpoint


@dataclass
class Options:
    """Every converter's options (each reads the ones it has; the CLI sets them from flags).
    Layout: None keeps the source's (or TP1/PP1 for a source without one)."""

    tp: int | None = None  # --target-tensor-parallel-size
    pp: int | None = None  # --target-pipeline-parallel-size
    vp: int | None = None  # --target-num-layers-per-virtual-pipeline-stage
    sp: int | None = None  # --target-sequence-parallel-size (megatron_ul metadata only)
    dp: int | None = None  # --target-data-parallel-size (megatron_ul metadata only)
    iteration: int | None = None  # the source's iteration (default: its tracker's)
    with_optim: bool = False  # carry the optimizer state (megatron_ul to megatron_ul only)
    true_vocab_size: int | None = None  # Megatron readers: drop the padded vocabulary rows
    trust_pickle: bool = False  # Megatron readers: unpickle what the restricted loader refuses
    ckpt_format: str | None = None  # megatron-core writer: torch_dist or torch
    transformer_impl: str | None = None  # megatron-core writer: the layer names' spec
    model_type: str | None = None  # Hugging Face writer: gpt2 or llama
    special_tokens: dict = field(default_factory=dict)  # Hugging Face writer: bos/eos ids


@dataclass
class Source:
    """What a reader knows before it reads any tensor: the model (our ModelConfig fields), the
    iteration, and the source's layout (None when it has none of ours)."""

    model: dict
    iteration: int
    layout: dict | None = None


@dataclass
class Written:
    """Where a writer wrote; the flags that load it (our model flags, or Megatron-LM's), and
    notes on what it holds."""

    path: str
    flags: list[str] = field(default_factory=list)
    flags_label: str = "model flags"
    notes: list[str] = field(default_factory=list)


Check = Callable[[Source], None]


class Converter(Protocol):
    name: str  # the --from / --to name
    help: str  # one line for the CLI
    notes: tuple[str, ...]  # said whenever it takes part (e.g. that only weights travel)

    def read(self, load_dir: str, opts: Options, check: Check) -> FullCheckpoint:
        """The source merged to TP1/PP1; `check(source)` is called before any tensor is read."""
        ...

    def check(self, source: Source, save_dir: str, opts: Options) -> None:
        """Refuse, before anything is read or written, what this writer cannot write."""
        ...

    def write(self, full: FullCheckpoint, save_dir: str, opts: Options) -> Written: ...


def convert(
    source: Converter, target: Converter, load_dir: str, save_dir: str, opts: Options
) -> Written:
    """Read `load_dir` with `source`, write it to `save_dir` with `target`; the source is never
    modified."""
    if os.path.abspath(load_dir) == os.path.abspath(save_dir):
        raise CheckpointError(
            "--save-dir must differ from --load-dir (conversion never rewrites its source)"
        )
    if not os.path.exists(load_dir):
        raise CheckpointError(f"--load-dir {load_dir}: no such directory")
    full = source.read(load_dir, opts, lambda found: target.check(found, save_dir, opts))
    return target.write(full, save_dir, opts)


def weights_only(
    params: dict,
    model: dict,
    iteration: int,
    source: str,
    consumed_samples: int = 0,
    consumed_valid_samples: int = 0,
    special_tokens: dict | None = None,
) -> FullCheckpoint:
    """Imported weights as a TP1/PP1 FullCheckpoint: no optimizer state, no RNG, the schedule
    at `iteration`."""
    from ..layout import reshard

    meta: dict = {
        "format": files.FORMAT,
        "iteration": iteration,
        "model": model,
        "layout": {
            "tp": 1,
            "pp": 1,
            "sp": 1,
            "dp": 1,
            "world": 1,
            "sequence_parallel": False,
            "vp": None,
        },
        "params": reshard.layout_table({"model": model}, 1, 1, None),
        "optimizer": None,
        "rng": False,
        "source": source,
    }
    if special_tokens is not None:
        meta["special_tokens"] = special_tokens
    common = {
        "iteration": iteration,
        "checkpoint_version": 3.0,
        "opt_param_scheduler": {"num_steps": iteration},
        "consumed_samples": consumed_samples,
        "consumed_valid_samples": consumed_valid_samples,
        "args": {},
    }
    return FullCheckpoint(meta, common, params, None, None)
