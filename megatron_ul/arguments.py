"""Command line -> Config, generated from the config dataclasses (megatron_ul/config.py).

Each config field is one flag: Megatron-LM's spelling (and Megatron-DeepSpeed's
--ds-sequence-parallel-size for the Ulysses degree), its type, choices, default and help all come
from the field. The only place flags are parsed; nothing here is written per flag.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from dataclasses import MISSING, Field, dataclass, fields
from typing import Any, Literal

from .config import Config, flag_names


@dataclass(frozen=True)
class Flag:
    """One command-line flag and the config field it sets."""

    section: str  # attribute of Config, e.g. "model"
    field: str  # attribute of the section, e.g. "num_layers"
    names: tuple[str, ...]  # spellings, e.g. ("--num-layers",)
    kind: type  # int, float, str or bool (a switch)
    default: Any
    choices: tuple | None = None
    many: bool = False  # a list: nargs="*"
    help: str = ""
    enabled_by: str | None = None


def sections() -> list[tuple[str, type, str]]:
    """(attribute of Config, its dataclass, its title in --help) for each config section."""
    hints = typing.get_type_hints(Config)
    return [(s.name, hints[s.name], s.metadata.get("title", s.name)) for s in fields(Config)]


def flags() -> list[Flag]:
    """Every flag, in the order of the config sections and their fields."""
    out = []
    for name, cls, _ in sections():
        hints = typing.get_type_hints(cls)
        out += [_flag(name, f, hints[f.name]) for f in fields(cls)]
    return out


def _flag(section: str, f: Field, annotation: Any) -> Flag:
    meta = f.metadata
    kind, choices, many = _kind(annotation)
    if f.default is not MISSING:
        default = f.default
    elif f.default_factory is not MISSING:
        default = f.default_factory()
    else:
        raise TypeError(f"{section}.{f.name}: a flag needs a default")
    names = flag_names(f)
    if kind is bool and default is True and not meta.get("names"):
        raise TypeError(
            f"{section}.{f.name}: a bool defaulting to True needs flag(names=...) "
            f"for the switch that turns it off"
        )
    return Flag(
        section,
        f.name,
        tuple(names),
        kind,
        default,
        choices,
        many,
        meta.get("help", ""),
        meta.get("enabled_by"),
    )


def _kind(annotation: Any) -> tuple[type, tuple | None, bool]:
    """(value type, choices, is a list) of a field's annotation."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):  # X | None: None means "not given"
        return _kind(next(a for a in args if a is not type(None)))
    if origin is Literal:
        return type(args[0]), tuple(args), False
    if origin is list:
        return args[0] if args else str, None, True
    if annotation in (int, float, str, bool):
        return annotation, None, False
    raise TypeError(f"no command-line form for a field of type {annotation!r}")


def build_parser() -> argparse.ArgumentParser:
    """argparse from flags(). Absent flags are absent from the namespace (SUPPRESS): the
    config's own defaults apply, so each default is written once, in config.py."""
    p = argparse.ArgumentParser(
        description="Pretrain a GPT with tensor, sequence (Ulysses), pipeline and data "
        "parallelism.",
        allow_abbrev=False,
        argument_default=argparse.SUPPRESS,
    )
    groups = {name: p.add_argument_group(title) for name, _, title in sections()}
    switches = set()
    for fl in flags():
        g = groups[fl.section]
        if fl.enabled_by and fl.enabled_by not in switches:
            switches.add(fl.enabled_by)
            g.add_argument(
                fl.enabled_by,
                action="store_true",
                dest=_dest_of(fl.enabled_by),
                help=f"needed for {fl.names[0]} to take effect",
            )
        dest = f"{fl.section}.{fl.field}"
        shown = fl.default is not None and not isinstance(fl.default, (bool, list))
        default_text = f" (default {fl.default})" if shown else ""
        if fl.kind is bool:
            action = "store_false" if fl.default else "store_true"
            g.add_argument(*fl.names, dest=dest, action=action, help=fl.help)
        else:
            g.add_argument(
                *fl.names,
                dest=dest,
                type=fl.kind,
                choices=fl.choices,
                nargs="*" if fl.many else None,
                help=fl.help + default_text,
                metavar=None if fl.choices else fl.field.upper(),
            )
    return p


def _dest_of(switch: str) -> str:
    return "switch." + switch.lstrip("-").replace("-", "_")


def parse_args(argv=None, world_size: int | None = None) -> Config:
    """Parse flags into a Config (neither resolved nor validated: see config.resolve/validate).

    world_size: the launcher's world (default: $WORLD_SIZE, else 1); --world-size replaces it
    only for --dry-run.
    """
    parser = build_parser()
    given = vars(parser.parse_args(argv))
    values: dict[str, dict[str, Any]] = {name: {} for name, _, _ in sections()}
    for fl in flags():
        dest = f"{fl.section}.{fl.field}"
        if fl.enabled_by and not given.get(_dest_of(fl.enabled_by), False):
            if dest in given:  # Megatron only honours it with the switch; be explicit
                parser.error(f"{fl.names[0]} needs {fl.enabled_by}")
            continue
        if dest in given:
            values[fl.section][fl.field] = given[dest]
    if "world_size" in values["parallel"]:
        if not values["train"].get("dry_run"):
            parser.error("--world-size is only for --dry-run (launchers set the world)")
    else:
        values["parallel"]["world_size"] = (
            world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
        )
    return Config(**{name: cls(**values[name]) for name, cls, _ in sections()})
