"""tools/preprocess_data.py (and the demo-corpus tools): output, bad input, atomic output."""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_ul.data.indexed_dataset import IndexedDataset
from tools import make_demo_corpus, preprocess_data, train_tokenizer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_jsonl(path, lines):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as handle:
        for line in lines:
            handle.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return str(path)


def null_documents(count, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 99, size=rng.integers(1, 30)).tolist() for _ in range(count)]


def null_args(input_path, prefix, *extra):
    return [
        "--input",
        input_path,
        "--output-prefix",
        str(prefix),
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "100",
        *extra,
    ]


def output_files(directory):
    return sorted(name for name in os.listdir(directory) if not name.endswith((".jsonl", ".gz")))


@pytest.mark.parametrize("workers", [1, 2])
def test_tokens_and_documents_written_in_order(tmp_path, monkeypatch, workers):
    monkeypatch.setattr(preprocess_data, "LINES_PER_CHUNK", 7)  # many chunks, so ordering matters
    documents = null_documents(50)
    lines = [{"text": " ".join(map(str, doc)), "title": str(len(doc))} for doc in documents]
    source = write_jsonl(tmp_path / "in.jsonl.gz", lines)
    prefix = tmp_path / "out"
    code = preprocess_data.main(
        null_args(
            source,
            prefix,
            "--json-keys",
            "text",
            "title",
            "--append-eod",
            "--workers",
            str(workers),
            "--log-interval",
            "10",
        )
    )
    assert code == 0
    text = IndexedDataset(f"{prefix}_text_document")
    assert text.dtype == np.uint16 and len(text) == 50 == text.num_documents
    for index, document in enumerate(documents):
        assert text[index].tolist() == document + [100]  # NullTokenizer: EOD = --vocab-size
    titles = IndexedDataset(f"{prefix}_title_document")
    assert [titles[i].tolist() for i in range(50)] == [[len(doc), 100] for doc in documents]
    assert output_files(tmp_path) == [
        "out_text_document.bin",
        "out_text_document.idx",
        "out_title_document.bin",
        "out_title_document.idx",
    ]


def test_sentencepiece_output_matches_tokenizer(tmp_path):
    import sentencepiece

    texts = [
        f"line {i}: the quick brown fox {'jumps ' * (i % 5)}over {i * 7} lazy dogs."
        for i in range(300)
    ]
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": text} for text in texts])
    code = train_tokenizer.main(
        [
            "--input",
            source,
            "--model-prefix",
            str(tmp_path / "sp"),
            "--vocab-size",
            "300",
            "--threads",
            "1",
        ]
    )
    assert code == 0
    model = str(tmp_path / "sp.model")
    assert (
        preprocess_data.main(
            [
                "--input",
                source,
                "--output-prefix",
                str(tmp_path / "o"),
                "--tokenizer-type",
                "GPTSentencePieceTokenizer",
                "--tokenizer-model",
                model,
                "--append-eod",
            ]
        )
        == 0
    )
    processor = sentencepiece.SentencePieceProcessor(model_file=model)
    dataset = IndexedDataset(str(tmp_path / "o_text_document"))
    for index, text in enumerate(texts):
        assert dataset[index].tolist() == processor.encode(text) + [processor.eos_id()]
    assert processor.decode(dataset[5][:-1].tolist()) == texts[5]


def test_malformed_and_missing_key_lines_are_skipped_with_line_numbers(tmp_path, capsys):
    lines = [
        '{"text": "1 2 3"}',
        '{"text": "4 5',
        '{"other": "6"}',
        "",
        '{"text": "7 8"}',
        "[1, 2]",
        '{"text": "5 101"}',
        '{"text": 12}',
    ]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    assert preprocess_data.main(null_args(source, tmp_path / "out")) == 0
    stderr = capsys.readouterr().err
    assert "line 2: malformed JSON" in stderr
    assert "line 3: missing key 'text'" in stderr
    assert "line 6: not a JSON object" in stderr
    assert "line 7: cannot tokenize" in stderr  # id 101 is outside ids 0..99 + EOD 100
    assert "line 8: key 'text' is not a string" in stderr
    assert "line 4" not in stderr and "line 5" not in stderr
    assert "5 bad lines skipped" in stderr
    dataset = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [dataset[i].tolist() for i in range(len(dataset))] == [[1, 2, 3], [7, 8]]


