"""Every data file a reader opens, truncated, flipped or replaced by a foreign file, fails as a
message naming it, or is read correctly; never a traceback. Readers: the index cache (a damaged
set is rebuilt, equal to a fresh build), the dataset's .bin/.idx (training refuses it at
start-up naming the file, or trains on what it holds), and preprocessing (.jsonl and .jsonl.gz
input: exit 2 naming the input, or a dataset that holds documents).

Default suite: each file gets one mutation in turn; --run-slow: every mutation of every file."""

from __future__ import annotations

import gzip
import logging
import os
import shutil

import numpy as np
import pytest

from megatron_ul.checkpoint.files import CheckpointError
from megatron_ul.config import ConfigError
from megatron_ul.data.gpt_dataset import DataError
from megatron_ul.data.index_cache import IndexCache
from megatron_ul.training.pretrain import configure, setup
from tests.checkpoint.conftest import single_rank  # noqa: F401 - a fixture
from tests.data.fixtures import write_jsonl
from tests.file_mutations import COMMON
from tools import preprocess_data

MUTATIONS = {**COMMON, "foreign: JSON": lambda d: b'{"not": "this file"}\n'}


def _mutations(paths: list[str], slow: bool) -> list[tuple[str, str]]:
    names = list(MUTATIONS)
    if slow:
        return [(p, m) for p in paths for m in names]
    return [(p, names[i % 3]) for i, p in enumerate(paths)]


def _mutate(path: str, mutation: str) -> None:
    data = open(path, "rb").read()
    open(path, "wb").write(MUTATIONS[mutation](data))


# ---- the index cache ---------------------------------------------------------------------------
def _cache_trials(tmp_path, caplog, slow: bool) -> None:
    rng = np.random.default_rng(1)
    arrays = {"doc_idx": rng.integers(0, 50, 40).astype(np.int32), "sample_idx": rng.random(9)}

    def build():
        return {k: v.copy() for k, v in arrays.items()}

    cache_dir = str(tmp_path / "cache")
    cache = IndexCache(cache_dir, {"what": "fuzz"}, "train")
    cache.load_or_build(list(arrays), build)
    pristine = {n: open(os.path.join(cache_dir, n), "rb").read() for n in os.listdir(cache_dir)}
    for name, mutation in _mutations(sorted(pristine), slow):
        for n, data in pristine.items():
            open(os.path.join(cache_dir, n), "wb").write(data)
        _mutate(os.path.join(cache_dir, name), mutation)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megatron_ul"):
            got = IndexCache(cache_dir, {"what": "fuzz"}, "train").load_or_build(
                list(arrays), build
            )
        for k, v in arrays.items():
            assert np.array_equal(np.asarray(got[k]), v), (name, mutation, k)
        said = " ".join(r.getMessage() for r in caplog.records)
        if said:  # a damaged set is named, then rebuilt
            assert name in said or "cache" in said, said


def test_the_index_cache_rebuilds_every_damaged_file(tmp_path, caplog):
    _cache_trials(tmp_path, caplog, slow=False)


@pytest.mark.slow
def test_the_index_cache_rebuilds_every_damaged_file_every_way(tmp_path, caplog):
    _cache_trials(tmp_path, caplog, slow=True)


def test_an_npz_under_a_cached_npy_name_is_rebuilt(tmp_path, caplog):
    arrays = {"doc_idx": np.arange(10, dtype=np.int64)}
    cache = IndexCache(str(tmp_path), {"what": "npz"}, "train")
    cache.load_or_build(list(arrays), lambda: dict(arrays))
    np.savez(cache.path("doc_idx") + ".tmp.npz", doc_idx=np.arange(10))
    os.replace(cache.path("doc_idx") + ".tmp.npz", cache.path("doc_idx"))
    with caplog.at_level(logging.WARNING, logger="megatron_ul"):
        got = cache.load_or_build(list(arrays), lambda: dict(arrays))
    assert np.array_equal(got["doc_idx"], arrays["doc_idx"])
    assert any("NpzFile, not one .npy array" in r.getMessage() for r in caplog.records)


