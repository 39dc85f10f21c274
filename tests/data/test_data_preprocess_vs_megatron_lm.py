"""Byte-for-byte comparison with Megatron-LM's own tools/preprocess_data.py (optional reference).

Set MEGATRON_LM_DIR to a Megatron-LM checkout whose script runs with this Python
(core_v0.9.0 does: its megatron/ package is put first on PYTHONPATH). Skipped
otherwise; the same behaviour is pinned without it by test_data_preprocess_megatron.py.
"""

import os
import subprocess
import sys

import pytest

from tests.data.fixtures import (
    SP_TEXTS,
    byte_level_gpt2_files,
    hf_tokenizer_folder,
    read_pair,
    train_sentencepiece,
    write_jsonl,
)
from tools import preprocess_data

MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not MEGATRON_LM_DIR
        or not os.path.isfile(os.path.join(MEGATRON_LM_DIR or "", "tools", "preprocess_data.py")),
        reason="MEGATRON_LM_DIR (a Megatron-LM checkout) not set",
    ),
]


def run_megatron(args, cwd):
    env = dict(os.environ, PYTHONPATH=MEGATRON_LM_DIR)
    result = subprocess.run(
        [sys.executable, os.path.join(MEGATRON_LM_DIR, "tools", "preprocess_data.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def texts_with_empties():
    texts = SP_TEXTS[:40] + [
        "",
        "  ",
        "héllo wörld <EOD> and </s> <s> tokens",
        "\n\n",
        "tab\tthen\nnewline",
    ]
    return [{"text": text, "title": text[::-1][:20]} for text in texts]


def tokenizer_flags(kind, folder):
    if kind == "GPT2BPETokenizer":
        vocab, merges, _ = byte_level_gpt2_files(folder)
        return ["--vocab-file", vocab, "--merge-file", merges]
    if kind == "HuggingFaceTokenizer":
        pytest.importorskip("transformers")
        return ["--tokenizer-model", hf_tokenizer_folder(os.path.join(folder, "hf"))]
    return ["--tokenizer-model", train_sentencepiece(folder)]


@pytest.mark.parametrize(
    "kind",
    [
        "GPT2BPETokenizer",
        "SentencePieceTokenizer",
        "GPTSentencePieceTokenizer",
        "Llama2Tokenizer",
        "HuggingFaceTokenizer",
    ],
)
@pytest.mark.parametrize("eod", [True, False])
def test_same_bytes_as_megatron_lm(tmp_path, kind, eod):
    flags = ["--tokenizer-type", kind, *tokenizer_flags(kind, str(tmp_path))] + (
        ["--append-eod"] if eod else []
    )
    source = write_jsonl(tmp_path / "in.jsonl", texts_with_empties())
    # One Megatron-LM run per key: before core_v0.18 it wrote the .idx of the last key only.
    for key in ("text", "title"):
        run_megatron(
            [
                "--input",
                source,
                "--output-prefix",
                str(tmp_path / "theirs"),
                "--workers",
                "1",
                "--json-keys",
                key,
                *flags,
            ],
            str(tmp_path),
        )
    assert (
        preprocess_data.main(
            [
                "--input",
                source,
                "--output-prefix",
                str(tmp_path / "ours"),
                "--json-keys",
                "text",
                "title",
                *flags,
            ]
        )
        == 0
    )
    for key in ("text", "title"):
        assert read_pair(tmp_path / f"ours_{key}_document") == read_pair(
            tmp_path / f"theirs_{key}_document"
        )


@pytest.mark.parametrize(
    "extra", [["--partitions", "2"], ["--partitions", "2", "--keep-sequential-samples"]]
)
def test_partitions_same_bytes_as_megatron_lm(tmp_path, extra):
    records = [
        {"text": " ".join(str((i * 7 + j) % 50) for j in range(1 + i % 9))} for i in range(101)
    ]
    flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "50", "--append-eod", *extra]
    (tmp_path / "in").mkdir()
    source = write_jsonl(tmp_path / "in" / "in.jsonl", records)
    run_megatron(
        ["--input", source, "--output-prefix", str(tmp_path / "theirs"), "--workers", "2", *flags],
        str(tmp_path),
    )
    assert (
        preprocess_data.main(["--input", source, "--output-prefix", str(tmp_path / "ours"), *flags])
        == 0
    )
    assert read_pair(tmp_path / "ours_text_document") == read_pair(
        tmp_path / "theirs_text_document"
    )


def test_list_valued_json_same_bytes_as_megatron_lm(tmp_path):
    records = [{"text": ["1 2", "3"]}, {"text": ["4"]}, {"text": ["5 6 7", "8", "9 9"]}]
    flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "50", "--append-eod"]
    source = write_jsonl(tmp_path / "in.jsonl", records)
    run_megatron(
        ["--input", source, "--output-prefix", str(tmp_path / "theirs"), "--workers", "1", *flags],
        str(tmp_path),
    )
    assert (
        preprocess_data.main(["--input", source, "--output-prefix", str(tmp_path / "ours"), *flags])
        == 0
    )
    assert read_pair(tmp_path / "ours_text_document") == read_pair(
        tmp_path / "theirs_text_document"
    )


GPT2_TOKENIZATION = os.path.join(
    MEGATRON_LM_DIR or "", "megatron", "training", "tokenizer", "gpt2_tokenization.py"
)


@pytest.mark.skipif(
    not os.path.isfile(GPT2_TOKENIZATION),
    reason="this Megatron-LM checkout has no gpt2_tokenization.py (removed after "
    "core_r0.16.0; later releases load GPT-2 through the Hugging Face hub)",
)
@pytest.mark.parametrize("layout", ["header", "no-header", "no-final-newline"])
def test_gpt2_merges_edge_cases_same_ids_as_megatron_lm(tmp_path, layout):
    """Megatron drops the first line and the last element of merges.txt whatever they hold."""
    import importlib.util

    from megatron_ul.data.tokenizers import GPT2BPETokenizer

    spec = importlib.util.spec_from_file_location("megatron_gpt2_tokenization", GPT2_TOKENIZATION)
    theirs_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(theirs_module)
    vocab, merges, _ = byte_level_gpt2_files(str(tmp_path))
    with open(merges, encoding="utf-8") as handle:
        lines = handle.read().split("\n")
    text = {
        "header": "\n".join(lines),
        "no-header": "\n".join(lines[1:]),
        "no-final-newline": "\n".join(lines[:-1]),
    }[layout]
    with open(merges, "w", encoding="utf-8") as handle:
        handle.write(text)
    theirs = theirs_module.GPT2Tokenizer(
        vocab, merges, errors="replace", special_tokens=[], max_len=None
    )
    ours = GPT2BPETokenizer(vocab, merges)
    for record in texts_with_empties():
        assert ours.tokenize(record["text"]) == theirs.encode(record["text"]), layout
