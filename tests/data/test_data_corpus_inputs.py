"""Corpus-scale inputs: compressed and Parquet shards, directories and globs, Slurm-array blocks
merged back to the bytes of one run, progress lines, and bad inputs."""

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.data.fixtures import read_pair, write_jsonl
from tools import merge_datasets, preprocess_data

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def records(first, count):
    return [
        {"text": " ".join(str((i * 7 + j) % 97) for j in range(i % 11)), "id": i}
        for i in range(first, first + count)
    ]


def null_flags(*extra):
    return ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--append-eod", *extra]


def write_shards(folder):
    """Five shards in sorted-name order: plain, gzip, zstd (if available), Parquet (if
    available)."""
    folder.mkdir()
    all_records = records(0, 200)
    blocks = [all_records[i : i + 40] for i in range(0, 200, 40)]
    write_jsonl(folder / "s0.jsonl", blocks[0])
    write_jsonl(folder / "s1.jsonl.gz", blocks[1])
    try:
        import zstandard

        with open(folder / "s2.jsonl.zst", "wb") as handle:
            handle.write(
                zstandard.ZstdCompressor().compress(
                    "".join(json.dumps(r) + "\n" for r in blocks[2]).encode()
                )
            )
    except ImportError:
        write_jsonl(folder / "s2.jsonl", blocks[2])
    try:
        import pyarrow
        import pyarrow.parquet

        pyarrow.parquet.write_table(
            pyarrow.Table.from_pylist(blocks[3]), folder / "s3.parquet", row_group_size=16
        )
    except ImportError:
        write_jsonl(folder / "s3.jsonl", blocks[3])
    write_jsonl(folder / "s4.jsonl", blocks[4])
    (folder / "README.txt").write_text("not a shard")
    return all_records


def test_directory_glob_and_single_file_give_the_same_bytes(tmp_path):
    all_records = write_shards(tmp_path / "shards")
    single = write_jsonl(tmp_path / "all.jsonl", all_records)
    assert (
        preprocess_data.main(
            ["--input", single, "--output-prefix", str(tmp_path / "one"), *null_flags()]
        )
        == 0
    )
    assert (
        preprocess_data.main(
            [
                "--input",
                str(tmp_path / "shards"),
                "--output-prefix",
                str(tmp_path / "dir"),
                *null_flags("--workers", "2"),
            ]
        )
        == 0
    )
    assert (
        preprocess_data.main(
            [
                "--input",
                str(tmp_path / "shards" / "s*"),
                "--output-prefix",
                str(tmp_path / "glob"),
                *null_flags(),
            ]
        )
        == 0
    )
    expected = read_pair(tmp_path / "one_text_document")
    assert read_pair(tmp_path / "dir_text_document") == expected
    assert read_pair(tmp_path / "glob_text_document") == expected


def test_shard_blocks_merged_equal_one_run(tmp_path):
    write_shards(tmp_path / "shards")
    assert (
        preprocess_data.main(
            [
                "--input",
                str(tmp_path / "shards"),
                "--output-prefix",
                str(tmp_path / "one"),
                *null_flags(),
            ]
        )
        == 0
    )
    parts = []
    for index in range(7):  # more blocks than shards: some blocks are empty
        prefix = str(tmp_path / f"part{index}")
        assert (
            preprocess_data.main(
                [
                    "--input",
                    str(tmp_path / "shards"),
                    "--output-prefix",
                    prefix,
                    "--shard-block",
                    f"{index}/7",
                    *null_flags(),
                ]
            )
            == 0
        )
        parts.append(prefix + "_text_document")
    assert (
        merge_datasets.main(["--input", *parts, "--output-prefix", str(tmp_path / "merged")]) == 0
    )
    assert read_pair(tmp_path / "merged") == read_pair(tmp_path / "one_text_document")


