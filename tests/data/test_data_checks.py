"""The --data-path files are checked before the model is built (one line per problem, naming the
file, exit 2 on every rank), and the preprocessing tools never leave a half-written output."""

import errno
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from megatron_ul.data.indexed_dataset import HEADER_SIZE, IndexedDataset, IndexedDatasetBuilder
from megatron_ul.training import pretrain
from tests.refusals import refusal
from tools import merge_datasets, preprocess_data

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = [
    "--num-layers",
    "1",
    "--hidden-size",
    "16",
    "--num-attention-heads",
    "2",
    "--seq-length",
    "8",
    "--train-iters",
    "2",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "100",
]  # NullTokenizer: ids 0..99 and EOD 100


def write_dataset(prefix, documents, dtype=np.uint16):
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    for document in documents:
        builder.add_document(np.asarray(document), [len(document)])
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


@pytest.fixture
def prefix(tmp_path):
    rng = np.random.default_rng(0)
    return write_dataset(tmp_path / "d", [rng.integers(0, 100, 50) for _ in range(20)])


def truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


def test_good_data_passes(prefix):
    pretrain.configure(["--data-path", prefix, *MODEL], world_size=1)


def test_bin_rewritten_in_place_with_an_id_outside_the_vocabulary(prefix, capsys, monkeypatch):
    """Same size, same index, same mtime: only the contents tell, and they are read."""
    pretrain.configure(["--data-path", prefix, *MODEL], world_size=1)  # reads the ids once
    stat = os.stat(prefix + ".bin")
    tokens = np.memmap(prefix + ".bin", dtype=np.uint16, mode="r+")
    tokens[123] = 4000
    tokens.flush()
    del tokens
    os.utime(prefix + ".bin", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    err = refusal(["--data-path", prefix, *MODEL], capsys, monkeypatch)
    assert f"--data-path {prefix}: token id 4000 does not fit the vocabulary of 101" in err


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda p: truncate(p + ".bin", 100), "bytes but"),
        (lambda p: truncate(p + ".idx", HEADER_SIZE - 3), "truncated index"),
        (
            lambda p: truncate(p + ".idx", os.path.getsize(p + ".idx") - 8),
            "does not match its header",
        ),
        (
            lambda p: _poke(p + ".idx", HEADER_SIZE, struct.pack("<i", -5)),
            "negative sequence length",
        ),
        (
            lambda p: _poke(p + ".idx", HEADER_SIZE, struct.pack("<i", 7)),
            "sequence pointers disagree with sequence lengths",
        ),
        (lambda p: _poke(p + ".idx", 9 + 8, struct.pack("<B", 7)), "cannot hold token ids"),
        (lambda p: _poke(p + ".idx", 9 + 8, struct.pack("<B", 42)), "unknown dtype code 42"),
        (
            lambda p: shutil.copy(write_dataset(p + "x", [[1, 2, 3]]) + ".bin", p + ".bin"),
            "the pair does not match",
        ),
    ],
    ids=[
        "truncated bin",
        "truncated idx header",
        "truncated idx",
        "negative length",
        "corrupt length",
        "float dtype",
        "unknown dtype",
        "size mismatch",
    ],
)
def test_damaged_files_are_named_before_the_model(prefix, damage, message, capsys, monkeypatch):
    damage(prefix)
    err = refusal(["--data-path", prefix, *MODEL], capsys, monkeypatch)
    assert f"--data-path {prefix}: " in err and message in err, err
    assert err.count("\n  ") == 1  # one line


def _poke(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_empty_dataset_and_an_empty_training_split(tmp_path, capsys, monkeypatch):
    empty = write_dataset(tmp_path / "empty", [])
    small = write_dataset(tmp_path / "small", [[1, 2, 3]] * 3)
    err = refusal(["--data-path", empty, *MODEL], capsys, monkeypatch)
    assert f"--data-path {empty}: the dataset is empty" in err
    err = refusal(["--data-path", small, "--split", "1,99,0", *MODEL], capsys, monkeypatch)
    assert f"--split 1,99,0: the train split of --data-path {small} holds fewer than 2" in err


def test_every_problem_of_a_blend_in_one_report(tmp_path, prefix, capsys, monkeypatch):
    bad = write_dataset(tmp_path / "bad", [[1, 2, 500]])
    truncated = write_dataset(tmp_path / "truncated", [[1, 2, 3]] * 4)
    truncate(truncated + ".bin", 5)
    err = refusal(
        ["--data-path", "1", prefix, "1", bad, "1", truncated, *MODEL], capsys, monkeypatch
    )
    assert f"--data-path {bad}: token id 500" in err and f"--data-path {truncated}: " in err
    assert f"--data-path {prefix}:" not in err


@pytest.mark.slow
def test_every_rank_reports_damaged_data(prefix):
    """Two ranks as srun starts them: each names the file and exits 2 before any collective."""
    truncate(prefix + ".bin", 100)
    env = dict(
        os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1"
    )
    ranks = [
        subprocess.Popen(
            [sys.executable, "pretrain_gpt.py", "--data-path", prefix, *MODEL],
            cwd=ROOT,
            env=dict(env, RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    for rank in ranks:
        _, err = rank.communicate(timeout=120)
        assert rank.returncode == 2 and f"--data-path {prefix}: " in err and "bytes but" in err
        assert "Traceback" not in err


@pytest.fixture
def disk_full_after(monkeypatch):
    """The builders' .bin writes fail with ENOSPC after `n` successful writes."""

    def arm(n):
        opened = IndexedDatasetBuilder.__init__

        def init(self, *args, **kwargs):
            opened(self, *args, **kwargs)
            self.data_file = _FailingFile(self.data_file, n)

        monkeypatch.setattr(IndexedDatasetBuilder, "__init__", init)

    return arm


class _FailingFile:
    def __init__(self, handle, writes):
        self.handle, self.writes = handle, writes

    def write(self, data):
        if self.writes == 0:
            self.handle.write(bytes(data)[: len(data) // 2])  # half of it reached the disk
            raise OSError(errno.ENOSPC, "No space left on device")
        self.writes -= 1
        return self.handle.write(data)

    def __getattr__(self, name):
        return getattr(self.handle, name)


def _files(folder):
    return sorted(
        (name, os.path.getsize(os.path.join(folder, name)))
        for name in os.listdir(folder)
        if not name.endswith(".jsonl")
    )


def test_preprocess_failing_mid_write_keeps_the_previous_output(
    tmp_path, disk_full_after, monkeypatch, capsys
):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(f'{{"text": "{i} {i + 1} {i + 2}"}}\n' for i in range(60)))
    args = [
        "--input",
        str(source),
        "--output-prefix",
        str(tmp_path / "out"),
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "100",
    ]
    assert preprocess_data.main(args) == 0
    before = _files(tmp_path)
    monkeypatch.setattr(preprocess_data, "LINES_PER_CHUNK", 5)
    disk_full_after(3)
    assert preprocess_data.main(args) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert _files(tmp_path) == before  # no temporary left, the old pair untouched
    IndexedDataset(str(tmp_path / "out_text_document"))


def test_merge_failing_mid_write_keeps_the_previous_output(
    tmp_path, prefix, disk_full_after, capsys
):
    other = write_dataset(tmp_path / "e", [[5, 6, 7]] * 10)
    out = str(tmp_path / "merged" / "m")
    assert merge_datasets.main(["--input", prefix, other, "--output-prefix", out]) == 0
    before = _files(tmp_path / "merged")
    disk_full_after(0)
    assert merge_datasets.main(["--input", prefix, other, "--output-prefix", out]) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert _files(tmp_path / "merged") == before
