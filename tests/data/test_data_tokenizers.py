"""Tokenizer parity: SentencePiece against sentencepiece itself, GPT-2 BPE against an
independent reference implementation on vocab/merge files built here."""

import collections
import json
import random

import pytest
import regex

from megatron_ul.data.tokenizers import (
    GPT2BPETokenizer,
    GPTSentencePieceTokenizer,
    HuggingFaceTokenizer,
    Llama2Tokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
)
from tests.data.fixtures import SP_TEXTS, hf_tokenizer_folder

SAMPLE_TEXTS = [
    "Hello world! Hello, hello... it's 2024 and we've 3.14159 reasons.",
    "def f(x):\n    return x ** 2  # squares\n\n\n",
    "Ünïcödé — naïve café, 日本語のテキスト, emoji 🙂🚀 and tabs\tand  double  spaces",
    "   leading and trailing spaces   ",
    "",
    "a",
    "I'll say they'd've known; DON'T SHOUT 12345678901234567890",
]


def make_corpus(seed=0, num_lines=400):
    rng = random.Random(seed)
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "lazy",
        "dog",
        "data",
        "token",
        "model",
        "train",
        "café",
        "naïve",
        "日本",
        "λx",
        "print(x)",
        "for i in range(10):",
        "42",
        "3.5",
    ]
    return [
        "".join(
            rng.choice([" ", "  ", "\t", ", ", ". "]) + rng.choice(words)
            for _ in range(rng.randint(3, 15))
        )
        for _ in range(num_lines)
    ]


# ---------------------------------------------------------------- SentencePiece


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    import sentencepiece

    directory = tmp_path_factory.mktemp("sp")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(make_corpus()),
        model_prefix=str(directory / "m"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        minloglevel=2,
        num_threads=1,
    )
    return str(directory / "m.model")


def test_gpt_sentencepiece_matches_sentencepiece(sp_model):
    import sentencepiece

    reference = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    tokenizer = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=sp_model)
    assert isinstance(tokenizer, GPTSentencePieceTokenizer)
    assert tokenizer.vocab_size == reference.get_piece_size() == 400
    assert tokenizer.eod == reference.eos_id() == reference.piece_to_id("</s>")
    texts = SAMPLE_TEXTS + make_corpus(seed=1, num_lines=50)
    for text in texts:
        assert tokenizer.tokenize(text) == reference.encode(text)
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == reference.decode(
            reference.encode(text)
        )
    assert tokenizer.tokenize_batch(texts) == [reference.encode(text) for text in texts]
    assert any(len(tokenizer.tokenize(text)) > 1 for text in texts)


def test_megatron_sentencepiece_special_tokens(sp_model):
    """Megatron's SentencePieceTokenizer: <CLS> <SEP> <EOD> <MASK> <PAD> get the ids after the
    pieces (the model has <s> and </s> but no pad), so 400 pieces -> vocab 405, EOD 402
    (an 8000-piece model: 8005 and 8002)."""
    import sentencepiece

    reference = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    assert isinstance(tokenizer, SentencePieceTokenizer)
    assert tokenizer.vocab_size == 405 and tokenizer.eod == 402
    assert tokenizer.special_tokens == {
        "<CLS>": 400,
        "<SEP>": 401,
        "<EOD>": 402,
        "<MASK>": 403,
        "<PAD>": 404,
        "<s>": 1,
        "</s>": 2,
    }
    text = "a <EOD>b</s><s><MASK> c<SEP>"
    expected = (
        reference.encode("a ")
        + [402]
        + reference.encode("b")
        + [2, 1, 403]
        + reference.encode(" c")
        + [401]
    )
    assert tokenizer.tokenize(text) == expected
    texts = SAMPLE_TEXTS + [text]
    assert tokenizer.tokenize_batch(texts) == [tokenizer.tokenize(t) for t in texts]
    for plain in SAMPLE_TEXTS:
        assert tokenizer.tokenize(plain) == reference.encode(plain)
    assert tokenizer.detokenize([402]) == " <EOD> "


def test_llama2_tokenizer_prepends_bos(sp_model):
    import sentencepiece

    reference = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    tokenizer = build_tokenizer("Llama2Tokenizer", tokenizer_model=sp_model)
    assert isinstance(tokenizer, Llama2Tokenizer)
    assert tokenizer.vocab_size == 400 and tokenizer.eod == reference.eos_id() == 2
    assert tokenizer.tokenize("hello") == [1] + reference.encode("hello")
    assert tokenizer.tokenize("") == [1]
    assert tokenizer.tokenize_batch(["x", "y z"]) == [
        tokenizer.tokenize("x"),
        tokenizer.tokenize("y z"),
    ]


