"""The one conversion command (tools/checkpoint/convert.py): --from / --to name any two
converters of the table, a conversion reports progress per tensor group, and a name outside the
table is refused naming the flag."""

import os

import torch

from megatron_ul.checkpoint import files
from megatron_ul.checkpoint.interop import CONVERTERS
from megatron_ul.checkpoint.layout import reshard
from tests.checkpoint.runs import convert_cli


def test_a_chain_through_other_frameworks_gives_back_the_same_weights(pristine, tmp_path, capsys):
    """ours (TP1) -> legacy Megatron-LM (TP2) -> megatron-core torch files (its own pair,
    neither end ours) -> ours (PP2): every weight bit-identical to the trained checkpoint's."""
    legacy, core, back = (str(tmp_path / d) for d in ("legacy", "core", "back"))
    steps = [
        (
            "megatron_ul",
            "megatron_lm",
            pristine["torch"],
            legacy,
            ["--target-tensor-parallel-size", "2"],
        ),
        (
            "megatron_lm",
            "megatron_core",
            legacy,
            core,
            ["--ckpt-format", "torch", "--transformer-impl", "local"],
        ),
        ("megatron_core", "megatron_ul", core, back, ["--target-pipeline-parallel-size", "2"]),
    ]
    for source, target, load, save, extra in steps:
        argv = ["--from", source, "--to", target, "--load-dir", load, "--save-dir", save]
        assert convert_cli(argv + extra) == 0, (source, target)
        out = capsys.readouterr()
        assert out.out.startswith(f"wrote {save}"), out.out
        assert "tensor groups" in out.err and "ETA" in out.err, out.err
    assert files.read_metadata(os.path.join(back, "iter_0000002"))["layout"]["pp"] == 2
    want = reshard.read_full(os.path.join(pristine["torch"], "iter_0000002"), with_optim=False)
    got = reshard.read_full(os.path.join(back, "iter_0000002"), with_optim=False)
    assert sorted(got.params) == sorted(want.params)
    for name, tensor in want.params.items():
        assert torch.equal(got.params[name], tensor), name


def test_an_unknown_converter_is_refused_naming_the_flag(pristine, tmp_path, capsys):
    argv = ["--load-dir", pristine["torch"], "--save-dir", str(tmp_path / "out")]
    assert convert_cli(["--from", "deepspeed", "--to", "megatron_ul"] + argv) == 2
    err = capsys.readouterr().err
    assert "--from 'deepspeed'" in err and all(name in err for name in CONVERTERS)
    assert not os.path.exists(tmp_path / "out")
