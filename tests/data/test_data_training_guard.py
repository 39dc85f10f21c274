"""Training and the data's tokenizer: data a vocabulary cannot hold is refused, and a checkpoint
records the tokenizer (type, files and vocabulary size) it was trained with."""

import glob
import os
import subprocess
import sys

import torch

from tests.data.fixtures import write_jsonl
from tools import preprocess_data

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = [
    "--num-layers",
    "1",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "2",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "2",
    "--lr",
    "1e-3",
    "--log-interval",
    "1",
]


def pretrain(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, "pretrain_gpt.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_vocabulary_guard_and_tokenizer_in_checkpoint(tmp_path):
    records = [{"text": " ".join(str((i * 13 + j) % 100) for j in range(40))} for i in range(30)]
    source = write_jsonl(tmp_path / "in.jsonl", records)
    assert (
        preprocess_data.main(
            [
                "--input",
                source,
                "--output-prefix",
                str(tmp_path / "d"),
                "--tokenizer-type",
                "NullTokenizer",
                "--vocab-size",
                "100",
                "--append-eod",
            ]
        )
        == 0
    )
    prefix = str(tmp_path / "d_text_document")
    # configure() gives the model NullTokenizer's vocabulary (N + 1); training's EOD stays N.
    from megatron_ul.training.data import eod_token_for
    from megatron_ul.training.pretrain import configure

    cfg = configure(
        [
            "--data-path",
            prefix,
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "100",
            "--train-iters",
            "1",
            "--lr-warmup-iters",
            "0",
            *MODEL,
        ],
        world_size=1,
    )
    assert cfg.model.vocab_size == 101 and eod_token_for(cfg) == 100
    # Ids 0..99 and EOD 100 do not fit a NullTokenizer vocabulary of 50 + EOD.
    refused = pretrain(
        "--data-path",
        prefix,
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "50",
        "--train-iters",
        "1",
        "--lr-warmup-iters",
        "0",
        *MODEL,
    )
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert f"--data-path {prefix}: token id 100 does not fit the vocabulary of 51" in refused.stderr
    assert "iteration" not in refused.stdout
    trained = pretrain(
        "--data-path",
        prefix,
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "100",
        "--train-iters",
        "1",
        "--lr-warmup-iters",
        "0",
        "--save",
        str(tmp_path / "ckpt"),
        "--save-interval",
        "1",
        *MODEL,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    # No --data-cache-path: indices are cached beside the data.
    assert os.path.isdir(tmp_path / "index_cache" / "GPTDataset_indices")
    payloads = glob.glob(str(tmp_path / "ckpt" / "**" / "*.pt"), recursive=True)
    saved = [torch.load(path, weights_only=False) for path in payloads]
    args = [
        payload["args"] for payload in saved if isinstance(payload, dict) and "args" in payload
    ][0]
    assert args["data"]["tokenizer_type"] == "NullTokenizer" and args["model"]["vocab_size"] == 101