def test_strict_stops_nonzero_and_leaves_nothing(tmp_path):
    lines = [{"text": "1 2"}] * 5 + ['{"text": broken'] + [{"text": "3"}] * 5
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.preprocess_data",
            *null_args(source, tmp_path / "out"),
            "--strict",
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert result.returncode != 0
    assert "line 6: malformed JSON" in result.stderr and "--strict" in result.stderr
    assert output_files(tmp_path) == []


@pytest.mark.parametrize("case", ["missing", "empty", "blank_lines", "bad_gzip"])
def test_bad_input_stops_before_any_output(tmp_path, capsys, case):
    source = str(tmp_path / ("in.jsonl.gz" if case == "bad_gzip" else "in.jsonl"))
    if case == "empty":
        open(source, "w").close()
    elif case == "blank_lines":
        open(source, "w").write("\n  \n\n")
    elif case == "bad_gzip":
        open(source, "wb").write(b"this is not gzip data")
    assert preprocess_data.main(null_args(source, tmp_path / "out")) == 2
    assert f"--input {source}" in capsys.readouterr().err
    assert output_files(tmp_path) == []


def test_unwritable_prefix_and_missing_tokenizer_file(tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "1"}])
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    assert preprocess_data.main(null_args(source, blocker / "sub" / "out")) == 2
    assert "--output-prefix" in capsys.readouterr().err
    assert (
        preprocess_data.main(
            [
                "--input",
                source,
                "--output-prefix",
                str(tmp_path / "o"),
                "--tokenizer-type",
                "SentencePieceTokenizer",
                "--tokenizer-model",
                str(tmp_path / "none.model"),
            ]
        )
        == 2
    )
    assert "--tokenizer-model" in capsys.readouterr().err
    assert output_files(tmp_path) == ["a_file"]


def test_failure_mid_run_leaves_no_pair_and_keeps_no_temporaries(tmp_path, monkeypatch):
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 3"}] * 40)
    monkeypatch.setattr(preprocess_data, "LINES_PER_CHUNK", 5)
    written = []

    def failing_write(self, outputs):
        written.append(outputs)
        if len(written) == 3:
            raise KeyboardInterrupt  # as if Ctrl-C arrived mid-run
        original_write(self, outputs)

    original_write = preprocess_data.OutputSet.write
    monkeypatch.setattr(preprocess_data.OutputSet, "write", failing_write)
    assert preprocess_data.main(null_args(source, tmp_path / "out")) == 130
    assert output_files(tmp_path) == []


def test_rerun_replaces_previous_output(tmp_path):
    prefix = tmp_path / "out"
    first = write_jsonl(tmp_path / "a.jsonl", [{"text": "1 2"}])
    second = write_jsonl(tmp_path / "b.jsonl", [{"text": "3 4 5"}, {"text": "6"}])
    assert preprocess_data.main(null_args(first, prefix)) == 0
    assert preprocess_data.main(null_args(second, prefix)) == 0
    dataset = IndexedDataset(f"{prefix}_text_document")
    assert [dataset[i].tolist() for i in range(len(dataset))] == [[3, 4, 5], [6]]


def test_make_demo_corpus(tmp_path):
    folder = tmp_path / "src"
    (folder / "pkg").mkdir(parents=True)
    (folder / "a.py").write_text("print('a')\n")
    (folder / "pkg" / "b.py").write_text("x = 1\n")
    (folder / "pkg" / "c.txt").write_text("not python")
    (folder / "blob.py").write_bytes(b"\x00\x01binary")
    output = tmp_path / "corpus.jsonl"
    assert make_demo_corpus.main(["--input-dir", str(folder), "--output", str(output)]) == 0
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [(r["source"], r["text"]) for r in records] == [
        ("a.py", "print('a')\n"),
        ("pkg/b.py", "x = 1\n"),
    ]
    assert os.path.isfile(os.path.join(make_demo_corpus.default_input_dir(), "os.py"))
