"""Flags -> a validated ResolvedConfig: every problem of the command line, its paths and its data
files in one report, on every rank, before any process group, model or checkpoint exists."""

from __future__ import annotations

from ..arguments import parse_args
from ..config import Config, ResolvedConfig, resolve
from ..config_files import path_problems
from ..config_rules import config_error, problems
from ..data.checks import data_problems
from ..data.gpt_dataset import parse_data_path, parse_split
from ..initialize import world_size_from_env
from .data import build_tokenizer_for
from .wandb_writer import wandb_problems


def configure(argv=None, world_size: int | None = None) -> ResolvedConfig:
    """Parse, resolve and check; raises one ConfigError naming every bad flag and file."""
    cfg = parse_args(argv, world_size if world_size is not None else world_size_from_env())
    tokenizer_vocab_size, unbuildable = _tokenizer_vocab_size(cfg)
    unreadable = path_problems(cfg) + unbuildable + wandb_problems(cfg)
    resolved = resolve(cfg, tokenizer_vocab_size)
    found = unreadable + problems(resolved, given=cfg)
    if not unreadable:  # the files exist and the vocabulary is known: read them
        found += _data_file_problems(resolved)
    if found:
        raise config_error(found)
    return resolved


def _data_file_problems(cfg: ResolvedConfig) -> list[str]:
    d = cfg.data
    if not d.data_path or cfg.model.vocab_size < 1:
        return []
    try:
        parse_data_path(d.data_path)
        parse_split(d.split)
    except ValueError:
        return []  # config_rules reported the malformed flag
    return data_problems(d.data_path, d.split, cfg.model.vocab_size, _needed_splits(cfg))


def _tokenizer_vocab_size(cfg: Config) -> tuple[int | None, list[str]]:
    """(the vocabulary of the tokenizer the flags name, or None without one; the problems of
    a tokenizer that cannot be built, whose messages name its flags)."""
    try:
        tokenizer = build_tokenizer_for(cfg.data, cfg.model.vocab_size)
    except (ValueError, OSError) as e:
        return None, [str(e)]
    return (tokenizer.vocab_size if tokenizer is not None else None), []


def _needed_splits(cfg: ResolvedConfig) -> tuple[str, ...]:
    t = cfg.train
    return ("train", "valid") if t.eval_interval and t.eval_iters else ("train",)
