"""The command line the Megatron conversion tools share (tools/checkpoint/megatron_lm.py and
megatron_core.py): `import` and `export` subcommands with the same directory, layout and import
flags, and one way to report their outcome. It lives in the package because the tools also run
as `python tools/checkpoint/NAME.py`, where `tools.*` is not importable."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from .. import files
from ..files import CheckpointError
from .hf import model_flags


def conversion_parser(
    description: str, kind: str
) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser, argparse.ArgumentParser]:
    """(the parser, its `import` subcommand, its `export` subcommand), each tool adding its own
    flags to the subcommands. `kind` names the Megatron checkpoint in the help, e.g.
    "legacy Megatron-LM checkpoint"."""
    p = argparse.ArgumentParser(description=description, allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help=f"{kind} -> megatron_ul")
    exp = sub.add_parser("export", help=f"megatron_ul checkpoint -> {kind}")
    for s in (imp, exp):
        s.add_argument("--load-dir", required=True)
        s.add_argument("--save-dir", required=True)
        s.add_argument("--target-tensor-parallel-size", type=int, default=None)
        s.add_argument("--target-pipeline-parallel-size", type=int, default=None)
    imp.add_argument("--iteration", type=int, default=None, help="default: the tracker's")
    imp.add_argument(
        "--true-vocab-size",
        type=int,
        default=None,
        help="drop the padded vocabulary rows (default: args.vocab_size when "
        "recorded, else keep the padded size as Megatron computed with it)",
    )
    imp.add_argument(
        "--trust-pickle",
        action="store_true",
        help="unpickle args objects the restricted loader (torch's weights_only) refuses",
    )
    return p, imp, exp


def run_conversion(
    a: argparse.Namespace,
    import_into_ours: Callable[..., str],
    export: Callable[[argparse.Namespace], str],
    note: str = "",
) -> int:
    """Run the parsed subcommand: `import` calls `import_into_ours` with the import flags (it
    returns the iteration directory written), `export` calls `export(a)` (it returns what to
    print). Returns the exit status: 0, or 2 with `error: ...` on stderr when the --load-dir
    is missing or the conversion refuses. `note` is printed after what was written."""
    try:
        if not os.path.isdir(a.load_dir):
            raise CheckpointError(f"--load-dir {a.load_dir}: no such directory")
        print(_imported(a, import_into_ours, note) if a.command == "import" else export(a))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _imported(a: argparse.Namespace, import_into_ours: Callable[..., str], note: str) -> str:
    out = import_into_ours(
        a.load_dir,
        a.save_dir,
        a.target_tensor_parallel_size or 1,
        a.target_pipeline_parallel_size or 1,
        iteration=a.iteration,
        true_vocab_size=a.true_vocab_size,
        trust_pickle=a.trust_pickle,
    )
    model = files.read_metadata(out)["model"]
    return f"wrote {out}\n{note}model flags: {' '.join(model_flags(model))}"
