"""No file of a checkpoint can run code: an object whose unpickling would write a marker file
is planted in each kind of file of both formats — with metadata.json's records and its own
checksum updated to match, as a tamperer would — and loading, generating from and converting
the checkpoint refuse it without ever running it."""

import io
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_ul.checkpoint import files
from megatron_ul.checkpoint.safe_pickle import UnsafePickleError, restricted_load
from megatron_ul.checkpoint.storage import dcp_pieces
from megatron_ul.training.pretrain import configure, setup
from tests.checkpoint.runs import TINY_TWO_ITERS as ARGV
from tests.checkpoint.runs import convert_cli
from tests.distributed import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ITER = "iter_0000002"


class Planted:
    """Unpickling it writes `marker` (what any code a loader ran could do)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def _reseal(iter_dir: str, rel: str, data: bytes, piece_digests: dict | None = None) -> None:
    """Write `data` as `rel` and make metadata.json vouch for it (record and own checksum)."""
    with open(os.path.join(iter_dir, rel), "wb") as f:
        f.write(data)
    meta = files.read_json(os.path.join(iter_dir, files.METADATA), "")
    meta["files"][rel] = files.file_record(data)
    if piece_digests is not None:
        meta["piece_sha256"][rel] = piece_digests
    files.write_metadata(iter_dir, meta)


def _plant_in_distcp(iter_dir: str, marker: str) -> None:
    """Append a planted torch.save to the rank file and point DCP's index of its first piece
    at it, every checksum updated."""
    rel = "__0_0.distcp"
    payload = io.BytesIO()
    torch.save({"x": Planted(marker)}, payload)
    data = open(os.path.join(iter_dir, rel), "rb").read()
    with open(os.path.join(iter_dir, dcp_pieces.DCP_METADATA), "rb") as f:
        index = pickle.load(f)  # our own, trusted: the test wrote it
    first = min(index.storage_data, key=lambda k: index.storage_data[k].offset)
    info = index.storage_data[first]
    info.offset, info.length = len(data), len(payload.getvalue())
    meta = files.read_json(os.path.join(iter_dir, files.METADATA), "")
    digests = dict(meta["piece_sha256"][rel])
    digests[str(info.offset)] = files.file_record(payload.getvalue())["sha256"]
    _reseal(iter_dir, rel, data + payload.getvalue(), digests)
    _reseal(iter_dir, dcp_pieces.DCP_METADATA, pickle.dumps(index))


def plant(save_dir: str, kind: str, marker: str) -> None:
    iter_dir = os.path.join(save_dir, ITER)
    planted = pickle.dumps(Planted(marker))
    if kind == "tracker":
        open(os.path.join(save_dir, files.TRACKER), "wb").write(planted)
    elif kind == files.METADATA:
        open(os.path.join(iter_dir, files.METADATA), "wb").write(planted)
    elif kind == dcp_pieces.DCP_METADATA:
        _reseal(iter_dir, kind, planted)
    elif kind.endswith(".distcp"):
        _plant_in_distcp(iter_dir, marker)
    else:  # a torch.save'd .pt file
        buffer = io.BytesIO()
        torch.save({"iteration": 2, "model": Planted(marker)}, buffer)
        _reseal(iter_dir, kind, buffer.getvalue())


def _load(save_dir: str, fmt: str) -> int:
    try:
        setup(configure(ARGV + ["--load", save_dir, "--ckpt-format", fmt], 1))
    except files.CheckpointError:
        return 2
    return 0


def _generate(save_dir: str, fmt: str) -> int:
    from tools import generate

    return generate.main(["--load", save_dir, "--prompt", "1 2", "--max-new-tokens", "1"])


def _convert(save_dir: str, fmt: str) -> int:
    return convert_cli(
        [
            "--load-dir",
            save_dir,
            "--save-dir",
            save_dir + "-converted",
            "--target-tensor-parallel-size",
            "1",
        ]
    )


KINDS = {
    "torch": ["mp_rank_00/model_optim_rng.pt", "rng/rank_00000.pt", files.METADATA, "tracker"],
    "torch_dist": [
        dcp_pieces.DCP_METADATA,
        "__0_0.distcp",
        files.COMMON_FILE,
        "rng/rank_00000.pt",
        files.METADATA,
        "tracker",
    ],
}
# Generation and conversion read no RNG states.
READERS = {"load": (_load, None), "generate": (_generate, "rng/"), "convert": (_convert, "rng/")}


def _cases():
    """Every reader on every kind of file; the default suite keeps loading every kind and the
    other readers on DCP's files (the ones read by code outside this project)."""
    for reader in sorted(READERS):
        for fmt, kinds in KINDS.items():
            for kind in kinds:
                quick = reader == "load" or kind in (dcp_pieces.DCP_METADATA, "__0_0.distcp")
                yield pytest.param(
                    reader,
                    fmt,
                    kind,
                    id=f"{reader}-{fmt}-{kind}",
                    marks=() if quick else pytest.mark.slow,
                )


