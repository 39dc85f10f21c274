"""tools/preprocess_data.py's two HuggingFaceTokenizer paths, as Megatron-LM computes them
(megatron/core/tokenizers/text/libraries/huggingface_tokenizer.py text_to_ids; tools/
preprocess_data.py encode): with the special tokens, tokenizer(text).input_ids (Megatron-LM
0.18+'s default and 0.16/0.17's --legacy-tokenizer); without, convert_tokens_to_ids(
tokenize(text)) (0.16/0.17's default). Per document: empty sentences dropped, EOD appended to
non-empty documents. The reference is transformers' AutoTokenizer called that way here."""

import numpy as np
import pytest

from tests.data.fixtures import hf_tokenizer_folder, read_pair, write_jsonl
from tools import preprocess_data

transformers = pytest.importorskip("transformers")
TEXTS = ["hello world", "", "  ", "the quick brown fox", "\n\n", "tab\tthen\nnewline"]


def _expected(folder: str, include: bool) -> bytes:
    tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    out = []
    for text in TEXTS:
        ids = tok(text).input_ids if include else tok.convert_tokens_to_ids(tok.tokenize(text))
        if ids:
            out += list(ids) + [tok.eos_token_id]
    return np.array(out, dtype=np.uint16).tobytes()  # Megatron's dtype below 65500 ids


@pytest.mark.parametrize(
    "flags,include",
    [
        ([], True),
        (["--legacy-tokenizer"], True),
        (["--tokenizer-hf-include-special-tokens"], True),
        (["--tokenizer-hf-no-include-special-tokens"], False),
    ],
)
def test_tokenizer_paths_match_megatron_lm(tmp_path, flags, include):
    folder = hf_tokenizer_folder(str(tmp_path / "hf"))
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    prefix = str(tmp_path / "out")
    argv = [
        "--input",
        source,
        "--output-prefix",
        prefix,
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        folder,
        "--append-eod",
        *flags,
    ]
    assert preprocess_data.main(argv) == 0
    data, _ = read_pair(prefix + "_text_document")
    assert data == _expected(folder, include)
    bos = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True).bos_token_id
    assert (np.frombuffer(data, np.uint16)[0] == bos) == include


def test_no_special_tokens_with_another_tokenizer_is_refused(tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2"}])
    argv = [
        "--input",
        source,
        "--output-prefix",
        str(tmp_path / "o"),
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "10",
        "--tokenizer-hf-no-include-special-tokens",
    ]
    with pytest.raises(SystemExit):
        preprocess_data.main(argv)
    assert "HuggingFaceTokenizer only" in capsys.readouterr().err
