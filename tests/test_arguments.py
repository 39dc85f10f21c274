"""The command line is generated from the config dataclasses and keeps every flag's spelling.

tests/fixtures/cli_of_the_hand_written_parser.json pins the public command line: every flag's
spelling, kind, type and choices; the Config that no flags give; and the Config that one command
line setting every flag to a non-default value gives. New flags are allowed; none of the pinned
ones may change.
"""

import argparse
import json
import os
from dataclasses import asdict, fields

import pytest

from megatron_ul.arguments import build_parser, flags, parse_args, sections
from megatron_ul.config import Config

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "cli_of_the_hand_written_parser.json")


@pytest.fixture(scope="module")
def before():
    with open(FIXTURE) as f:
        return json.load(f)


def flag_table(parser: argparse.ArgumentParser) -> dict:
    table = {}
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        switch = a.nargs == 0
        for opt in a.option_strings:
            table[opt] = {
                "switch": switch,
                "choices": None if a.choices is None else list(a.choices),
                "nargs": None if switch else a.nargs,
                "type": None if switch else getattr(a.type, "__name__", "str"),
            }
    return table


def contains(new: dict, old: dict, path: str = "") -> list[str]:
    """Where `old` differs from `new`, ignoring keys only `new` has (and choices only `new`
    offers: a flag may gain choices, never lose one)."""
    diffs = []
    for key, value in old.items():
        where = f"{path}.{key}" if path else key
        if key not in new:
            diffs.append(f"{where}: gone")
        elif isinstance(value, dict) and isinstance(new[key], dict):
            diffs += contains(new[key], value, where)
        elif key == "choices" and isinstance(value, list) and isinstance(new[key], list):
            diffs += [f"{where}: {c!r} gone" for c in value if c not in new[key]]
        elif new[key] != value:
            diffs.append(f"{where}: {value!r} before, {new[key]!r} now")
    return diffs


def test_every_flag_keeps_its_spelling_kind_and_choices(before):
    assert contains(flag_table(build_parser()), before["flags"]) == []


def test_defaults_are_unchanged(before):
    assert contains(asdict(parse_args([], world_size=1)), before["defaults"]) == []


def test_every_flag_sets_the_same_field_as_before(before):
    got = asdict(parse_args(before["every_flag_argv"], world_size=1))
    assert contains(got, before["every_flag"]) == []


def test_parser_defaults_are_the_dataclass_defaults():
    """No default is written in the parser: absent flags keep the config's own values."""
    assert vars(build_parser().parse_args([])) == {}
    assert parse_args([], world_size=1) == Config(parallel=type(Config().parallel)(world_size=1))


def test_every_flag_has_help_and_one_field():
    seen = {}
    for fl in flags():
        assert fl.help, f"{fl.names[0]}: declare help=... beside the field"
        for name in fl.names:
            assert name not in seen, f"{name} declared twice ({seen.get(name)})"
            seen[name] = f"{fl.section}.{fl.field}"
    assert len(set(seen.values())) == sum(len(fields(cls)) for _, cls, _ in sections())


def test_num_query_groups_needs_group_query_attention():
    with pytest.raises(SystemExit):
        parse_args(["--num-query-groups", "2"])
    assert (
        parse_args(["--group-query-attention", "--num-query-groups", "2"]).model.num_query_groups
        == 2
    )
    assert parse_args(["--group-query-attention"]).model.num_query_groups is None


def test_world_size_flag_is_only_for_dry_run(monkeypatch):
    with pytest.raises(SystemExit):
        parse_args(["--world-size", "8"])
    assert parse_args(["--world-size", "8", "--dry-run"], world_size=2).parallel.world_size == 8
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert parse_args([]).parallel.world_size == 4
