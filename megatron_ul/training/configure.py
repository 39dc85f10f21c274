"""Flags -> a validated Config: every problem of the command line, its paths and its data files
in one report, on every rank, before any process group, model or checkpoint exists."""

from __future__ import annotations

from ..arguments import parse_args
from ..config import Config, resolve
from ..config_files import path_problems
from ..config_rules import config_error, problems
from ..data.checks import data_problems
from ..data.gpt_dataset import parse_data_path, parse_split
from ..initialize import world_size_from_env
from .data import build_tokenizer_for, set_vocab_from_tokenizer


def configure(argv=None, world_size: int | None = None) -> Config:
    """Parse, resolve and check; raises one ConfigError naming every bad flag and file."""
    cfg = parse_args(argv, world_size if world_size is not None else world_size_from_env())
    unreadable = path_problems(cfg) + _resolve_vocabulary(cfg)
    resolved = resolve(cfg)
    found = unreadable + problems(resolved, given=cfg)
    if not unreadable:  # the files exist and the vocabulary is known: read them
        found += _data_file_problems(resolved)
    if found:
        raise config_error(found)
    return resolved


def _data_file_problems(cfg: Config) -> list[str]:
    d = cfg.data
    if not d.data_path or cfg.model.vocab_size < 1:
        return []
    try:
        parse_data_path(d.data_path)
        parse_split(d.split)
    except ValueError:
        return []  # config_rules reported the malformed flag
    return data_problems(d.data_path, d.split, cfg.model.vocab_size, _needed_splits(cfg))


def _resolve_vocabulary(cfg: Config) -> list[str]:
    """The model's vocabulary is the data's tokenizer's; a tokenizer that cannot be built is a
    problem of its flags (the messages name them)."""
    try:
        tokenizer = build_tokenizer_for(cfg)
    except (ValueError, OSError) as e:
        return [str(e)]
    if tokenizer is not None and not cfg.data.mock_data:
        set_vocab_from_tokenizer(cfg, tokenizer)
    return []


def _needed_splits(cfg: Config) -> tuple[str, ...]:
    t = cfg.train
    return ("train", "valid") if t.eval_interval and t.eval_iters else ("train",)
