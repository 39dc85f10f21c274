"""Tokenizers selected by ``--tokenizer-type``, with Megatron's common interface.

Every tokenizer exposes ``vocab_size``, ``tokenize(text) -> list[int]``,
``detokenize(ids) -> str`` and ``eod`` (the end-of-document id that
``--append-eod`` appends and ``--eod-mask-loss`` / ``--reset-*`` look for).
"""

import json
import os
from functools import lru_cache

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "NullTokenizer")

# GPT-2's pre-tokenization pattern: contractions, letter runs, digit runs,
# punctuation runs, and whitespace (trailing whitespace kept apart so that a
# space attaches to the following word).
GPT2_SPLIT_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)
GPT2_EOD_TOKEN = "<|endoftext|>"


class AbstractTokenizer:
    """Interface shared by all tokenizers (mirrors Megatron's)."""

    name = "abstract"

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def eod(self) -> int:
        raise NotImplementedError

    def tokenize(self, text: str) -> list:
        raise NotImplementedError

    def tokenize_batch(self, texts: list) -> list:
        """Tokenizes many texts; subclasses override when a batched call is faster."""
        return [self.tokenize(text) for text in texts]

    def detokenize(self, ids) -> str:
        raise NotImplementedError


@lru_cache()
def bytes_to_unicode() -> dict:
    """GPT-2's reversible byte -> printable unicode character table.

    BPE merges operate on strings, so every byte needs a visible character;
    printable Latin-1 bytes map to themselves, the rest to code points >= 256.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    byte_values = printable[:]
    code_points = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in byte_values:
            byte_values.append(byte)
            code_points.append(256 + extra)
            extra += 1
    return dict(zip(byte_values, map(chr, code_points)))


class GPT2BPETokenizer(AbstractTokenizer):
    """Byte-level BPE from a GPT-2 ``vocab.json`` + ``merges.txt`` pair."""

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str):
        import regex  # imported here so other tokenizers work without it

        with open(vocab_file, encoding="utf-8") as handle:
            self.encoder = json.load(handle)
        self.decoder = {token_id: token for token, token_id in self.encoder.items()}
        self.merge_ranks = _read_merges(merge_file)
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {char: byte for byte, char in self.byte_encoder.items()}
        self.pattern = regex.compile(GPT2_SPLIT_PATTERN)
        self.cache = {}
        if GPT2_EOD_TOKEN not in self.encoder:
            raise ValueError(f"{vocab_file}: vocabulary has no {GPT2_EOD_TOKEN} token (the EOD)")
        self._eod = self.encoder[GPT2_EOD_TOKEN]

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    @property
    def eod(self) -> int:
        return self._eod

    def bpe(self, word: str) -> list:
        """Applies merges to one pre-token (already byte-encoded), lowest rank first."""
        if word in self.cache:
            return self.cache[word]
        parts = list(word)
        while len(parts) > 1:
            pairs = {(parts[i], parts[i + 1]) for i in range(len(parts) - 1)}
            best = min(pairs, key=lambda pair: self.merge_ranks.get(pair, float("inf")))
            if best not in self.merge_ranks:
                break
            parts = _merge_pair(parts, best)
        self.cache[word] = parts
        return parts

    def tokenize(self, text: str) -> list:
        ids = []
        for pre_token in self.pattern.findall(text):
            encoded = "".join(self.byte_encoder[b] for b in pre_token.encode("utf-8"))
            ids.extend(self.encoder[piece] for piece in self.bpe(encoded))
        return ids

    def detokenize(self, ids) -> str:
        text = "".join(self.decoder[int(token_id)] for token_id in ids)
        return bytearray(self.byte_decoder[char] for char in text).decode("utf-8", errors="replace")


def _read_merges(merge_file: str) -> dict:
    with open(merge_file, encoding="utf-8") as handle:
        lines = handle.read().split("\n")
    if lines and lines[0].startswith("#version"):
        lines = lines[1:]
    merges = [tuple(line.split()) for line in lines if line.strip()]
    return {pair: rank for rank, pair in enumerate(merges)}


def _merge_pair(parts: list, pair: tuple) -> list:
    first, second = pair
    merged = []
    i = 0
    while i < len(parts):
        if i < len(parts) - 1 and parts[i] == first and parts[i + 1] == second:
            merged.append(first + second)
            i += 2
        else:
            merged.append(parts[i])
            i += 1
    return merged


class SentencePieceTokenizer(AbstractTokenizer):
    """A SentencePiece ``.model``; EOD is the model's EOS id (``</s>``).

    Batched tokenization runs single-threaded on purpose: parallelism comes from
    preprocess_data's worker processes, so ``--workers`` means what it says.
    """

    name = "SentencePieceTokenizer"

    def __init__(self, model_file: str):
        import sentencepiece

        self.model_file = model_file
        self.processor = sentencepiece.SentencePieceProcessor(model_file=model_file)

    @property
    def vocab_size(self) -> int:
        return self.processor.get_piece_size()

    @property
    def eod(self) -> int:
        eos_id = self.processor.eos_id()
        if eos_id < 0:
            raise ValueError(
                f"{self.model_file}: SentencePiece model has no EOS piece, which is used as EOD; "
                "retrain it with an eos_id (tools/train_tokenizer.py does)"
            )
        return eos_id

    def tokenize(self, text: str) -> list:
        return self.processor.encode(text)

    def tokenize_batch(self, texts: list) -> list:
        return self.processor.encode(texts, num_threads=1)

    def detokenize(self, ids) -> str:
        return self.processor.decode([int(token_id) for token_id in ids])


class NullTokenizer(AbstractTokenizer):
    """Text is whitespace-separated integer ids; EOD is ``vocab_size - 1`` (as in Megatron)."""

    name = "NullTokenizer"

    def __init__(self, vocab_size: int):
        if vocab_size is None or int(vocab_size) < 2:
            raise ValueError("NullTokenizer needs --vocab-size >= 2")
        self._vocab_size = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._vocab_size - 1

    def tokenize(self, text: str) -> list:
        ids = [int(word) for word in text.split()]
        for token_id in ids:
            if not 0 <= token_id < self._vocab_size:
                raise ValueError(f"token id {token_id} outside [0, {self._vocab_size})")
        return ids

    def detokenize(self, ids) -> str:
        return " ".join(str(int(token_id)) for token_id in ids)


def _require_file(path, flag: str, tokenizer_type: str) -> str:
    if path is None:
        raise ValueError(f"{tokenizer_type} needs {flag}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {path}: no such file")
    return path


def build_tokenizer(tokenizer_type: str, vocab_file=None, merge_file=None,
                    tokenizer_model=None, vocab_size=None) -> AbstractTokenizer:
    """Builds the tokenizer named by ``--tokenizer-type`` from its flags' values."""
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(
            _require_file(vocab_file, "--vocab-file", tokenizer_type),
            _require_file(merge_file, "--merge-file", tokenizer_type),
        )
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(_require_file(tokenizer_model, "--tokenizer-model", tokenizer_type))
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    raise ValueError(f"--tokenizer-type {tokenizer_type!r} unknown; choose one of {', '.join(TOKENIZER_TYPES)}")
