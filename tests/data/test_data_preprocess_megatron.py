"""tools/preprocess_data.py against fixed expected bytes derived from Megatron-LM's format and
rules.

Megatron-LM's rules pinned here (tools/preprocess_data.py + IndexedDatasetBuilder):
* every sentence with tokens is one sequence; empty sentences are dropped;
* ``--append-eod`` appends EOD to the last sentence of a document that has tokens;
* a document without tokens writes no sequence but still ends a document (its
  entry in the document indices repeats the previous one);
* each ``--json-keys`` key gets its own pair; a list value is a list of sentences;
* ``--split-sentences`` names the outputs ``_sentence``; ``--partitions N``
  orders record i into partition i % N and concatenates the partitions.
"""

import os
import struct
import subprocess
import sys

import pytest

from tests.data.fixtures import byte_level_gpt2_files, expected_index_bytes, read_pair, write_jsonl
from tools import preprocess_data

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UINT16 = 8


def null_run(tmp_path, records, *extra, vocab_size=10, name="out"):
    source = write_jsonl(tmp_path / f"{name}.jsonl", records)
    prefix = tmp_path / name
    code = preprocess_data.main(
        [
            "--input",
            source,
            "--output-prefix",
            str(prefix),
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            str(vocab_size),
            *extra,
        ]
    )
    return code, prefix


def uint16_bytes(values):
    return struct.pack(f"<{len(values)}H", *values)


CORPUS = [{"text": "1 2 3", "title": "7"}, {"text": "", "title": "8 9"}, {"text": "4", "title": ""}]


def test_empty_documents_and_two_keys_with_eod(tmp_path, capsys):
    code, prefix = null_run(tmp_path, CORPUS, "--json-keys", "text", "title", "--append-eod")
    assert code == 0
    # NullTokenizer --vocab-size 10: EOD is 10; an empty document gets no EOD and no sequence.
    assert read_pair(f"{prefix}_text_document") == (
        uint16_bytes([1, 2, 3, 10, 4, 10]),
        expected_index_bytes(UINT16, [4, 2], [0, 1, 1, 2], 2),
    )
    assert read_pair(f"{prefix}_title_document") == (
        uint16_bytes([7, 10, 8, 9, 10]),
        expected_index_bytes(UINT16, [2, 3], [0, 1, 2, 2], 2),
    )
    assert "3 documents (11 tokens, 2 empty documents" in capsys.readouterr().err


def test_empty_documents_without_eod(tmp_path):
    code, prefix = null_run(tmp_path, CORPUS)
    assert code == 0
    assert read_pair(f"{prefix}_text_document") == (
        uint16_bytes([1, 2, 3, 4]),
        expected_index_bytes(UINT16, [3, 1], [0, 1, 1, 2], 2),
    )


def test_list_valued_json_is_one_sequence_per_nonempty_sentence(tmp_path):
    records = [{"text": ["1 2", "", "3"]}, {"text": []}, {"text": ["5"]}]
    code, prefix = null_run(tmp_path, records, "--append-eod")
    assert code == 0
    assert read_pair(f"{prefix}_text_document") == (
        uint16_bytes([1, 2, 3, 10, 5, 10]),
        expected_index_bytes(UINT16, [2, 2, 2], [0, 2, 2, 3], 2),
    )


@pytest.mark.parametrize(
    "extra, order",
    [
        (["--partitions", "3"], [0, 3, 6, 1, 4, 2, 5]),
        (["--partitions", "3", "--keep-sequential-samples"], list(range(7))),
    ],
)
def test_partitions_order(tmp_path, extra, order):
    records = [{"text": f"{i} {i}"} for i in range(7)]
    code, prefix = null_run(tmp_path, records, *extra, "--workers", "2")
    assert code == 0
    tokens = [value for i in order for value in (i, i)]
    assert read_pair(f"{prefix}_text_document") == (
        uint16_bytes(tokens),
        expected_index_bytes(UINT16, [2] * 7, list(range(8)), 2),
    )
    assert sorted(os.listdir(tmp_path)) == [
        "out.jsonl",
        "out_text_document.bin",
        "out_text_document.idx",
    ]


