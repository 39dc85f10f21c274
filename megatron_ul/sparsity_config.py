"""Block-sparse attention patterns as configuration: DeepSpeed's sparsity configs (Fixed,
BigBird, BSLongformer, Variable), their parameters with DeepSpeed's names and per-pattern
defaults (0.18.9's `ops/sparse_attention/sparsity_config.py`, its last release with them), the
--sparse-* flags that set them, and their rules. Plain data: the layouts themselves are built
by model/attention/block_sparse_layouts.py and run by model/attention/block_sparse.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from .config import Config, ModelConfig

MODES = ("fixed", "bigbird", "bslongformer", "variable")
DIRECTIONS = ("unidirectional", "bidirectional")
# Each pattern's own parameters with DeepSpeed's defaults for it (its class signatures).
PATTERN_DEFAULTS: dict[str, dict[str, Any]] = {
    "fixed": {
        "num_local_blocks": 4,
        "num_global_blocks": 1,
        "horizontal_global_attention": False,
        "num_different_global_patterns": 1,
    },
    "bigbird": {"num_random_blocks": 1, "num_sliding_window_blocks": 3, "num_global_blocks": 1},
    "bslongformer": {
        "num_sliding_window_blocks": 3,
        "global_block_indices": (0,),
        "global_block_end_indices": None,
    },
    "variable": {
        "num_random_blocks": 0,
        "local_window_blocks": (4,),
        "global_block_indices": (0,),
        "global_block_end_indices": None,
        "horizontal_global_attention": False,
    },
}
# Parameters every pattern takes.
COMMON = ("block", "different_layout_per_head", "attention")


def flag_of(name: str) -> str:
    """The command-line flag of a pattern parameter (DeepSpeed's name, hyphenated)."""
    if name == "block":
        return "--sparse-block-size"
    if name == "attention":
        return "--sparse-attention-direction"
    return "--sparse-" + name.replace("_", "-")


@dataclass(frozen=True)
class SparsityPattern:
    """One pattern with every parameter filled (the mode's defaults where not given)."""

    mode: str
    block: int = 16
    different_layout_per_head: bool = False
    attention: str = "unidirectional"
    num_local_blocks: int = 4
    num_global_blocks: int = 1
    horizontal_global_attention: bool = False
    num_different_global_patterns: int = 1
    num_random_blocks: int = 0
    num_sliding_window_blocks: int = 3
    local_window_blocks: tuple[int, ...] = (4,)
    global_block_indices: tuple[int, ...] = (0,)
    global_block_end_indices: tuple[int, ...] | None = None

    @classmethod
    def create(cls, mode: str, **given: Any) -> SparsityPattern:
        """The pattern `mode` with the parameters given (None = not given: the mode's
        default). Raises ValueError for a mode or a parameter the mode does not take."""
        if mode not in PATTERN_DEFAULTS:
            raise ValueError(f"--sparse-attention must be one of {', '.join(MODES)} ({mode!r})")
        own = PATTERN_DEFAULTS[mode]
        given = {k: v for k, v in given.items() if v is not None}
        foreign = sorted(set(given) - set(own) - set(COMMON))
        if foreign:
            raise ValueError(misplaced_message(mode, foreign))
        values = {**own, **given}
        for name in ("local_window_blocks", "global_block_indices", "global_block_end_indices"):
            if values.get(name) is not None:
                values[name] = tuple(values[name])
        return cls(mode, **values)

    @classmethod
    def of(cls, m: ModelConfig) -> SparsityPattern | None:
        """The run's pattern (None without --sparse-attention). Raises ValueError as `create`."""
        if m.sparse_attention is None:
            return None
        return cls.create(m.sparse_attention, **given_parameters(m))

    @property
    def draws_random_blocks(self) -> bool:
        return self.mode in ("bigbird", "variable") and self.num_random_blocks > 0

    def num_blocks(self, seq_length: int) -> int:
        if seq_length % self.block:
            raise ValueError(
                f"--sparse-block-size {self.block} does not divide the sequence of "
                f"{seq_length} tokens"
            )
        return seq_length // self.block

    def layout_heads(self, num_heads: int) -> int:
        """Heads whose layouts may differ (DeepSpeed's num_layout_heads)."""
        return num_heads if self.different_layout_per_head else 1


def given_parameters(m: ModelConfig) -> dict[str, Any]:
    """The pattern parameters the config's --sparse-* flags give (None = not given; a switch
    left off counts as not given)."""
    given = {}
    for f in fields(SparsityPattern):
        if f.name != "mode":
            value = getattr(m, _field(f.name))
            given[f.name] = None if value is False else value
    return given


def _field(name: str) -> str:
    """The ModelConfig field of a pattern parameter."""
    if name == "block":
        return "sparse_block_size"
    return "sparse_attention_direction" if name == "attention" else "sparse_" + name


def misplaced_message(mode: str, names: Sequence[str]) -> str:
    flags = ", ".join(flag_of(n) for n in names)
    takes = ", ".join(flag_of(n) for n in PATTERN_DEFAULTS[mode])
    verb = "does" if len(names) == 1 else "do"
    return f"{flags} {verb} not apply to --sparse-attention {mode} (it takes {takes})"


def pattern_problems(p: SparsityPattern, seq_length: int | None = None) -> list[str]:
    """DeepSpeed's parameter rules and ours, each naming its flags; `seq_length`: also the
    rules that depend on the number of blocks."""
    errors = []
    if p.attention not in DIRECTIONS:
        errors.append(f"--sparse-attention-direction must be one of {', '.join(DIRECTIONS)}")
    if p.mode in ("fixed", "variable") and p.horizontal_global_attention:
        if p.attention != "bidirectional":
            errors.append(
                "--sparse-horizontal-global-attention needs --sparse-attention-direction "
                "bidirectional (DeepSpeed's rule)"
            )
    if p.mode == "fixed":
        local, glob = p.num_local_blocks, p.num_global_blocks
        if local % glob:
            errors.append(
                f"--sparse-num-local-blocks {local} is not divisible by "
                f"--sparse-num-global-blocks {glob}"
            )
        if p.num_different_global_patterns > 1 and not p.different_layout_per_head:
            errors.append(
                "--sparse-num-different-global-patterns above 1 needs "
                "--sparse-different-layout-per-head"
            )
        if p.num_different_global_patterns > local // glob:
            errors.append(
                f"--sparse-num-different-global-patterns {p.num_different_global_patterns} "
                f"is more than --sparse-num-local-blocks / --sparse-num-global-blocks = "
                f"{local // glob}"
            )
    if p.mode == "variable" and any(w < 1 for w in p.local_window_blocks):
        errors.append("--sparse-local-window-blocks must all be >= 1")
    if p.mode in ("bslongformer", "variable"):
        errors += _global_index_problems(p)
    if seq_length is not None and seq_length % p.block == 0:
        errors += _count_problems(p, seq_length // p.block)
    return errors


def _global_index_problems(p: SparsityPattern) -> list[str]:
    starts, ends = p.global_block_indices, p.global_block_end_indices
    errors = []
    if any(i < 0 for i in starts) or any(i < 0 for i in ends or ()):
        errors.append("--sparse-global-block-indices / -end-indices must be >= 0")
    if ends is not None:
        if len(ends) != len(starts):
            errors.append(
                f"--sparse-global-block-end-indices has {len(ends)} entries, "
                f"--sparse-global-block-indices {len(starts)}: give one end per start"
            )
        elif any(s >= e for s, e in zip(starts, ends)):
            errors.append(
                "each --sparse-global-block-indices entry must be below its "
                "--sparse-global-block-end-indices entry"
            )
    return errors


def _count_problems(p: SparsityPattern, nb: int) -> list[str]:
    """Counts of blocks that a row of `nb` blocks cannot hold (DeepSpeed raises on these)."""
    errors = []
    where = f"the {nb} blocks of a row (--seq-length / --sparse-block-size)"
    checks = {
        "fixed": ("num_local_blocks", "num_global_blocks"),
        "bigbird": ("num_random_blocks", "num_sliding_window_blocks", "num_global_blocks"),
        "bslongformer": ("num_sliding_window_blocks",),
        "variable": ("num_random_blocks",),
    }[p.mode]
    for name in checks:
        if getattr(p, name) > nb:
            errors.append(f"{flag_of(name)} {getattr(p, name)} is more than {where}")
    return errors


# Counts below these are the per-field range checks' to report (config_rules.RANGES).
_MINIMA = {"block": 1, "num_local_blocks": 1, "num_global_blocks": 1,
           "num_different_global_patterns": 1, "num_random_blocks": 0,
           "num_sliding_window_blocks": 1}  # fmt: skip


def sparse_attention_problems(cfg: Config) -> list[str]:
    """The --sparse-* flags' problems in a run's configuration, each naming its flags: the
    pattern's own rules, a block size that does not divide the sequence (all of it: Ulysses
    attends whole sequences) or the ring's chunks, and attention dropout (the kernels take
    none)."""
    m, cp = cfg.model, cfg.parallel.context_parallel_size
    given = {name for name, value in given_parameters(m).items() if value is not None}
    if m.sparse_attention is None:
        stray = sorted(given - {"block", "attention"})
        if m.sparse_attention_direction != "unidirectional":
            stray.append("attention")
        if not stray:
            return []
        return [
            f"{', '.join(flag_of(n) for n in stray)} given without --sparse-attention; add "
            f"--sparse-attention {{{','.join(MODES)}}} or drop them"
        ]
    values = given_parameters(m)
    if any(values[n] is not None and values[n] < low for n, low in _MINIMA.items()):
        return []
    try:
        pattern = SparsityPattern.of(m)
    except ValueError as error:
        return [str(error)]
    assert pattern is not None
    n, block = m.seq_length, pattern.block
    errors = pattern_problems(pattern, n if n % block == 0 else None)
    if n % block:
        errors.append(
            f"--seq-length {n} is not a multiple of --sparse-block-size {block}: every "
            f"block of the layout needs {block} tokens"
        )
    chunk = n // (2 * cp)
    if cp > 1 and n % (2 * cp) == 0 and chunk % block:
        errors.append(
            f"--sparse-block-size {block} does not divide the ring's chunks of {chunk} tokens "
            f"(--seq-length / (2 × --context-parallel-size {cp})); pick a block size that "
            f"divides {chunk}"
        )
    if m.attention_dropout > 0:
        errors.append(
            f"--attention-dropout {m.attention_dropout} with --sparse-attention: the "
            f"block-sparse kernels take no attention dropout; pass --attention-dropout 0"
        )
    return errors
