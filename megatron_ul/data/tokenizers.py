"""Tokenizers selected by ``--tokenizer-type``: Megatron-LM's names, ids and special tokens.

Every tokenizer exposes ``vocab_size``, ``tokenize(text) -> list[int]``,
``detokenize(ids) -> str`` and ``eod`` (the end-of-document id that
``--append-eod`` appends and ``--eod-mask-loss`` / ``--reset-*`` look for).
Each type means what it means in Megatron-LM's tokenizer module (the one its
tools/preprocess_data.py and training use):

* ``GPT2BPETokenizer``: byte-level BPE, EOD ``<|endoftext|>``.
* ``SentencePieceTokenizer``: the model's pieces plus Megatron's special tokens
  ``<CLS> <SEP> <EOD> <MASK>`` and the pad/BOS/EOS pieces (``<PAD>``/``<BOS>``/
  ``<EOS>`` appended when the model has none); EOD is ``<EOD>``, so an
  8000-piece model without pad has vocab 8005 and EOD 8002. Special-token text
  in the input maps to its id.
* ``GPTSentencePieceTokenizer``: the model's pieces only; EOD is the model's EOS.
* ``Llama2Tokenizer``: as GPTSentencePieceTokenizer, with BOS before every text.
* ``HuggingFaceTokenizer``: a local tokenizer folder (``--tokenizer-model``),
  through ``transformers`` when installed (as Megatron-LM), else through
  ``tokenizers`` from its ``tokenizer.json``; vocab includes added tokens, EOD
  is the EOS token, special tokens are added as the tokenizer's post-processor says.
* ``NullTokenizer``: text is space-separated ids; ``--vocab-size N`` gives
  vocab N + 1 and EOD N.
"""

import json
import os
import re
from functools import lru_cache

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
)

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


@lru_cache
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

        self.encoder = _read_json(vocab_file, "--vocab-file")
        self.decoder = {token_id: token for token, token_id in self.encoder.items()}
        self.merge_ranks = _read_merges(merge_file)
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {char: byte for byte, char in self.byte_encoder.items()}
        self.pattern = regex.compile(GPT2_SPLIT_PATTERN)
        self.cache: dict[str, list[str]] = {}
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
        ids: list[int] = []
        for pre_token in self.pattern.findall(text):
            encoded = "".join(self.byte_encoder[b] for b in pre_token.encode("utf-8"))
            ids.extend(self.encoder[piece] for piece in self.bpe(encoded))
        return ids

    def detokenize(self, ids) -> str:
        text = "".join(self.decoder[int(token_id)] for token_id in ids)
        return bytearray(self.byte_decoder[char] for char in text).decode("utf-8", errors="replace")


def _read_merges(merge_file: str) -> dict:
    """Megatron's (and GPT-2's) reading: split on newlines, drop the first line (meant to be
    the "#version" header) and the last element (meant to be the empty one after the final
    newline) whatever they hold. A file without the header loses its first merge, one without
    a final newline its last merge, exactly as in Megatron."""
    with open(merge_file, encoding="utf-8") as handle:
        lines = handle.read().split("\n")[1:-1]
    merges = [tuple(line.split()) for line in lines]
    return {pair: rank for rank, pair in enumerate(merges)}  # a repeated pair: its last rank


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


def _read_json(path, flag):
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{flag} {path}: not a JSON file ({error})") from error


def _sentencepiece_processor(model_file):
    import sentencepiece

    try:
        return sentencepiece.SentencePieceProcessor(model_file=model_file)
    except (RuntimeError, OSError) as error:
        raise ValueError(
            f"--tokenizer-model {model_file}: not a SentencePiece model ({error})"
        ) from error


class GPTSentencePieceTokenizer(AbstractTokenizer):
    """A SentencePiece ``.model`` as is; EOD is the model's EOS (``</s>``).

    Batched tokenization runs single-threaded on purpose: parallelism comes from
    preprocess_data's worker processes, so ``--workers`` means what it says.
    """

    name = "GPTSentencePieceTokenizer"

    def __init__(self, model_file: str):
        self.model_file = model_file
        self.processor = _sentencepiece_processor(model_file)

    @property
    def vocab_size(self) -> int:
        return self.processor.get_piece_size()

    @property
    def eod(self) -> int:
        eos_id = self.processor.eos_id()
        if eos_id < 0:
            raise ValueError(
                f"--tokenizer-model {self.model_file}: SentencePiece model has no EOS piece, which "
                f"{self.name} uses as EOD; retrain it with an eos_id (tools/train_tokenizer.py "
                f"does)"
            )
        return eos_id

    def tokenize(self, text: str) -> list:
        return self.processor.encode(text)

    def tokenize_batch(self, texts: list) -> list:
        return self.processor.encode(texts, num_threads=1)

    def detokenize(self, ids) -> str:
        return self.processor.decode([int(token_id) for token_id in ids])


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron's Llama2Tokenizer: every text starts with BOS; EOD is EOS."""

    name = "Llama2Tokenizer"

    def __init__(self, model_file: str):
        super().__init__(model_file)
        self.bos = self.processor.bos_id()
        if self.bos < 0:
            raise ValueError(
                f"--tokenizer-model {model_file}: SentencePiece model has no BOS piece, "
                f"which {self.name} puts before every text"
            )

    def tokenize(self, text: str) -> list:
        return [self.bos] + self.processor.encode(text)

    def tokenize_batch(self, texts: list) -> list:
        return [[self.bos] + ids for ids in self.processor.encode(texts, num_threads=1)]