# ---------------------------------------------------------------- Hugging Face


def test_huggingface_tokenizer_both_libraries_agree(tmp_path):
    folder = hf_tokenizer_folder(str(tmp_path / "hf"))
    light = HuggingFaceTokenizer(folder, prefer_transformers=False)
    assert light.library == "tokenizers"
    texts = SP_TEXTS[:20] + SAMPLE_TEXTS
    ids = light.tokenize_batch(texts)
    assert ids == [light.tokenize(text) for text in texts]
    assert all(token_ids[0] == 1 for token_ids in ids)  # <s> from the post-processor
    assert light.eod == 2 and light.vocab_size == 400
    assert light.detokenize(
        light.tokenize("the quick fox")
    ) == "<s>the quick fox" or light.detokenize(light.tokenize("the quick fox")).endswith(
        "the quick fox"
    )
    pytest.importorskip("transformers")
    full = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=folder)
    assert full.library == "transformers"
    assert (full.vocab_size, full.eod) == (light.vocab_size, light.eod)
    assert full.tokenize_batch(texts) == ids


def test_huggingface_tokenizer_bad_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="--tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "missing"))
    with pytest.raises((ValueError, FileNotFoundError), match="--tokenizer-model"):
        HuggingFaceTokenizer(str(tmp_path), prefer_transformers=False)


# ---------------------------------------------------------------- GPT-2 BPE reference


def reference_byte_table():
    """The byte -> unicode table as published with GPT-2 (written out independently)."""
    keep = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    table, shifted = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


REFERENCE_PATTERN = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)


class ReferenceBPE:
    """OpenAI's original encoder.py algorithm: repeatedly merge the lowest-ranked bigram."""

    def __init__(self, encoder, merges):
        self.encoder = encoder
        self.ranks = {tuple(merge): rank for rank, merge in enumerate(merges)}
        self.table = reference_byte_table()

    def bpe(self, token):
        word = tuple(token)
        while len(word) > 1:
            pairs = set(zip(word[:-1], word[1:]))
            bigram = min(pairs, key=lambda pair: self.ranks.get(pair, float("inf")))
            if bigram not in self.ranks:
                break
            first, second = bigram
            new_word, i = [], 0
            while i < len(word):
                try:
                    j = word.index(first, i)
                except ValueError:
                    new_word.extend(word[i:])
                    break
                new_word.extend(word[i:j])
                i = j
                if word[i] == first and i < len(word) - 1 and word[i + 1] == second:
                    new_word.append(first + second)
                    i += 2
                else:
                    new_word.append(word[i])
                    i += 1
            word = tuple(new_word)
        return word

    def encode(self, text):
        ids = []
        for token in REFERENCE_PATTERN.findall(text):
            token = "".join(self.table[b] for b in token.encode("utf-8"))
            ids.extend(self.encoder[piece] for piece in self.bpe(token))
        return ids


def learn_merges(texts, num_merges):
    """A tiny BPE trainer, so the test owns vocab/merge files with realistic merges."""
    table = reference_byte_table()
    words = collections.Counter()
    for text in texts:
        for token in REFERENCE_PATTERN.findall(text):
            words[tuple(table[b] for b in token.encode("utf-8"))] += 1
    merges = []
    for _ in range(num_merges):
        pairs = collections.Counter()
        for word, count in words.items():
            for pair in zip(word[:-1], word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = max(sorted(pairs), key=lambda pair: pairs[pair])
        merges.append(best)
        merged = collections.Counter()
        for word, count in words.items():
            new_word, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    new_word.append(word[i] + word[i + 1])
                    i += 2
                else:
                    new_word.append(word[i])
                    i += 1
            merged[tuple(new_word)] += count
        words = merged
    return merges


def write_gpt2_files(directory, merges):
    table = reference_byte_table()
    vocab = {}
    for piece in [table[b] for b in range(256)] + [a + b for a, b in merges] + ["<|endoftext|>"]:
        vocab.setdefault(piece, len(vocab))
    vocab_file, merge_file = directory / "vocab.json", directory / "merges.txt"
    vocab_file.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merge_file.write_text(
        "#version: 0.2\n" + "\n".join(f"{a} {b}" for a, b in merges) + "\n", encoding="utf-8"
    )
    return vocab, str(vocab_file), str(merge_file)


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    merges = learn_merges(make_corpus(seed=2) + SAMPLE_TEXTS, num_merges=120)
    vocab, vocab_file, merge_file = write_gpt2_files(tmp_path_factory.mktemp("gpt2"), merges)
    return vocab, merges, vocab_file, merge_file


def test_gpt2_bpe_matches_reference(gpt2_files):
    vocab, merges, vocab_file, merge_file = gpt2_files
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    reference = ReferenceBPE(vocab, merges)
    texts = SAMPLE_TEXTS + make_corpus(seed=3, num_lines=100)
    total_ids = total_bytes = 0
    for text in texts:
        ids = tokenizer.tokenize(text)
        assert ids == reference.encode(text), text
        assert tokenizer.detokenize(ids) == text
        total_ids += len(ids)
        total_bytes += len(text.encode("utf-8"))
    assert total_ids < 0.6 * total_bytes  # the merges really were applied
    assert tokenizer.vocab_size == len(vocab)
    assert tokenizer.eod == vocab["<|endoftext|>"]


def test_gpt2_bpe_hand_made_merges(tmp_path):
    # 'Ġ' is the space byte in GPT-2's table.
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w"), ("o", "r")]
    vocab, vocab_file, merge_file = write_gpt2_files(tmp_path, merges)
    tokenizer = GPT2BPETokenizer(vocab_file, merge_file)
    pieces = [vocab["hell"], vocab["o"], vocab["Ġw"], vocab["or"], vocab["l"], vocab["d"]]
    assert tokenizer.tokenize("hello world") == pieces


# ---------------------------------------------------------------- Null tokenizer and factory


def test_null_tokenizer():
    # Megatron: --vocab-size N means ids 0..N-1 and EOD = N (no collision with a real id).
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=100)
    assert isinstance(tokenizer, NullTokenizer)
    assert tokenizer.tokenize(" 5 17\n99 0 ") == [5, 17, 99, 0]
    assert tokenizer.detokenize([5, 17]) == "5 17"
    assert tokenizer.eod == 100 and tokenizer.vocab_size == 101
    with pytest.raises(ValueError):
        tokenizer.tokenize("101")