# ---- the dataset, read by training ---------------------------------------------------------
MODEL = [
    "--num-layers",
    "1",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "2",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "2",
    "--train-iters",
    "1",
    "--log-interval",
    "100",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz_corpus")
    records = [{"text": " ".join(str((i * 7 + j) % 90) for j in range(30))} for i in range(24)]
    source = write_jsonl(root / "in.jsonl", records)
    prefix = str(root / "d")
    argv = ["--input", source, "--output-prefix", prefix, "--tokenizer-type", "NullTokenizer"]
    assert preprocess_data.main(argv + ["--vocab-size", "100"]) == 0
    with open(source, "rb") as f, gzip.open(str(root / "in.jsonl.gz"), "wb") as g:
        g.write(f.read())
    return {"prefix": prefix + "_text_document", "jsonl": source, "gz": str(root / "in.jsonl.gz")}


def _dataset_trials(corpus, tmp_path, slow: bool) -> None:
    for suffix, mutation in _mutations([".bin", ".idx"], slow):
        prefix = str(tmp_path / f"d{abs(hash((suffix, mutation))) % 10**6}")
        for s in (".bin", ".idx"):
            shutil.copy(corpus["prefix"] + s, prefix + s)
        _mutate(prefix + suffix, mutation)
        argv = MODEL + ["--data-path", prefix, "--tokenizer-type", "NullTokenizer"]
        argv += ["--vocab-size", "100", "--data-cache-path", str(tmp_path / "cache")]
        try:
            setup(configure(argv, 1)).train()
        except (ConfigError, DataError, CheckpointError) as e:
            assert prefix in str(e), (suffix, mutation, str(e))
        # A flipped token id the vocabulary holds is data, read as it is.


def test_training_names_every_damaged_dataset_file(corpus, tmp_path, single_rank):  # noqa: F811
    _dataset_trials(corpus, tmp_path, slow=False)


@pytest.mark.slow
def test_training_names_every_damaged_dataset_file_every_way(
    corpus,
    tmp_path,
    single_rank,  # noqa: F811
):
    _dataset_trials(corpus, tmp_path, slow=True)


# ---- preprocessing -------------------------------------------------------------------------
def _preprocess_trials(corpus, tmp_path, capsys, slow: bool) -> None:
    for source, mutation in _mutations([corpus["jsonl"], corpus["gz"]], slow):
        name = os.path.basename(source)
        path = str(tmp_path / f"{abs(hash((name, mutation))) % 10**6}-{name}")
        shutil.copy(source, path)
        _mutate(path, mutation)
        out = str(tmp_path / f"out{abs(hash((name, mutation))) % 10**6}")
        capsys.readouterr()
        argv = ["--input", path, "--output-prefix", out, "--tokenizer-type", "NullTokenizer"]
        rc = preprocess_data.main(argv + ["--vocab-size", "100"])
        err = capsys.readouterr().err
        assert rc in (0, 2), (name, mutation, rc, err)
        if rc == 2:
            assert "Traceback" not in err and path in err, (name, mutation, err)
            assert not os.path.exists(out + "_text_document.bin")
        else:
            assert os.path.getsize(out + "_text_document.bin") > 0


def test_preprocessing_names_every_damaged_input(corpus, tmp_path, capsys):
    _preprocess_trials(corpus, tmp_path, capsys, slow=False)


@pytest.mark.slow
def test_preprocessing_names_every_damaged_input_every_way(corpus, tmp_path, capsys):
    _preprocess_trials(corpus, tmp_path, capsys, slow=True)


def test_a_truncated_gzip_input_exits_2_naming_it(corpus, tmp_path, capsys):
    path = str(tmp_path / "cut.jsonl.gz")
    data = open(corpus["gz"], "rb").read()
    open(path, "wb").write(data[: len(data) * 3 // 4])
    argv = ["--input", path, "--output-prefix", str(tmp_path / "o")]
    assert (
        preprocess_data.main(argv + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"])
        == 2
    )
    err = capsys.readouterr().err
    assert f"--input {path}: cannot be read (EOFError" in err and "truncated" in err


@pytest.mark.parametrize(
    "content",
    [b"\x8f\x01garbage\n" * 88, b'{"text": ""}\n{"text": ""}\n', b'{"other": "key"}\n'],
    ids=["random lines", "empty documents", "no text key"],
)
def test_input_that_yields_no_document_fails(content, tmp_path, capsys):
    path = str(tmp_path / "in.jsonl")
    open(path, "wb").write(content)
    out = str(tmp_path / "o")
    argv = ["--input", path, "--output-prefix", out]
    assert (
        preprocess_data.main(argv + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"])
        == 2
    )
    assert "no document to write" in capsys.readouterr().err
    assert not [n for n in os.listdir(tmp_path) if n.startswith("o_")]
