"""The conversion command (tools/checkpoint/convert.py), in the style of Megatron-LM's
tools/checkpoint/convert.py: `--from` and `--to` name two converters of the table
(checkpoint/interop/__init__.py), and the options say the target layout and what the readers
and writers need. The per-family commands (tools/checkpoint/{hf,megatron_lm,megatron_core}.py,
with their `import` / `export` subcommands) run through the same code. It lives in the package
because the tools also run as `python tools/checkpoint/NAME.py`, where `tools.*` is not
importable."""

from __future__ import annotations

import argparse
import sys

from ..files import CheckpointError
from . import CONVERTERS, converter
from .base import Options, convert

OURS = "megatron_ul"


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, allow_abbrev=False)
    names = ", ".join(f"{name} ({c.help})" for name, c in CONVERTERS.items())
    p.add_argument("--from", dest="source", default=OURS, help=f"what --load-dir holds: {names}")
    p.add_argument("--to", dest="target", default=OURS, help="what to write in --save-dir")
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True)
    add_layout_flags(p)
    g = p.add_argument_group("megatron_ul to megatron_ul")
    g.add_argument(
        "--target-sequence-parallel-size",
        type=int,
        default=None,
        help="Ulysses degree recorded in the metadata (default: the source's)",
    )
    g.add_argument("--target-data-parallel-size", type=int, default=None)
    g.add_argument("--no-optim", action="store_true", help="convert the model weights only")
    g = p.add_argument_group("reading")
    g.add_argument("--iteration", type=int, default=None, help="default: the tracker's")
    add_megatron_read_flags(g)
    g = p.add_argument_group("writing megatron_core")
    add_core_write_flags(g)
    g = p.add_argument_group("writing hf")
    add_hf_write_flags(g)
    return p


def add_layout_flags(p, tp_default: int | None = None) -> None:
    p.add_argument(
        "--target-tensor-parallel-size",
        type=int,
        default=tp_default,
        help="default: 1 into megatron_ul, the source's into Megatron",
    )
    p.add_argument("--target-pipeline-parallel-size", type=int, default=None)
    p.add_argument(
        "--target-num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="interleaved 1F1B target: layers per model chunk (default: none)",
    )


def add_megatron_read_flags(p) -> None:
    p.add_argument(
        "--true-vocab-size",
        type=int,
        default=None,
        help="Megatron sources: drop the padded vocabulary rows (default: args.vocab_size "
        "when recorded, else keep the padded size as Megatron computed with it)",
    )
    p.add_argument(
        "--trust-pickle",
        action="store_true",
        help="Megatron sources: unpickle args objects the restricted loader (torch's "
        "weights_only) refuses",
    )


def add_core_write_flags(p) -> None:
    p.add_argument(
        "--ckpt-format",
        choices=("torch_dist", "torch"),
        default=None,
        help="torch_dist (Megatron-LM's default; TP1/PP1 on disk, Megatron reshards on load) "
        "or torch (one file per TP × PP rank)",
    )
    p.add_argument(
        "--transformer-impl",
        choices=("transformer_engine", "local"),
        default=None,
        help="the layer spec Megatron-LM will build (torch format names differ)",
    )


def add_hf_write_flags(p) -> None:
    p.add_argument(
        "--model-type",
        choices=["gpt2", "llama"],
        default=None,
        help="default: llama for SwiGLU models (Mistral when the model has a --window-size), "
        "else gpt2",
    )
    p.add_argument(
        "--bos-token-id",
        type=int,
        default=None,
        help="default: as recorded in the checkpoint (its tokenizer or import)",
    )
    p.add_argument("--eos-token-id", type=int, default=None)


def options(a: argparse.Namespace, with_optim: bool = False) -> Options:
    """Options from parsed flags (a flag a command does not define stays at its default)."""

    def get(name, default=None):
        return getattr(a, name, default)

    return Options(
        tp=get("target_tensor_parallel_size"),
        pp=get("target_pipeline_parallel_size"),
        vp=get("target_num_layers_per_virtual_pipeline_stage"),
        sp=get("target_sequence_parallel_size"),
        dp=get("target_data_parallel_size"),
        iteration=get("iteration"),
        with_optim=with_optim,
        true_vocab_size=get("true_vocab_size"),
        trust_pickle=bool(get("trust_pickle", False)),
        ckpt_format=get("ckpt_format"),
        transformer_impl=get("transformer_impl"),
        model_type=get("model_type"),
        special_tokens={"bos_token_id": get("bos_token_id"), "eos_token_id": get("eos_token_id")},
    )


def run(source: str, target: str, load_dir: str, save_dir: str, opts: Options) -> int:
    """Convert and print what was written (and the flags that load it, when the model comes
    from or goes to another framework); 2 with `error: ...` on stderr when refused."""
    try:
        _check_layout(opts)
        reader, writer = converter(source, "--from"), converter(target, "--to")
        out = convert(reader, writer, load_dir, save_dir, opts)
    except (CheckpointError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    notes = [*reader.notes, *(writer.notes if writer is not reader else ()), *out.notes]
    lines = [f"wrote {out.path}", *(f"note: {n}" for n in notes)]
    if out.flags and source != target:
        lines.append(f"{out.flags_label}: {' '.join(out.flags)}")
    print("\n".join(lines))
    return 0


def _check_layout(opts: Options) -> None:
    for flag, value in [
        ("--target-tensor-parallel-size", opts.tp),
        ("--target-pipeline-parallel-size", opts.pp),
        ("--target-num-layers-per-virtual-pipeline-stage", opts.vp),
        ("--target-sequence-parallel-size", opts.sp),
        ("--target-data-parallel-size", opts.dp),
    ]:
        if value is not None and value < 1:
            raise CheckpointError(f"{flag} must be >= 1")


def main(argv=None, description: str = "Convert a checkpoint.") -> int:
    a = parser(description).parse_args(argv)
    if a.source == a.target == OURS and a.target_tensor_parallel_size is None:
        print(
            "error: --target-tensor-parallel-size is needed to convert between megatron_ul layouts",
            file=sys.stderr,
        )
        return 2
    with_optim = a.source == a.target == OURS and not a.no_optim
    return run(a.source, a.target, a.load_dir, a.save_dir, options(a, with_optim))


def conversion_parser(
    description: str, kind: str
) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser, argparse.ArgumentParser]:
    """The Megatron commands' parser: (the parser, its `import` subcommand, its `export`
    subcommand), each command adding its own flags to the subcommands. `kind` names the
    Megatron checkpoint in the help, e.g. "legacy Megatron-LM checkpoint"."""
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
    add_megatron_read_flags(imp)
    return p, imp, exp


def run_subcommand(a: argparse.Namespace, family: str) -> int:
    """`import` (family -> megatron_ul) or `export` (megatron_ul -> family)."""
    source, target = (family, OURS) if a.command == "import" else (OURS, family)
    return run(source, target, a.load_dir, a.save_dir, options(a))