def test_vocab_file_that_is_not_json_names_the_file(tmp_path):
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text("not json")
    merges.write_text("")
    with pytest.raises(ValueError, match=f"--vocab-file {vocab}"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"tokenizer_type": "SentencePieceTokenizer"}, "--tokenizer-model"),
        (
            {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": "/nonexistent/x.model"},
            "--tokenizer-model",
        ),
        ({"tokenizer_type": "GPT2BPETokenizer", "merge_file": "m.txt"}, "--vocab-file"),
        ({"tokenizer_type": "NullTokenizer"}, "--vocab-size"),
        ({"tokenizer_type": "NoSuchTokenizer"}, "--tokenizer-type"),
    ],
)
def test_build_tokenizer_errors_name_the_flag(kwargs, flag):
    with pytest.raises((ValueError, FileNotFoundError), match=flag):
        build_tokenizer(**kwargs)


def test_gpt2_missing_merge_file_names_flag(gpt2_files):
    _, _, vocab_file, _ = gpt2_files
    with pytest.raises(FileNotFoundError, match="--merge-file"):
        build_tokenizer(
            "GPT2BPETokenizer", vocab_file=vocab_file, merge_file="/nonexistent/merges.txt"
        )


def test_training_flag_accepts_every_tokenizer_type():
    import typing

    from megatron_ul.config import DataConfig
    from megatron_ul.data.tokenizers import TOKENIZER_TYPES

    literal = typing.get_args(typing.get_type_hints(DataConfig)["tokenizer_type"])[0]
    assert typing.get_args(literal) == TOKENIZER_TYPES


@pytest.mark.parametrize("layout", ["header", "no-header", "no-final-newline", "blank-line"])
def test_gpt2_merges_read_as_megatron_reads_them(tmp_path, layout):
    """Megatron drops the first line and the last element of merges.txt.split('\\n'), whatever
    they hold: without the header the first merge is lost, without a final newline the last."""
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w"), ("o", "r")]
    vocab, vocab_file, merge_file = write_gpt2_files(tmp_path, merges)
    body = [f"{a} {b}" for a, b in merges]
    text = {
        "header": "#version: 0.2\n" + "\n".join(body) + "\n",
        "no-header": "\n".join(body) + "\n",
        "no-final-newline": "#version: 0.2\n" + "\n".join(body),
        "blank-line": "#version: 0.2\n" + "\n".join(body[:2] + [""] + body[2:]) + "\n",
    }[layout]
    with open(merge_file, "w", encoding="utf-8") as handle:
        handle.write(text)
    used = {
        "header": merges,
        "no-header": merges[1:],
        "no-final-newline": merges[:-1],
        "blank-line": merges,
    }[layout]
    reference = ReferenceBPE(vocab, used)
    tokenizer = GPT2BPETokenizer(vocab_file, merge_file)
    for sample in ["hello world", "he hell or word", "llama"]:
        assert tokenizer.tokenize(sample) == reference.encode(sample), (layout, sample)