def test_int32_tokens_for_large_vocab(tmp_path):
    code, prefix = null_run(tmp_path, [{"text": "70000 1"}], "--append-eod", vocab_size=100000)
    assert code == 0
    assert read_pair(f"{prefix}_text_document") == (
        struct.pack("<3i", 70000, 1, 100000),
        expected_index_bytes(4, [3], [0, 1], 4),
    )


def fake_punkt_data(folder):
    """An NLTK data folder with an empty English Punkt model (no abbreviations learned)."""
    model = os.path.join(folder, "tokenizers", "punkt_tab", "english")
    os.makedirs(model)
    for name in ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab"):
        open(os.path.join(model, name), "w").close()
    return str(folder)


TEXT = "Good day. See you.\n\nOk!"  # no GPT2_MERGES pair occurs in it


@pytest.mark.parametrize(
    "keep_newlines, sentences",
    [
        (False, ["Good day.", "See you.", "Ok!"]),
        (True, ["Good day. ", "See you.\n\n", "Ok!"]),
    ],
)
def test_split_sentences_bytes(tmp_path, monkeypatch, keep_newlines, sentences):
    pytest.importorskip("nltk")
    monkeypatch.setenv("NLTK_DATA", fake_punkt_data(tmp_path / "nltk"))
    import nltk.data

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path / "nltk")])
    vocab, merges, encoder = byte_level_gpt2_files(str(tmp_path))
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": TEXT}])
    extra = ["--keep-newlines"] if keep_newlines else []
    assert (
        preprocess_data.main(
            [
                "--input",
                source,
                "--output-prefix",
                str(tmp_path / "o"),
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--vocab-file",
                vocab,
                "--merge-file",
                merges,
                "--split-sentences",
                "--append-eod",
                *extra,
            ]
        )
        == 0
    )
    eod = encoder["<|endoftext|>"]
    # No merge applies to these texts, so the ids are the UTF-8 bytes.
    ids = [list(sentence.encode()) for sentence in sentences]
    ids[-1].append(eod)
    lengths = [len(sentence_ids) for sentence_ids in ids]
    data, index = read_pair(tmp_path / "o_text_sentence")
    assert data == uint16_bytes([i for sentence_ids in ids for i in sentence_ids])
    assert index == expected_index_bytes(UINT16, lengths, [0, 3], 2)


def test_split_sentences_without_punkt_data_fails_at_once(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": TEXT}])
    env = dict(os.environ, NLTK_DATA=str(tmp_path / "no_such_nltk_data"), HOME=str(tmp_path))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.preprocess_data",
            "--input",
            source,
            "--output-prefix",
            str(tmp_path / "o"),
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "10",
            "--split-sentences",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 2
    assert "--split-sentences" in result.stderr and (
        "punkt_tab" in result.stderr or "nltk" in result.stderr
    )
    assert len(result.stderr.strip().splitlines()) == 1
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_gpt2_bpe_bytes(tmp_path):
    vocab, merges, encoder = byte_level_gpt2_files(str(tmp_path))
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "the hello"}, {"text": ""}])
    assert (
        preprocess_data.main(
            [
                "--input",
                source,
                "--output-prefix",
                str(tmp_path / "o"),
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--vocab-file",
                vocab,
                "--merge-file",
                merges,
                "--append-eod",
            ]
        )
        == 0
    )
    # "the" -> t, he ; " hello" -> Ġ h e l l o with merges "h e" and "l l": Ġ, he, ll, o
    expected = [
        ord("t"),
        encoder["he"],
        encoder["Ġ"],
        encoder["he"],
        encoder["ll"],
        ord("o"),
        encoder["<|endoftext|>"],
    ]
    assert read_pair(tmp_path / "o_text_document") == (
        uint16_bytes(expected),
        expected_index_bytes(UINT16, [7], [0, 1, 1], 2),
    )
