"""Legacy Megatron-LM interop (checkpoint/interop/megatron_lm.py): a model of ours exported to the
legacy format (TP2·PP2 shards, language_model.* names, word_embeddings_for_head) and imported
back has bitwise equal parameters and logits (GPT-2 and Llama variants); a checkpoint laid
out as Megatron-LM's own code views its tensors (per-group q, k, v rows; [gate_r; up_r] per TP
rank; Megatron-DeepSpeed's *_layernorm names) imports to the right q, k, v, gate and up."""

import argparse
import importlib.util
import os
import re

import pytest
import torch

from megatron_ul.checkpoint import files
from megatron_ul.checkpoint.interop.megatron_lm import export_megatron, import_megatron
from megatron_ul.checkpoint.layout import reshard
from megatron_ul.inference.generate import load_for_generation
from megatron_ul.training.pretrain import configure, setup
from tests.checkpoint.runs import NO_DROPOUT, TINY

LLAMA = [
    "--position-embedding-type",
    "rope",
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--untie-embeddings-and-output-weights",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--num-attention-heads",
    "8",
    "--disable-bias-linear",
]


def _logits(load_dir: str, vocab: int) -> torch.Tensor:
    model = load_for_generation(load_dir)
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(tokens, torch.arange(16).expand(2, 16))[..., :vocab]


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
def test_round_trip_through_the_legacy_format_is_exact(variant, tmp_path, single_rank):
    src, tp2pp2, meg, back = (str(tmp_path / n) for n in ("src", "tp2pp2", "meg", "back"))
    argv = (
        TINY
        + NO_DROPOUT
        + ["--num-layers", "4", "--train-iters", "1", "--lr-warmup-iters", "0", "--save", src]
    )
    setup(configure(argv + (LLAMA if variant == "llama" else []), 1)).train()
    reshard.convert(src, tp2pp2, tp=2, pp=2)
    export_megatron(tp2pp2, meg)

    iter_dir = os.path.join(meg, "iter_0000001")
    assert sorted(os.listdir(iter_dir)) == [
        "mp_rank_00_000",
        "mp_rank_00_001",
        "mp_rank_01_000",
        "mp_rank_01_001",
    ]
    last = torch.load(files.model_file(iter_dir, 1, 1, 2), weights_only=False)
    assert last["checkpoint_version"] == 3.0 and last["args"].tensor_model_parallel_size == 2
    encoder = last["model"]["language_model"]["encoder"]
    assert "layers.0.self_attention.query_key_value.weight" in encoder  # local numbering
    assert "layers.2.input_norm.weight" not in encoder and "final_norm.weight" in encoder
    if variant == "gpt2":  # tied: the last stage's head copy
        assert last["model"]["word_embeddings_for_head"]["weight"].shape[0] == 224 // 2
    else:
        assert "output_layer" in last["model"]["language_model"]

    import_megatron(meg, back)
    a, b = (
        reshard.read_full(os.path.join(src, "iter_0000001"), False),
        reshard.read_full(os.path.join(back, "iter_0000001"), False),
    )
    assert a.params.keys() == b.params.keys()
    assert all(torch.equal(a.params[n], b.params[n]) for n in a.params)
    diff = float((_logits(src, 200) - _logits(back, 200)).abs().max())
    print(f"{variant}: max |logit diff| after our -> Megatron-LM TP2·PP2 -> our: {diff}")
    assert diff == 0.0


