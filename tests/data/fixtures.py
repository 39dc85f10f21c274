"""Small corpora and tokenizers built on the spot (no downloads) for the data tests."""

import gzip
import json
import os
import struct

import numpy as np

from megatron_ul.data.tokenizers import bytes_to_unicode

GPT2_MERGES = [("h", "e"), ("Ġ", "t"), ("Ġt", "he"), ("l", "l")]


def write_jsonl(path, records):
    """Records are dicts (JSON-encoded) or raw strings (written as they are)."""
    path = str(path)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as handle:
        for record in records:
            handle.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return path


def byte_level_gpt2_files(folder):
    """A GPT-2 vocab.json/merges.txt pair: the 256 byte symbols (id = byte value),
    a few merges, and <|endoftext|>. Texts without merged pairs encode to their bytes."""
    encoder = {symbol: byte for byte, symbol in bytes_to_unicode().items()}
    for first, second in GPT2_MERGES:
        encoder[first + second] = len(encoder)
    encoder["<|endoftext|>"] = len(encoder)
    vocab, merges = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
    with open(vocab, "w", encoding="utf-8") as handle:
        json.dump(encoder, handle)
    with open(merges, "w", encoding="utf-8") as handle:
        handle.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in GPT2_MERGES))
    return vocab, merges, encoder


SP_TEXTS = [
    f"line {i}: the quick brown fox {'jumps ' * (i % 5)}over {i * 7} lazy dogs." for i in range(300)
]


def train_sentencepiece(folder, vocab_size=300, name="sp", **options):
    """A small BPE SentencePiece model (unk 0, bos 1, eos 2, no pad) trained on SP_TEXTS."""
    import sentencepiece

    prefix = os.path.join(folder, name)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SP_TEXTS),
        model_prefix=prefix,
        vocab_size=vocab_size,
        model_type="bpe",
        num_threads=1,
        minloglevel=2,
        **options,
    )
    return prefix + ".model"


def hf_tokenizer_folder(folder):
    """A local Hugging Face tokenizer folder built with the tokenizers library:
    byte-level BPE, <s> prepended by the post-processor, EOS </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(SP_TEXTS, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A",
        pair="<s> $A <s> $B",
        special_tokens=[("<s>", tokenizer.token_to_id("<s>"))],
    )
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as handle:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 1000000,
            },
            handle,
        )
    return folder


def expected_index_bytes(dtype_code, lengths, document_indices, itemsize):
    """An MMIDIDX .idx written out field by field from Megatron's documented layout."""
    pointers = (
        np.concatenate([[0], np.cumsum(np.asarray(lengths[:-1], dtype=np.int64) * itemsize)])
        if len(lengths)
        else np.zeros(0, np.int64)
    )
    return (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)
        + struct.pack("<B", dtype_code)
        + struct.pack("<Q", len(lengths))
        + struct.pack("<Q", len(document_indices))
        + struct.pack(f"<{len(lengths)}i", *lengths)
        + struct.pack(f"<{len(lengths)}q", *pointers.tolist())
        + struct.pack(f"<{len(document_indices)}q", *document_indices)
    )


def read_pair(prefix):
    with open(str(prefix) + ".bin", "rb") as handle:
        data = handle.read()
    with open(str(prefix) + ".idx", "rb") as handle:
        index = handle.read()
    return data, index
