"""End to end through the command line: real text -> tokenizer -> .bin/.idx -> pretrain_gpt.py
under torchrun with Ulysses SP, loss falling; bad flags fail fast with exit code 2."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(
        args, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300, **kw
    )


def _prepare_corpus(tmp_path):
    """A small real-text corpus that does not change with this repository: a fixed set of the
    Python standard library's own packages."""
    stdlib = os.path.dirname(os.__file__)
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w") as out:
        for package in ("json", "email", "logging", "http"):
            for name in sorted(os.listdir(os.path.join(stdlib, package))):
                if name.endswith(".py"):
                    with open(os.path.join(stdlib, package, name)) as f:
                        out.write(json.dumps({"text": f.read()}) + "\n")
    r = _run(
        [
            sys.executable,
            "-m",
            "tools.train_tokenizer",
            "--input",
            str(corpus),
            "--model-prefix",
            str(tmp_path / "tok"),
            "--vocab-size",
            "500",
        ]
    )
    assert r.returncode == 0, r.stderr
    r = _run(
        [
            sys.executable,
            "-m",
            "tools.preprocess_data",
            "--input",
            str(corpus),
            "--output-prefix",
            str(tmp_path / "code"),
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            str(tmp_path / "tok.model"),
            "--append-eod",
            "--workers",
            "1",
        ]
    )
    assert r.returncode == 0, r.stderr
    return tmp_path / "code_text_document", tmp_path / "tok.model"


def test_trains_on_real_text_with_sequence_parallelism(tmp_path):
    prefix, model = _prepare_corpus(tmp_path)
    r = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "pretrain_gpt.py",
            "--data-path",
            str(prefix),
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            str(model),
            "--data-cache-path",
            str(tmp_path / "cache"),
            "--ds-sequence-parallel-size",
            "2",
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "64",
            "--micro-batch-size",
            "4",
            "--global-batch-size",
            "8",
            "--train-iters",
            "40",
            "--lr",
            "5e-3",
            "--lr-warmup-iters",
            "4",
            "--log-interval",
            "1",
            "--position-embedding-type",
            "rope",
            "--tensorboard-dir",
            str(tmp_path / "tb"),
        ]
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"lm loss ([0-9.E+-]+)", r.stdout)]
    assert len(losses) == 40
    assert losses[-1] < losses[0] - 1.0, losses  # visibly learning
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "grad-norm", "tokens-per-sec"} <= tags, tags
    assert len(events.Scalars("lm loss")) == 40


def test_bad_flags_fail_fast_naming_the_flag():
    r = _run(
        [
            sys.executable,
            "pretrain_gpt.py",
            "--mock-data",
            "--vocab-size",
            "100",
            "--num-attention-heads",
            "6",
            "--hidden-size",
            "64",
        ]
    )
    assert r.returncode == 2
    assert "--hidden-size 64 is not divisible by --num-attention-heads 6" in r.stderr
    assert "iteration" not in r.stdout  # nothing was trained


@pytest.mark.slow  # a subprocess; in process: tests/data/test_data_checks.py
def test_missing_data_files_fail_before_training(tmp_path):
    r = _run(
        [
            sys.executable,
            "pretrain_gpt.py",
            "--data-path",
            str(tmp_path / "nothing"),
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "100",
        ]
    )
    assert r.returncode == 2
    assert "--data-path: missing" in r.stderr and "preprocess_data.py" in r.stderr