def test_megatron_views_of_fused_tensors_import_to_the_right_pieces(tmp_path, single_rank):
    """Built the way Megatron-LM's legacy ParallelAttention / ParallelMLP read their TP shards:
    query_key_value rows of rank r are, per local query group, its q heads then k then v
    (view(sq, b, ng, (np/ng + 2)·hn)); dense_h_to_4h rows are [gate_r; up_r]."""
    tp, layers, h, heads, groups, hn, ffn, vocab = 2, 2, 32, 8, 2, 4, 48, 64
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    full = {
        i: {
            "q": rand(heads * hn, h),
            "k": rand(groups * hn, h),
            "v": rand(groups * hn, h),
            "gate": rand(ffn, h),
            "up": rand(ffn, h),
            "proj": rand(h, heads * hn),
            "down": rand(h, ffn),
            "n1": rand(h),
            "n2": rand(h),
        }
        for i in range(layers)
    }
    emb, head, final = rand(vocab, h), rand(vocab, h), rand(h)
    args = argparse.Namespace(
        num_layers=layers,
        hidden_size=h,
        num_attention_heads=heads,
        kv_channels=hn,
        group_query_attention=True,
        num_query_groups=groups,
        ffn_hidden_size=ffn,
        seq_length=16,
        max_position_embeddings=16,
        padded_vocab_size=vocab,
        make_vocab_size_divisible_by=32,
        position_embedding_type="rope",
        rotary_base=10000,
        normalization="RMSNorm",
        norm_epsilon=1e-5,
        swiglu=True,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
    )
    per_rank_g = groups // tp
    iter_dir = tmp_path / "meg" / "iter_0000005"
    for r in range(tp):
        encoder = {}
        for i, t in full.items():
            rows = []
            for group in range(r * per_rank_g, (r + 1) * per_rank_g):
                q_per_group = heads // groups * hn
                rows += [
                    t["q"][group * q_per_group : (group + 1) * q_per_group],
                    t["k"][group * hn : (group + 1) * hn],
                    t["v"][group * hn : (group + 1) * hn],
                ]

            def cut(x, r=r):
                return x.chunk(tp, dim=0)[r]

            encoder.update(
                {
                    f"layers.{i}.input_layernorm.weight": t["n1"],  # Megatron-DeepSpeed
                    f"layers.{i}.self_attention.query_key_value.weight": torch.cat(rows),
                    f"layers.{i}.self_attention.dense.weight": t["proj"].chunk(tp, dim=1)[r],
                    f"layers.{i}.post_attention_layernorm.weight": t["n2"],
                    f"layers.{i}.mlp.dense_h_to_4h.weight": torch.cat(
                        [cut(t["gate"]), cut(t["up"])]
                    ),
                    f"layers.{i}.mlp.dense_4h_to_h.weight": t["down"].chunk(tp, dim=1)[r],
                }
            )
        encoder["final_layernorm.weight"] = final
        model = {
            "language_model": {
                "embedding": {"word_embeddings": {"weight": emb.chunk(tp)[r]}},
                "encoder": encoder,
                "output_layer": {"weight": head.chunk(tp)[r]},
            }
        }
        path = files.model_file(str(iter_dir), r, 0, 1)
        os.makedirs(os.path.dirname(path))
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 5, "model": model}, path)
    files.write_tracker(str(tmp_path / "meg"), 5)

    import_megatron(str(tmp_path / "meg"), str(tmp_path / "ours"))
    ours = reshard.read_full(str(tmp_path / "ours" / "iter_0000005"), False)
    assert ours.metadata["model"]["vocab_size"] == vocab  # the padded size Megatron used
    for i, t in full.items():
        qkv = ours.params[f"layers.{i}.attention.qkv.weight"].view(
            groups, heads // groups + 2, hn, h
        )
        assert torch.equal(qkv[:, :-2].reshape(-1, h), t["q"])
        assert torch.equal(qkv[:, -2].reshape(-1, h), t["k"])
        assert torch.equal(qkv[:, -1].reshape(-1, h), t["v"])
        assert torch.equal(
            ours.params[f"layers.{i}.mlp.fc1.weight"], torch.cat([t["gate"], t["up"]])
        )
        assert torch.equal(ours.params[f"layers.{i}.input_norm.weight"], t["n1"])
    assert torch.equal(ours.params["output_layer.weight"], head)
    assert torch.equal(ours.params["final_norm.weight"], final)


def test_export_refuses_a_rotary_base_the_legacy_model_ignores(tmp_path, single_rank):
    """Megatron-LM's legacy model always computes RoPE with base 10000."""
    from megatron_ul.checkpoint.files import CheckpointError

    src = str(tmp_path / "src")
    setup(
        configure(
            TINY
            + [
                "--train-iters",
                "1",
                "--lr-warmup-iters",
                "0",
                "--save",
                src,
                "--position-embedding-type",
                "rope",
                "--rotary-base",
                "500000",
            ],
            1,
        )
    ).train()
    with pytest.raises(CheckpointError, match="--rotary-base 500000.*base 10000"):
        export_megatron(src, str(tmp_path / "meg"))
    assert not (tmp_path / "meg").exists()


def test_exported_args_and_flags_are_megatron_lms(tmp_path, single_rank):
    """Mock data is Megatron's NullTokenizer: --vocab-size V - 1 ids plus EOD; the args carry
    what check_checkpoint_args compares; --rotary-base (ignored by the legacy model) is not
    printed as a float; the legacy format needs --ckpt-format torch."""
    src, meg = str(tmp_path / "src"), str(tmp_path / "meg")
    one_iter = ["--train-iters", "1", "--lr-warmup-iters", "0", "--save", src]
    setup(configure(TINY + LLAMA + one_iter, 1)).train()
    _, flags = export_megatron(src, meg)
    args = torch.load(
        files.model_file(os.path.join(meg, "iter_0000001"), 0, 0, 1), weights_only=False
    )["args"]
    assert (args.tokenizer_type, args.vocab_size, args.padded_vocab_size) == (
        "NullTokenizer",
        199,
        208,
    )
    assert args.add_position_embedding and args.rotary_base == 10000
    text = " ".join(flags)
    assert "--ckpt-format torch" in text and "--use-legacy-models" in text
    assert "--tokenizer-type NullTokenizer --vocab-size 199" in text
    assert "--rotary-base" not in text and "10000.0" not in text
    # importing Megatron's NullTokenizer args keeps the EOD row (id 199)
    import_megatron(meg, str(tmp_path / "back"))
    back = reshard.read_full(os.path.join(tmp_path / "back", "iter_0000001"), False)
    assert back.metadata["model"]["vocab_size"] == 200