def test_slurm_array_script_without_slurm(tmp_path):
    """The sbatch file is a bash script: run its array tasks and its merge job by hand."""
    write_shards(tmp_path / "shards")
    assert (
        preprocess_data.main(
            [
                "--input",
                str(tmp_path / "shards"),
                "--output-prefix",
                str(tmp_path / "one"),
                *null_flags(),
            ]
        )
        == 0
    )
    env = dict(
        os.environ,
        INPUT=str(tmp_path / "shards"),
        OUTPUT_PREFIX=str(tmp_path / "slurm"),
        TOKENIZER_ARGS="--tokenizer-type NullTokenizer --vocab-size 100",
        EXTRA_ARGS="--append-eod",
        PYTHON=sys.executable,
        SLURM_ARRAY_TASK_COUNT="3",
        SLURM_SUBMIT_DIR=REPO_ROOT,
    )
    script = os.path.join(REPO_ROOT, "scripts", "slurm", "preprocess_array.sbatch")
    for task in range(3):
        result = subprocess.run(
            ["bash", script],
            env=dict(env, SLURM_ARRAY_TASK_ID=str(task)),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-2000:]
    result = subprocess.run(
        ["bash", script],
        env=dict(env, MODE="merge", NUM_PARTS="3"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert read_pair(tmp_path / "slurm_text_document") == read_pair(tmp_path / "one_text_document")
    assert sorted(name for name in os.listdir(tmp_path) if name.startswith("slurm")) == [
        "slurm_text_document.bin",
        "slurm_text_document.idx",
    ]


def test_progress_reports_rates_and_eta(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(preprocess_data, "LINES_PER_CHUNK", 10)
    source = write_jsonl(tmp_path / "in.jsonl", records(0, 100))
    assert (
        preprocess_data.main(
            [
                "--input",
                source,
                "--output-prefix",
                str(tmp_path / "o"),
                *null_flags("--log-interval", "20"),
            ]
        )
        == 0
    )
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("processed")]
    assert len(lines) == 5
    assert all("docs/s" in line and "MB/s" in line and "% of input, ETA" in line for line in lines)


@pytest.mark.parametrize(
    "case", ["bad_zst", "parquet_missing_column", "glob_no_match", "empty_dir"]
)
def test_bad_corpus_inputs_name_the_file(tmp_path, capsys, case):
    if case == "bad_zst":
        pytest.importorskip("zstandard")
        target = tmp_path / "x.jsonl.zst"
        target.write_bytes(b"not zstd at all")
    elif case == "parquet_missing_column":
        pytest.importorskip("pyarrow")
        import pyarrow
        import pyarrow.parquet

        target = tmp_path / "x.parquet"
        pyarrow.parquet.write_table(pyarrow.Table.from_pylist([{"body": "1 2"}]), target)
    elif case == "glob_no_match":
        target = tmp_path / "nothing-*.jsonl"
    else:
        target = tmp_path / "empty"
        target.mkdir()
    assert (
        preprocess_data.main(
            ["--input", str(target), "--output-prefix", str(tmp_path / "o"), *null_flags()]
        )
        == 2
    )
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and str(target) in error[0] and "--input" in error[0]
    assert not [name for name in os.listdir(tmp_path) if name.startswith("o_")]


def test_write_failure_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    source = write_jsonl(tmp_path / "in.jsonl", records(0, 50))

    def disk_full(self, tokens, lengths):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(preprocess_data.IndexedDatasetBuilder, "add_sequences", disk_full)
    assert (
        preprocess_data.main(
            ["--input", source, "--output-prefix", str(tmp_path / "o"), *null_flags()]
        )
        == 2
    )
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "--output-prefix" in error[0] and "No space left" in error[0]
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_sigterm_removes_temporary_files(tmp_path):
    # A slow gzip stream: many lines so that the run is still going when SIGTERM arrives.
    source = str(tmp_path / "big.jsonl.gz")
    with gzip.open(source, "wt") as handle:
        line = json.dumps({"text": " ".join(["5"] * 200)}) + "\n"
        for _ in range(300000):
            handle.write(line)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tools.preprocess_data",
            "--input",
            source,
            "--output-prefix",
            str(tmp_path / "o"),
            *null_flags("--workers", "2"),
        ],
        cwd=REPO_ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 120
        while (
            not [name for name in os.listdir(tmp_path) if ".tmp-" in name]
            and time.time() < deadline
        ):
            time.sleep(0.1)
        time.sleep(1.0)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:  # a hang is a failure, not a leftover process
            process.kill()
            process.communicate()
    assert process.returncode == 143, stderr[-2000:]
    assert "terminated" in stderr
    assert sorted(os.listdir(tmp_path)) == ["big.jsonl.gz"]