class SentencePieceTokenizer(AbstractTokenizer):
    """Megatron's SentencePieceTokenizer: the model's pieces plus special tokens.

    Specials, in Megatron's order: ``<CLS> <SEP> <EOD> <MASK>``, then the
    model's pad, BOS and EOS pieces (``<PAD>``, ``<BOS>``, ``<EOS>`` when the
    model lacks one). A name the model already has keeps its id; the others get
    the next ids. The text is cut at every special token's text (the leftmost;
    at one position, the first in that order) and those map to their ids.
    """

    name = "SentencePieceTokenizer"

    def __init__(self, model_file: str):
        self.model_file = model_file
        self.processor = _sentencepiece_processor(model_file)
        self.vocab = {
            self.processor.id_to_piece(i): i for i in range(self.processor.get_piece_size())
        }
        self.special_tokens: dict[str, int] = {}
        for token in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
            self._add_special(token)
        for piece_id, fallback in (
            (self.processor.pad_id(), "<PAD>"),
            (self.processor.bos_id(), "<BOS>"),
            (self.processor.eos_id(), "<EOS>"),
        ):
            self._add_special(
                self.processor.id_to_piece(piece_id)
                if 0 <= piece_id < len(self.vocab)
                else fallback
            )
        self.inverse_special_tokens = {
            token_id: token for token, token_id in self.special_tokens.items()
        }
        self.special_pattern = re.compile(
            "|".join(re.escape(token) for token in self.special_tokens)
        )

    def _add_special(self, token):
        if token not in self.vocab:
            self.vocab[token] = len(self.vocab)
        self.special_tokens[token] = self.vocab[token]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def eod(self) -> int:
        return self.special_tokens["<EOD>"]

    def tokenize(self, text: str) -> list:
        ids, start = [], 0
        for match in self.special_pattern.finditer(text):
            ids.extend(self.processor.encode(text[start : match.start()]))
            ids.append(self.special_tokens[match.group()])
            start = match.end()
        ids.extend(self.processor.encode(text[start:]))
        return ids

    def tokenize_batch(self, texts: list) -> list:
        plain = [
            position for position, text in enumerate(texts) if not self.special_pattern.search(text)
        ]
        results: list[list[int] | None] = [None] * len(texts)
        for position, ids in zip(
            plain, self.processor.encode([texts[p] for p in plain], num_threads=1)
        ):
            results[position] = ids
        for position, ids in enumerate(results):
            if ids is None:
                results[position] = self.tokenize(texts[position])
        return results

    def detokenize(self, ids) -> str:
        # Megatron's rendering: each special token as its text between spaces.
        ids = [int(token_id) for token_id in ids]
        text, last = "", 0
        for position, token_id in enumerate(ids):
            if token_id in self.inverse_special_tokens:
                text += (
                    self.processor.decode(ids[last:position])
                    + " "
                    + self.inverse_special_tokens[token_id]
                    + " "
                )
                last = position + 1
        return text + self.processor.decode(ids[last:])


