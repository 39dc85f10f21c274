"""Both HuggingFaceTokenizer paths against Megatron-LM's own tools/preprocess_data.py,
byte for byte (optional reference: MEGATRON_LM_DIR, a checkout of 0.16 or later, run by
megatron_lm_preprocess_launcher.py; the installed megatron-core need not match).

Megatron-LM 0.16/0.17: its default (include_special_tokens False) is our
--tokenizer-hf-no-include-special-tokens, its --legacy-tokenizer our default. 0.18+: its
default (special tokens included) is ours, and --tokenizer-hf-no-include-special-tokens the
same flag. Checked with core_v0.16.1 and core_v0.19.0.
"""

import os
import subprocess
import sys

import pytest

from tests.data.fixtures import hf_tokenizer_folder, read_pair, write_jsonl
from tests.data.test_data_preprocess_vs_megatron_lm import texts_with_empties
from tools import preprocess_data

MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR")
SCRIPT = os.path.join(MEGATRON_LM_DIR or "", "tools", "preprocess_data.py")
LAUNCHER = os.path.join(os.path.dirname(__file__), "megatron_lm_preprocess_launcher.py")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not MEGATRON_LM_DIR
        or not os.path.isdir(os.path.join(MEGATRON_LM_DIR, "megatron", "core", "tokenizers")),
        reason="MEGATRON_LM_DIR (a Megatron-LM checkout of 0.16 or later) not set",
    ),
]
NO_SPECIAL = "--tokenizer-hf-no-include-special-tokens"


def _pairs() -> list:
    """[(their flags, our flags)] that must write the same bytes with this checkout."""
    with open(SCRIPT) as f:
        legacy = "legacy_tokenizer" in f.read()  # 0.16/0.17; gone from 0.18
    if legacy:
        return [
            ([], [NO_SPECIAL]),
            (["--legacy-tokenizer"], []),
            (["--legacy-tokenizer"], ["--legacy-tokenizer"]),
        ]
    return [([], []), ([NO_SPECIAL], [NO_SPECIAL])]


def test_both_tokenizer_paths_same_bytes_as_megatron_lm(tmp_path):
    folder = hf_tokenizer_folder(str(tmp_path / "hf"))
    source = write_jsonl(tmp_path / "in.jsonl", texts_with_empties())
    common = [
        "--input",
        source,
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        folder,
        "--append-eod",
        "--workers",
        "1",
    ]
    for i, (theirs, ours) in enumerate(_pairs()):
        env = dict(os.environ, PYTHONPATH=MEGATRON_LM_DIR, PYTHONWARNINGS="ignore")
        result = subprocess.run(
            [
                sys.executable,
                LAUNCHER,
                SCRIPT,
                *common,
                "--output-prefix",
                str(tmp_path / f"theirs{i}"),
                *theirs,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert (
            preprocess_data.main([*common, "--output-prefix", str(tmp_path / f"ours{i}"), *ours])
            == 0
        )
        assert read_pair(tmp_path / f"ours{i}_text_document") == read_pair(
            tmp_path / f"theirs{i}_text_document"
        ), (theirs, ours)