@pytest.mark.parametrize("reader,fmt,kind", list(_cases()))
def test_a_planted_object_never_runs(pristine, tmp_path, single_rank, fmt, kind, reader):
    save = str(tmp_path / "ckpt")
    shutil.copytree(pristine[fmt], save)
    marker = str(tmp_path / "ran")
    plant(save, kind, marker)
    read, unread = READERS[reader]
    rc = read(save, fmt)
    assert not os.path.exists(marker), f"{kind}: the planted object ran ({reader})"
    if unread is None or not kind.startswith(unread):
        assert rc == 2, f"{kind}: {reader} accepted a planted file"


def test_the_refused_global_and_file_are_named(pristine, tmp_path, single_rank):
    save = str(tmp_path / "ckpt")
    shutil.copytree(pristine["torch_dist"], save)
    plant(save, dcp_pieces.DCP_METADATA, str(tmp_path / "ran"))
    path = os.path.join(save, ITER, dcp_pieces.DCP_METADATA)
    with pytest.raises(UnsafePickleError, match=f"{path}: refused to unpickle builtins.exec"):
        setup(configure(ARGV + ["--load", save], 1))


@pytest.mark.slow
def test_pretrain_gpt_refuses_a_planted_dcp_index(pristine, tmp_path):
    save = str(tmp_path / "ckpt")
    shutil.copytree(pristine["torch_dist"], save)
    marker = str(tmp_path / "ran")
    plant(save, dcp_pieces.DCP_METADATA, marker)
    out = subprocess.run(
        [sys.executable, "pretrain_gpt.py", *ARGV, "--load", save, "--ckpt-format", "torch_dist"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT, "MASTER_PORT": str(free_port())},
    )
    assert not os.path.exists(marker)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "refused to unpickle builtins.exec" in out.stderr and "Traceback" not in out.stderr


def test_the_dcp_index_admits_what_dcp_writes(pristine):
    """Every global a real .metadata names is admitted (else every load would fail)."""
    path = os.path.join(pristine["torch_dist"], ITER, dcp_pieces.DCP_METADATA)
    with open(path, "rb") as f:
        index = restricted_load(f, dcp_pieces.DCP_METADATA_GLOBALS, path)
    assert index.state_dict_metadata and index.storage_data


def test_restricted_load_refuses_what_is_not_listed():
    data = pickle.dumps({"a": torch.Size([2])})
    assert restricted_load(data, {("torch", "Size")}, "x") == {"a": torch.Size([2])}
    with pytest.raises(UnsafePickleError, match="x: refused to unpickle torch.Size"):
        restricted_load(data, set(), "x")
    with pytest.raises(files.CheckpointError, match="y: cannot be read"):
        restricted_load(data[:-3], {("torch", "Size")}, "y")


@pytest.mark.parametrize(
    "edit,named",
    [
        ("record", "do not match the SHA-256 it carries"),  # edited, not resealed
        ("no files", "records no files"),  # resealed without any records
        ("no record", "rank_00000.pt: not among the files"),
    ],
)  # resealed without one record
def test_metadata_json_is_sealed_and_every_file_needs_a_record(
    pristine, tmp_path, single_rank, edit, named
):
    save = str(tmp_path / "ckpt")
    shutil.copytree(pristine["torch"], save)
    iter_dir = os.path.join(save, ITER)
    meta = files.read_json(os.path.join(iter_dir, files.METADATA), "")
    if edit == "record":
        meta["files"]["rng/rank_00000.pt"]["sha256"] = "0" * 64
        files.write_json_durably(os.path.join(iter_dir, files.METADATA), meta)
    else:
        if edit == "no files":
            del meta["files"]
        else:
            del meta["files"]["rng/rank_00000.pt"]
        files.write_metadata(iter_dir, meta)
    with pytest.raises(files.CheckpointError, match=named):
        setup(configure(ARGV + ["--load", save], 1))