class HuggingFaceTokenizer(AbstractTokenizer):
    """A local Hugging Face tokenizer folder (``tokenizer.json`` and its config files).

    With ``transformers`` installed this is Megatron-LM's behaviour exactly
    (``AutoTokenizer``: ``tokenizer(text).input_ids``, ``len(tokenizer)``,
    ``eos_token_id``). Without it, the ``tokenizers`` library runs the same
    ``tokenizer.json`` (special tokens added by its post-processor) and the EOS
    token is read from ``tokenizer_config.json``. Nothing is downloaded.
    """

    name = "HuggingFaceTokenizer"

    def __init__(
        self, folder: str, prefer_transformers: bool = True, include_special_tokens: bool = True
    ):
        self.folder = folder
        self.library: str | None = None  # which package reads tokenizer.json
        # Megatron-LM's include_special_tokens (megatron/core/tokenizers/text/libraries/
        # huggingface_tokenizer.py text_to_ids): True, its default from 0.18 and its legacy
        # tokenizer's only behaviour, is tokenizer(text).input_ids (BOS and the like added by
        # the post-processor); False, the 0.16/0.17 default, is
        # convert_tokens_to_ids(tokenize(text)): the text's own tokens only.
        self.include_special_tokens = include_special_tokens
        if prefer_transformers:
            try:
                import transformers  # noqa: F401
            except ImportError:
                pass
            else:
                self._load_transformers()
        if self.library is None:
            self._load_tokenizers()

    def _load_transformers(self):
        import transformers

        try:
            self.hf = transformers.AutoTokenizer.from_pretrained(self.folder, local_files_only=True)
        except (OSError, ValueError) as error:
            raise ValueError(
                f"--tokenizer-model {self.folder}: not a Hugging Face tokenizer folder ({error})"
            ) from error
        self.library = "transformers"
        self._vocab_size = len(self.hf)
        self._eod = self.hf.eos_token_id

    def _load_tokenizers(self):
        try:
            import tokenizers
        except ImportError as error:
            raise ValueError(
                "HuggingFaceTokenizer needs the transformers or the tokenizers package"
            ) from error
        path = os.path.join(self.folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"--tokenizer-model {self.folder}: no tokenizer.json in the folder "
                "(install transformers to read other tokenizer formats)"
            )
        try:
            self.hf = tokenizers.Tokenizer.from_file(path)
        except Exception as error:
            raise ValueError(
                f"--tokenizer-model {path}: not a tokenizers file ({error})"
            ) from error
        self.library = "tokenizers"
        self._vocab_size = self.hf.get_vocab_size(with_added_tokens=True)
        config_path = os.path.join(self.folder, "tokenizer_config.json")
        eos = (
            _read_json(config_path, "--tokenizer-model").get("eos_token")
            if os.path.isfile(config_path)
            else None
        )
        if isinstance(eos, dict):
            eos = eos.get("content")
        self._eod = self.hf.token_to_id(eos) if eos else None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        if self._eod is None:
            raise ValueError(
                f"--tokenizer-model {self.folder}: the tokenizer has no EOS token, used as EOD"
            )
        return self._eod

    def tokenize(self, text: str) -> list:
        if self.library == "transformers":
            if not self.include_special_tokens:
                return list(self.hf.convert_tokens_to_ids(self.hf.tokenize(text)))
            return list(self.hf(text).input_ids)
        return self.hf.encode(text, add_special_tokens=self.include_special_tokens).ids

    def tokenize_batch(self, texts: list) -> list:
        if self.library == "transformers":
            if not self.include_special_tokens:
                return [self.tokenize(text) for text in texts]
            return [list(ids) for ids in self.hf(texts).input_ids] if texts else []
        return [
            encoding.ids
            for encoding in self.hf.encode_batch(
                texts, add_special_tokens=self.include_special_tokens
            )
        ]

    def detokenize(self, ids) -> str:
        return self.hf.decode([int(token_id) for token_id in ids])


class NullTokenizer(AbstractTokenizer):
    """Text is space-separated integer ids. As in Megatron, ``--vocab-size N``
    means ids 0..N-1 plus EOD = N, so ``vocab_size`` is N + 1."""

    name = "NullTokenizer"

    def __init__(self, vocab_size: int):
        if vocab_size is None or int(vocab_size) < 1:
            raise ValueError("NullTokenizer needs --vocab-size >= 1")
        self._vocab_size = int(vocab_size) + 1

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


def build_tokenizer(
    tokenizer_type: str,
    vocab_file=None,
    merge_file=None,
    tokenizer_model=None,
    vocab_size=None,
    include_special_tokens: bool = True,
) -> AbstractTokenizer:
    """Builds the tokenizer named by ``--tokenizer-type`` from its flags' values
    (`include_special_tokens`: HuggingFaceTokenizer's, see there)."""
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(
            _require_file(vocab_file, "--vocab-file", tokenizer_type),
            _require_file(merge_file, "--merge-file", tokenizer_type),
        )
    sentencepiece_types = {
        "SentencePieceTokenizer": SentencePieceTokenizer,
        "GPTSentencePieceTokenizer": GPTSentencePieceTokenizer,
        "Llama2Tokenizer": Llama2Tokenizer,
    }
    if tokenizer_type in sentencepiece_types:
        return sentencepiece_types[tokenizer_type](
            _require_file(tokenizer_model, "--tokenizer-model", tokenizer_type)
        )
    if tokenizer_type == "HuggingFaceTokenizer":
        if tokenizer_model is None:
            raise ValueError(
                "HuggingFaceTokenizer needs --tokenizer-model (a local tokenizer folder)"
            )
        if not os.path.isdir(tokenizer_model):
            raise FileNotFoundError(
                f"--tokenizer-model {tokenizer_model}: no such folder "
                "(HuggingFaceTokenizer reads a local tokenizer folder; nothing is downloaded)"
            )
        return HuggingFaceTokenizer(tokenizer_model, include_special_tokens=include_special_tokens)
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    raise ValueError(
        f"--tokenizer-type {tokenizer_type!r} unknown; choose one of {', '.join(TOKENIZER_TYPES)}"
    )
