"""Every checkpoint file a reader opens, truncated, flipped or replaced by a foreign file, fails
as a message naming it — exit 2 from the tools, CheckpointError from a training load — or, where
the format holds no checksum, is read; never a traceback. Readers: the training load (torch,
torch_dist), the Megatron-LM, megatron-core (torch, torch_dist) and Hugging Face importers.

Default suite: each file gets one of the mutations in turn (a few seconds); --run-slow: every
mutation of every file."""

from __future__ import annotations

import importlib.util
import io
import os
import shutil
import zipfile

import pytest
import torch

from megatron_ul.checkpoint import files
from megatron_ul.training.pretrain import configure, setup
from tests.checkpoint.runs import TINY_TWO_ITERS as ARGV
from tests.file_mutations import COMMON
from tools.checkpoint import hf as hf_tool
from tools.checkpoint import megatron_core as core_tool
from tools.checkpoint import megatron_lm as lm_tool


def _zip_of_json() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("data.json", '{"not": "a checkpoint"}')
    return buffer.getvalue()


def _torch_foreign() -> bytes:
    buffer = io.BytesIO()
    torch.save({"something": torch.ones(3), "else": [1, 2]}, buffer)
    return buffer.getvalue()


# name: bytes -> bytes
MUTATIONS = {
    **COMMON,
    "foreign: zip of JSON": lambda d: _zip_of_json(),
    "foreign: another torch file": lambda d: _torch_foreign(),
}


def _cases(root: str, slow: bool) -> list[tuple[str, str]]:
    """(relative path, mutation) for every file under root."""
    rels = sorted(
        os.path.relpath(os.path.join(r, n), root)
        for r, _, names in os.walk(root)
        for n in names
        if n != files.LOCK
    )
    names = list(MUTATIONS)
    if slow:
        return [(rel, m) for rel in rels for m in names]
    return [(rel, names[i % 3]) for i, rel in enumerate(rels)]


def _mutated(source: str, rel: str, mutation: str, tmp_path) -> str:
    d = str(tmp_path / f"mutated-{abs(hash((rel, mutation))) % 10**8}")
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(source, d, ignore=shutil.ignore_patterns(files.LOCK))
    path = os.path.join(d, rel)
    data = open(path, "rb").read()
    open(path, "wb").write(MUTATIONS[mutation](data))
    return d


def _names_it(message: str, d: str, rel: str) -> bool:
    """The message names the damaged file, or a directory under d that holds it (damage seen
    only in what the file should hold is named by the iteration directory)."""
    parts, head = [os.path.basename(rel)], rel
    while head:
        parts.append(os.path.join(d, head))
        head = os.path.dirname(head)
    return any(part in message for part in parts)


@pytest.fixture(scope="module")
def sources(pristine, tmp_path_factory):
    """{reader: (the directory it reads, how to run it: (dir, out) -> (rc, stderr))}."""
    root = tmp_path_factory.mktemp("fuzz_sources")
    out = {}
    lm = str(root / "megatron_lm")
    assert lm_tool.main(["export", "--load-dir", pristine["torch"], "--save-dir", lm]) == 0
    out["megatron_lm import"] = lm
    if importlib.util.find_spec("safetensors") is not None:  # the hf extra
        hf = str(root / "hf")
        assert hf_tool.main(["export", "--load-dir", pristine["torch"], "--hf-dir", hf]) == 0
        out["hf import"] = hf
    for fmt in ("torch", "torch_dist"):
        core = str(root / f"core_{fmt}")
        argv = ["export", "--load-dir", pristine["torch"], "--save-dir", core]
        if core_tool.main(argv + ["--ckpt-format", fmt]) == 0:
            out[f"megatron-core {fmt} import"] = core
    return out


def _tool_run(reader: str, d: str, out: str) -> int:
    if reader == "hf import":
        return hf_tool.main(["import", "--hf-dir", d, "--save-dir", out])
    tool = lm_tool if reader == "megatron_lm import" else core_tool
    return tool.main(["import", "--load-dir", d, "--save-dir", out])


IMPORTERS = [
    "megatron_lm import",
    "hf import",
    "megatron-core torch import",
    "megatron-core torch_dist import",
]


def _importer_trials(reader, sources, tmp_path, capsys, slow):
    if reader not in sources:
        pytest.skip(f"{reader}: its exporter needs megatron-core (hf: safetensors)")
    source = sources[reader]
    results = []
    for rel, mutation in _cases(source, slow):
        d = _mutated(source, rel, mutation, tmp_path)
        capsys.readouterr()
        rc = _tool_run(reader, d, str(tmp_path / "out" / f"{len(results)}"))
        err = capsys.readouterr().err
        assert rc in (0, 2), (rel, mutation, rc, err)
        if rc == 2:
            assert "Traceback" not in err and err.startswith("error: "), err
            assert _names_it(err, d, rel), (rel, mutation, err)
        results.append((rel, mutation, rc))
        shutil.rmtree(d)
    print("\n".join(f"{reader}: {rel} {m}: exit {rc}" for rel, m, rc in results))
    return results


@pytest.mark.parametrize("reader", IMPORTERS)
def test_an_importer_names_every_damaged_file(reader, sources, tmp_path, capsys):
    _importer_trials(reader, sources, tmp_path, capsys, slow=False)


@pytest.mark.slow
@pytest.mark.parametrize("reader", IMPORTERS)
def test_an_importer_names_every_damaged_file_every_way(reader, sources, tmp_path, capsys):
    _importer_trials(reader, sources, tmp_path, capsys, slow=True)


def _load_trials(fmt, pristine, tmp_path, slow):
    results = []
    for rel, mutation in _cases(pristine[fmt], slow):
        d = _mutated(pristine[fmt], rel, mutation, tmp_path)
        try:
            setup(configure(ARGV + ["--ckpt-format", fmt, "--load", d], 1))
            outcome = "loaded"
        except files.CheckpointError as e:
            assert _names_it(str(e), d, rel), (rel, mutation, str(e))
            outcome = "refused"
        # Checksummed: only a tracker whose damage leaves its number readable may load.
        if outcome == "loaded":
            assert rel == files.TRACKER and files.read_tracker(d) == 2, (rel, mutation)
        results.append((rel, mutation, outcome))
        shutil.rmtree(d)
    print("\n".join(f"load {fmt}: {rel} {m}: {o}" for rel, m, o in results))


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_training_load_names_every_damaged_file(fmt, pristine, tmp_path, single_rank):
    _load_trials(fmt, pristine, tmp_path, slow=False)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_training_load_names_every_damaged_file_every_way(fmt, pristine, tmp_path, single_rank):
    _load_trials(fmt, pristine, tmp_path, slow=True)


@pytest.mark.parametrize("text", ["-6", "", "2.5", "two", "99"])
def test_the_tracker_must_name_an_existing_non_negative_iteration(
    text, pristine, tmp_path, single_rank
):
    d = shutil.copytree(pristine["torch"], str(tmp_path / "ckpt"))
    tracker = os.path.join(d, files.TRACKER)
    open(tracker, "w").write(text + "\n")
    with pytest.raises(files.CheckpointError) as info:
        setup(configure(ARGV + ["--load", d, "--save", d], 1))
    assert tracker in str(info.value)
