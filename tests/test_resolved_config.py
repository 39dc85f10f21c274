"""resolve() returns a ResolvedConfig: the defaults that depend on other fields are filled and
typed as always set, and --vocab-size as given stays apart from the model's vocabulary."""

import dataclasses
import typing

import pytest

from megatron_ul.arguments import parse_args
from megatron_ul.checkpoint.training.save import special_token_ids
from megatron_ul.config import Config, ResolvedConfig, resolve
from megatron_ul.training.data import build_tokenizer_for, eod_token_for
from tests.data.fixtures import byte_level_gpt2_files, hf_tokenizer_folder

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]


def _optional(annotation) -> bool:
    return type(None) in typing.get_args(annotation) or annotation is type(None)


def test_the_fields_resolve_fills_are_set_and_typed_as_always_set():
    given = parse_args(
        MODEL
        + [
            "--mock-data",
            "--vocab-size",
            "100",
            "--seq-length",
            "48",
            "--micro-batch-size",
            "3",
            "--train-iters",
            "7",
        ],
        world_size=4,
    )
    assert given.train.global_batch_size is None and given.train.lr_decay_iters is None
    assert given.model.max_position_embeddings is None
    cfg = resolve(given)
    assert isinstance(cfg, ResolvedConfig)
    assert cfg.train.global_batch_size == 12  # micro 3 × DP 4
    assert cfg.train.lr_decay_iters == 7 and cfg.model.max_position_embeddings == 48
    assert cfg.num_micro_batches == 1
    filled = [
        (cfg.train, ("global_batch_size", "lr_decay_iters")),
        (cfg.model, ("max_position_embeddings",)),
    ]
    for section, names in filled:
        hints = typing.get_type_hints(type(section))
        flags = typing.get_type_hints(type(section).__mro__[1])  # the flag section
        for name in names:
            assert _optional(flags[name]) and not _optional(hints[name]), name
    assert given.train.global_batch_size is None  # resolve() copies, the input is kept


def _resolved(argv, tp=1):
    """configure()'s vocabulary step without the data files: the tokenizer the flags name,
    built from the flags as given, hands its vocabulary to resolve()."""
    given = parse_args(MODEL + argv + ["--tensor-model-parallel-size", str(tp)], world_size=tp)
    tokenizer = build_tokenizer_for(given.data, given.model.vocab_size)
    return resolve(given, tokenizer.vocab_size if tokenizer else None), tokenizer


@pytest.mark.parametrize(
    "kind,given_vocab,model_vocab,padded,eod",
    [
        # NullTokenizer --vocab-size N: ids 0..N-1 and EOD N (Megatron-LM), padded to 8 × TP 2
        ("NullTokenizer", 100, 101, 112, 100),
        # the byte-level GPT-2 files: 256 bytes, 4 merges, <|endoftext|> last
        ("GPT2BPETokenizer", 0, 261, 272, 260),
        # the Hugging Face folder: a 400-piece BPE, </s> = 2
        ("HuggingFaceTokenizer", 0, 400, 400, 2),
    ],
)
def test_the_given_and_the_model_vocabulary_are_separate_fields(
    tmp_path, kind, given_vocab, model_vocab, padded, eod
):
    flags = ["--tokenizer-type", kind, "--make-vocab-size-divisible-by", "8"]
    if kind == "NullTokenizer":
        flags += ["--vocab-size", str(given_vocab)]
    elif kind == "GPT2BPETokenizer":
        vocab_file, merge_file, _ = byte_level_gpt2_files(str(tmp_path))
        flags += ["--vocab-file", vocab_file, "--merge-file", merge_file]
    else:
        pytest.importorskip("tokenizers")  # builds the folder (the hf extra has it)
        flags += ["--tokenizer-model", hf_tokenizer_folder(str(tmp_path / "hf"))]
    cfg, tokenizer = _resolved(flags + ["--data-path", str(tmp_path / "d")], tp=2)
    assert (cfg.data.given_vocab_size, cfg.model.vocab_size) == (given_vocab, model_vocab)
    assert cfg.model.padded_vocab_size(2) == padded
    # Built again from the resolved config (no cache in between), the tokenizer is the same
    # one: the run's EOD and the one recorded for exports are the tokenizer's.
    rebuilt = build_tokenizer_for(cfg.data, cfg.data.given_vocab_size)
    assert (rebuilt.vocab_size, rebuilt.eod) == (tokenizer.vocab_size, eod)
    assert eod_token_for(cfg) == eod
    assert special_token_ids(cfg)["eos_token_id"] == eod


def test_mock_data_keeps_the_given_vocabulary_and_its_last_id_as_eod():
    cfg, _ = _resolved(
        ["--mock-data", "--vocab-size", "50", "--make-vocab-size-divisible-by", "16"]
    )
    assert (cfg.data.given_vocab_size, cfg.model.vocab_size) == (50, 50)
    assert cfg.model.padded_vocab_size(1) == 64
    assert eod_token_for(cfg) == 49 and special_token_ids(cfg)["eos_token_id"] == 49


def test_a_config_built_in_code_resolves_like_its_command_line():
    from_flags = resolve(parse_args(MODEL + ["--mock-data", "--vocab-size", "64"], world_size=1))
    built = Config()
    built.model = dataclasses.replace(
        built.model, num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64
    )
    built.data.mock_data = True
    assert resolve(built) == from_flags