def _megatron_like_file(path, extra=None):
    """A file pickled as Megatron-LM writes one, made without the megatron package: its enums
    (module megatron.core.enums) and numpy's RNG state in the args and rng_state."""
    import enum
    import signal
    import sys
    import types

    import numpy as np

    modules = {
        name: types.ModuleType(name)
        for name in ("megatron", "megatron.core", "megatron.core.enums")
    }
    model_type = enum.Enum("ModelType", {"encoder_or_decoder": 1})
    model_type.__module__ = "megatron.core.enums"
    modules["megatron.core.enums"].ModelType = model_type
    saved = {name: sys.modules[name] for name in modules if name in sys.modules}
    sys.modules.update(modules)
    try:
        args = argparse.Namespace(
            model_type=model_type.encoder_or_decoder, exit_signal=signal.SIGTERM, extra=extra
        )
        torch.save(
            {"args": args, "rng_state": [{"np_rng_state": np.random.get_state()}], "model": {}},
            path,
        )
    finally:
        for name in modules:
            sys.modules.pop(name)
        sys.modules.update(saved)  # an installed megatron-core stays importable


def test_restricted_loader_reads_megatron_enums_and_numpy_rng_state(tmp_path):
    from megatron_ul.checkpoint.interop import megatron_pickle

    path = str(tmp_path / "model_optim_rng.pt")
    _megatron_like_file(path)
    state = megatron_pickle.load(path)
    model_type = state["args"].model_type
    assert model_type.value == 1
    # the stand-in, or megatron-core's own enum where that is already imported
    real_name = f"{type(model_type).__module__}.{type(model_type).__name__}"
    assert getattr(model_type, "enum_name", real_name) == "megatron.core.enums.ModelType"
    assert state["rng_state"][0]["np_rng_state"][1].dtype.name == "uint32"


def test_restricted_loader_refuses_any_other_object_naming_the_file(tmp_path):
    import datetime

    from megatron_ul.checkpoint.files import CheckpointError
    from megatron_ul.checkpoint.interop import megatron_pickle

    path = str(tmp_path / "model_optim_rng.pt")
    _megatron_like_file(path, extra=datetime.date(2024, 1, 1))
    refused = re.escape(path) + r": cannot be read safely \(it pickles datetime.date"
    with pytest.raises(CheckpointError, match=refused):
        megatron_pickle.load(path)
    if importlib.util.find_spec("megatron") is None:  # full unpickling needs Megatron's enums
        with pytest.raises(CheckpointError, match="module 'megatron'"):
            megatron_pickle.load(path, trust_pickle=True)
    else:
        loaded = megatron_pickle.load(path, trust_pickle=True)
        assert loaded["args"].extra == datetime.date(2024, 1, 1)


def test_megatron_deepspeed_converted_checkpoint_imports(tmp_path, single_rank):
    """The layout Megatron-DeepSpeed's tools/convert_checkpoint/deepspeed_to_megatron.py writes
    from a DeepSpeed-engine checkpoint (constructed here with its key layout, not produced by
    its code): per-stage `layers.i` with the `*_layernorm` spellings, `final_layernorm` in the
    last stage's encoder, `word_embeddings_for_head` there, PP2. Imports to our parameters
    bit for bit."""
    src, meg, back = (str(tmp_path / n) for n in ("src", "meg", "back"))
    argv = (
        TINY
        + NO_DROPOUT
        + ["--num-layers", "4", "--train-iters", "1", "--lr-warmup-iters", "0", "--save", src]
    )
    setup(configure(argv, 1)).train()
    iter_dir, _ = export_megatron(src, meg, tp=1, pp=2)
    spellings = {
        "input_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "final_norm": "final_layernorm",
    }
    for stage in range(2):
        path = files.model_file(iter_dir, 0, stage, 2)
        state = torch.load(path, weights_only=False)
        encoder = state["model"]["language_model"]["encoder"]
        renamed = {}
        for key, tensor in encoder.items():
            for ours, theirs in spellings.items():
                key = key.replace(f"{ours}.", f"{theirs}.")
            renamed[key] = tensor
        assert any("input_layernorm" in k for k in renamed)
        state["model"]["language_model"]["encoder"] = renamed
        torch.save(state, path)
    import_megatron(meg, back)
    a, b = (reshard.read_full(os.path.join(d, "iter_0000001"), False) for d in (src, back))
    assert a.params.keys() == b.params.keys()
    assert all(torch.equal(a.params[n], b.params[n]) for n in a.params)
