"""Every model setting is mapped or refused by every converter (checkpoint/interop/settings.py,
hf.py), against megatron-core's and transformers' own modules.

References: megatron-core's GPTModel built from a checkpoint's args as Megatron-LM builds it
(megatron_core.core_model_from_args), its state_dict()/dist_checkpointing writers, and
transformers' MistralForCausalLM. CPU shims, each numerically neutral: torch.cuda.current_device
is the CPU where megatron-core's attention takes a scratch buffer; its sliding-window mask is
made with torch.ones(device="cuda"), made on the CPU here; torch.compile is disabled so its
fused bias-GELU (a @torch.compile Python function) runs the same ops eagerly.
"""

import contextlib
import dataclasses
import enum
import os
import sys

import pytest
import torch

from megatron_ul.checkpoint import files
from megatron_ul.checkpoint.files import CheckpointError
from megatron_ul.checkpoint.interop import (
    megatron_common,
    megatron_core,
    megatron_lm,
    megatron_pickle,
)
from megatron_ul.checkpoint.interop import settings as interop_settings
from megatron_ul.checkpoint.interop.megatron_core import export_core, import_core
from megatron_ul.config import ModelConfig
from tests.checkpoint.runs import NO_DROPOUT, TINY
from tests.checkpoint.test_megatron_core import (
    LLAMA,
    SEQ,
    VOCAB,
    _core_logits,
    _model_of,
    _our_logits,
    _tokens,
)
from tools.checkpoint import megatron_core as core_tool

GPT2_NO_BIAS = ["--disable-bias-linear"]


def _train(save: str, extra: list, layers: int = 2) -> dict:
    from megatron_ul.training.pretrain import configure, setup

    argv = TINY + NO_DROPOUT + ["--num-layers", str(layers), "--train-iters", "1"]
    setup(configure(argv + ["--lr-warmup-iters", "0", "--save", save] + extra, 1)).train()
    return _model_of(save)


@contextlib.contextmanager
def _cpu_shims():
    """The CPU shims of the module docstring, undone afterwards."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved = (torch.cuda.current_device, torch.ones, tracker.fork, torch._dynamo.config.disable)
    make_ones = torch.ones
    torch.cuda.current_device = lambda: "cpu"
    torch.ones = lambda *a, device=None, **k: make_ones(
        *a, device="cpu" if str(device).startswith("cuda") else device, **k
    )
    tracker.fork = lambda *a, **k: contextlib.nullcontext()  # dropout is 0
    torch._dynamo.config.disable = True
    try:
        yield
    finally:
        (torch.cuda.current_device, torch.ones, tracker.fork, torch._dynamo.config.disable) = saved


@pytest.fixture
def core_state(single_rank):
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    with _cpu_shims():
        yield
    parallel_state.destroy_model_parallel()


# ---- the tables cover every field --------------------------------------------------------------
def test_every_transformer_config_field_is_mapped_refused_or_without_effect():
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    from megatron.core.transformer.transformer_config import TransformerConfig

    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(names - set(interop_settings.CORE_FIELDS))
    assert not unknown, f"classify these megatron-core settings in CORE_FIELDS: {unknown}"
    for name, kind in interop_settings.CORE_FIELDS.items():
        if isinstance(kind, tuple) and kind[0] == "with":
            assert interop_settings.CORE_FIELDS[kind[1]][0] == "refused", name


def test_refused_settings_are_off_at_megatron_core_defaults():
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    from megatron.core.transformer.transformer_config import TransformerConfig

    defaults = {
        f.name: f.default for f in dataclasses.fields(TransformerConfig) if f.default is not None
    }
    for name, kind in interop_settings.CORE_FIELDS.items():
        # (settings read from an args field of another name have that field's neutral values)
        if isinstance(kind, tuple) and kind[0] == "refused" and name in defaults and not kind[1]:
            assert defaults[name] in kind[3], (name, defaults[name])


# one non-default value per ModelConfig field that changes the logits; a new field fails here
# until it is given one (and so is carried or refused by each converter)
NON_DEFAULT = {
    "num_layers": 3,
    "hidden_size": 96,
    "num_attention_heads": 6,
    "ffn_hidden_size": 40,
    "num_query_groups": 2,
    "kv_channels": 8,
    "seq_length": 64,
    "max_position_embeddings": 256,
    "vocab_size": 300,
    "make_vocab_size_divisible_by": 64,
    "position_embedding_type": "rope",
    "rotary_base": 500000.0,
    "normalization": "RMSNorm",
    "norm_epsilon": 1e-6,
    "swiglu": True,
    "add_bias_linear": False,
    "untie_embeddings_and_output_weights": True,
    "gelu_approximate": "tanh",
    "window_size": [8, 0],
    "num_experts": 4,
    "moe_ffn_hidden_size": 24,
    "moe_router_topk": 1,
    "moe_layer_freq": 2,
    "moe_router_pre_softmax": True,
    "moe_shared_expert_intermediate_size": 16,
    "moe_expert_capacity_factor": 1.0,
    "moe_token_drop_policy": "position",
    "moe_pad_expert_input_to_capacity": True,
    "sparse_attention": "fixed",
    "sparse_block_size": 8,
    "sparse_attention_direction": "bidirectional",
    "sparse_different_layout_per_head": True,
    "sparse_num_local_blocks": 2,
    "sparse_num_global_blocks": 2,
    "sparse_horizontal_global_attention": True,
    "sparse_num_different_global_patterns": 2,
    "sparse_num_random_blocks": 2,
    "sparse_num_sliding_window_blocks": 2,
    "sparse_local_window_blocks": [2],
    "sparse_global_block_indices": [1],
    "sparse_global_block_end_indices": [2],
}


@pytest.mark.parametrize("converter", sorted(interop_settings.OURS))
def test_every_model_setting_is_carried_or_refused(converter):
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unclassified = names - interop_settings.OUR_NO_EFFECT - set(NON_DEFAULT)
    assert not unclassified, f"new model settings: give them a value here: {unclassified}"
    base = dataclasses.asdict(ModelConfig(vocab_size=100))
    for name, value in NON_DEFAULT.items():
        m = {**base, name: value}
        if name == "rotary_base":
            m["position_embedding_type"] = "rope"
        if name == "gelu_approximate":
            m["swiglu"] = False
        if name.startswith("moe_"):  # an expert setting computes only in an MoE model
            m["num_experts"] = 4
        if name in interop_settings.OURS[converter]:
            interop_settings.check_carried(m, converter, "the target")
        else:
            flag = interop_settings._FLAGS[name]
            with pytest.raises(CheckpointError, match=flag):
                interop_settings.check_carried(m, converter, "the target")


def test_every_hugging_face_config_key_is_mapped_refused_or_without_effect():
    transformers = pytest.importorskip("transformers")
    from megatron_ul.checkpoint.interop import hf

    for kind, cls in [
        ("gpt2", transformers.GPT2Config),
        ("llama", transformers.LlamaConfig),
        ("mistral", transformers.MistralConfig),
    ]:
        keys = set(cls().to_dict())
        unknown = sorted(keys - set(hf.HF_KEYS[kind]) - hf.HF_NO_EFFECT)
        assert not unknown, f"{kind}: classify {unknown} in hf.HF_KEYS or HF_NO_EFFECT"


def test_unknown_hugging_face_setting_is_refused_naming_it():
    from megatron_ul.checkpoint.interop import hf

    config = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 50}
    config.update(n_positions=32, scale_attn_by_inverse_layer_idx=True)
    with pytest.raises(CheckpointError, match="scale_attn_by_inverse_layer_idx"):
        hf.gpt2_model_config(config)
    with pytest.raises(CheckpointError, match="quantization_config"):
        hf.gpt2_model_config(
            {**config, "scale_attn_by_inverse_layer_idx": False, "quantization_config": {"bits": 4}}
        )


# ---- megatron-core: refused settings, windows, GELU ---------------------------------------------
def _core_args(m: dict, fmt: str = "torch", **changes):
    args = megatron_common.megatron_args(m, 1, 1, 3, {}, core=(fmt, "local"))
    for k, v in changes.items():
        setattr(args, k, v)
    return args


def _save_core_args(model, args, fmt: str, save_dir: str) -> None:
    """As Megatron-LM's save_checkpoint lays a TP1/PP1 checkpoint out, by megatron-core."""
    from megatron.core import dist_checkpointing

    iter_dir = os.path.join(save_dir, files.iteration_dir_name(3))
    common = {"args": args, "checkpoint_version": 3.0, "iteration": 3}
    if fmt == "torch":
        path = files.model_file(iter_dir, 0, 0, 1)
        os.makedirs(os.path.dirname(path))
        torch.save({**common, "model": model.state_dict()}, path)
    else:
        os.makedirs(iter_dir)
        with megatron_core._cpu_only_shims():
            dist_checkpointing.save({**common, "model": model.sharded_state_dict()}, iter_dir)
    files.write_tracker(save_dir, 3)


def _perturbed(args):
    model = megatron_core.core_model_from_args(args)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.mark.parametrize(
    "setting",
    [
        ("no_rope_freq", 2, "--no-rope-freq"),
        ("qk_layernorm", True, "--qk-layernorm"),
        ("window_attn_skip_freq", 2, "--window-attn-skip-freq"),
        ("softmax_type", "learnable", "--softmax-type"),
        ("rotary_percent", 0.5, "--rotary-percent"),
        ("num_experts", 4, "--num-experts"),
    ],
)
def test_megatron_core_setting_we_do_not_compute_is_refused_naming_it(setting, tmp_path):
    name, value, flag = setting
    m = dataclasses.asdict(
        ModelConfig(vocab_size=VOCAB, max_position_embeddings=SEQ, seq_length=SEQ)
    )
    args = _core_args({**m, "position_embedding_type": "rope"}, **{name: value})
    iter_dir = os.path.join(str(tmp_path / "core"), files.iteration_dir_name(3))
    path = files.model_file(iter_dir, 0, 0, 1)
    os.makedirs(os.path.dirname(path))
    torch.save({"args": args, "iteration": 3, "model": {}}, path)
    files.write_tracker(str(tmp_path / "core"), 3)
    with pytest.raises(CheckpointError, match=flag):
        import_core(str(tmp_path / "core"), str(tmp_path / "ours"))
    assert not os.path.exists(tmp_path / "ours")


@pytest.mark.parametrize(
    "bias,fusion,openai,expected",
    [
        (False, False, True, "none"),  # bias-free --openai-gelu: megatron-core computes erf
        (True, True, False, "tanh"),  # the fused bias-GELU kernel is the tanh approximation
        (True, False, False, "none"),
    ],
)
def test_gelu_is_what_megatron_core_computes(bias, fusion, openai, expected, tmp_path, core_state):
    m = dataclasses.asdict(
        ModelConfig(vocab_size=VOCAB, max_position_embeddings=SEQ, seq_length=SEQ)
    )
    m.update(add_bias_linear=bias, hidden_size=32, num_attention_heads=4)
    args = _core_args(m, bias_gelu_fusion=fusion, openai_gelu=openai, add_qkv_bias=bias)
    model = _perturbed(args)
    _save_core_args(model, args, "torch", str(tmp_path / "core"))
    import_core(str(tmp_path / "core"), str(tmp_path / "ours"))
    assert _model_of(str(tmp_path / "ours"))["gelu_approximate"] == expected
    diff = float((_our_logits(str(tmp_path / "ours")) - _core_logits(model)).abs().max())
    print(f"bias={bias} fusion={fusion} openai={openai}: max |logit diff| {diff:.2e}")
    assert diff <= 1e-5


def test_bias_free_tanh_gelu_export_to_megatron_core_is_refused(tmp_path, single_rank):
    src = str(tmp_path / "src")
    _train(src, GPT2_NO_BIAS + ["--gelu-approximate", "tanh"])
    with pytest.raises(CheckpointError, match="tanh"):
        export_core(src, str(tmp_path / "core"), "torch", "local")
    assert not os.path.exists(tmp_path / "core")


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_window_survives_megatron_core_export_and_import(fmt, tmp_path, single_rank):
    """Exported with --window-size 4,0 in args and flags; megatron-core's own model built
    from those args computes our logits; its window checkpoint imports back with the window."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    src, core, back = (str(tmp_path / n) for n in ("src", "core", "back"))
    m = _train(src, LLAMA + ["--window-size", "4", "0"])
    iter_dir, flags = export_core(src, core, fmt, "local")
    assert "--window-size 4,0" in " ".join(flags)
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    try:
        with _cpu_shims():
            args = megatron_common.megatron_args(m, 1, 1, 1, {}, core=(fmt, "local"))
            assert args.window_size == (4, 0)
            model = megatron_core.core_model_from_args(args)
            if fmt == "torch":
                state = torch.load(files.model_file(iter_dir, 0, 0, 1), weights_only=False)
                assert tuple(state["args"].window_size) == (4, 0)
                model.load_state_dict(state["model"], strict=True)
            else:
                loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, iter_dir)
                model.load_state_dict(loaded["model"], strict=True)
            theirs = _core_logits(model)
            full = megatron_core.core_model_from_args(
                megatron_common.megatron_args(
                    {**m, "window_size": None}, 1, 1, 1, {}, core=(fmt, "local")
                )
            )
            full.load_state_dict(model.state_dict(), strict=True)
            without = float((_core_logits(full) - theirs).abs().max())
    finally:
        parallel_state.destroy_model_parallel()
    diff = float((_our_logits(src) - theirs).abs().max())
    print(f"{fmt} window export: max |logit diff| {diff:.2e} (without the window: {without:.2e})")
    assert diff <= 1e-5 and without > 1e-2
    import_core(core, back)
    assert _model_of(back)["window_size"] == [4, 0]
    assert torch.equal(_our_logits(back), _our_logits(src))


def test_window_export_to_legacy_megatron_is_refused(tmp_path, single_rank):
    src = str(tmp_path / "src")
    _train(src, ["--position-embedding-type", "rope", "--window-size", "4", "0"])
    with pytest.raises(CheckpointError, match="--window-size"):
        megatron_lm.export_megatron(src, str(tmp_path / "legacy"))
    assert not os.path.exists(tmp_path / "legacy")


# ---- megatron-core export on a CPU-only machine --------------------------------------------------
def test_torch_dist_export_runs_without_cuda_and_names_its_layout(tmp_path, single_rank, capsys):
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    src, core = str(tmp_path / "src"), str(tmp_path / "core")
    _train(src, LLAMA)
    real = torch.cuda.current_device
    assert core_tool.main(["export", "--load-dir", src, "--save-dir", core]) == 0
    assert torch.cuda.current_device is real  # the shims are undone
    printed = capsys.readouterr().out
    assert "torch_dist written by megatron-core" in printed and "Megatron-LM" in printed
    assert os.path.isfile(os.path.join(core, "iter_0000001", "metadata.json"))


def test_failed_torch_dist_export_leaves_nothing(tmp_path, single_rank, monkeypatch):
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    from megatron.core import dist_checkpointing

    src, core = str(tmp_path / "src"), str(tmp_path / "core")
    _train(src, LLAMA)

    def fail(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(dist_checkpointing, "save", fail)
    with pytest.raises(OSError):
        export_core(src, core, "torch_dist")
    assert not os.path.exists(core)


# ---- Megatron-LM 0.16-0.19 args pickles ---------------------------------------------------------
# The enum members each release leaves in args (megatron/training/arguments.py of each tag):
# 0.16/0.17 parse --cuda-graph-scope into CudaGraphScope members; 0.18/0.19 parse
# --cuda-graph-modules into CudaGraphModule and always set --inference-cuda-graph-scope
# (InferenceCudaGraphScope, 'none' = 1 by default), and record null_tokenizer_eod_id.
_ENUMS_0_19 = {
    "CudaGraphModule": {
        "attn": 1,
        "mlp": 2,
        "moe": 3,
        "moe_router": 4,
        "moe_preprocess": 5,
        "mamba": 6,
    },
    "InferenceCudaGraphScope": {"none": 1, "layer": 2, "block": 3},
}
RELEASES = {
    "0.16": {"cuda_graph_scope": [("CudaGraphScope", "attn")]},
    "0.17": {"cuda_graph_scope": [("CudaGraphScope", "mlp")]},
    "0.18": {
        "cuda_graph_modules": [("CudaGraphModule", "attn")],
        "inference_cuda_graph_scope": ("InferenceCudaGraphScope", "none"),
        "null_tokenizer_eod_id": None,
    },
    "0.19": {
        "cuda_graph_modules": [],
        "inference_cuda_graph_scope": ("InferenceCudaGraphScope", "block"),
        "null_tokenizer_eod_id": None,
    },
}


@pytest.fixture
def release_enums(monkeypatch):
    """(megatron.core.transformer.enums with the installed megatron-core's own classes and the
    0.18+ ones it lacks defined there as those releases define them, the names added)."""
    enums = pytest.importorskip("megatron.core.transformer.enums")
    added = []
    for name, members in _ENUMS_0_19.items():
        if not hasattr(enums, name):
            monkeypatch.setattr(
                enums, name, enum.Enum(name, members, module=enums.__name__), raising=False
            )
            added.append(name)
    return enums, added


def _value(enums, spec):
    if isinstance(spec, list):
        return [_value(enums, s) for s in spec]
    if isinstance(spec, tuple):
        return getattr(getattr(enums, spec[0]), spec[1])
    return spec


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_megatron_lm_release_checkpoint_imports_without_trust_pickle(
    release, tmp_path, core_state, release_enums, monkeypatch
):
    """A checkpoint with each release's args (enums, NullTokenizer --vocab-size 199, the
    attention backend, signal) imports with the restricted loader; with --trust-pickle and
    a class the installed megatron-core lacks, the failure is a message."""
    import signal

    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    m = dataclasses.asdict(
        ModelConfig(vocab_size=VOCAB, max_position_embeddings=SEQ, seq_length=SEQ)
    )
    args = _core_args(m, vocab_size=199 if release < "0.18" else 200)
    args.model_type, args.attention_backend = ModelType.encoder_or_decoder, AttnBackend.auto
    args.exit_signal = signal.SIGTERM
    enums, added = release_enums
    for name, spec in RELEASES[release].items():
        setattr(args, name, _value(enums, spec))
    model = _perturbed(args)
    _save_core_args(model, args, "torch", str(tmp_path / "core"))
    # the rest of what Megatron-LM's save_checkpoint puts in the file (RNG state with numpy's
    # arrays; with the rerun machine on, its enums; an optimizer config)
    import random

    import numpy as np
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.rerun_state_machine import RerunMode

    path = files.model_file(os.path.join(str(tmp_path / "core"), "iter_0000003"), 0, 0, 1)
    state = torch.load(path, weights_only=False)
    state["rng_state"] = [
        {
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
        }
    ]
    state["rerun_state_machine"] = {"mode": list(RerunMode)[-1]}
    state["optimizer"] = {"config": OptimizerConfig(lr=3e-4)}
    torch.save(state, path)
    # megatron-core registers its classes with torch's weights_only loader when imported;
    # the allowlist must stand on its own
    registered = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        import_core(str(tmp_path / "core"), str(tmp_path / "ours"))
    finally:
        torch.serialization.add_safe_globals(registered)
    assert _model_of(str(tmp_path / "ours"))["vocab_size"] == 200  # both: 200 real rows
    diff = float((_our_logits(str(tmp_path / "ours")) - _core_logits(model)).abs().max())
    assert diff <= 1e-5
    if release >= "0.18" and "InferenceCudaGraphScope" in added:
        # full unpickling with the installed megatron-core, which lacks the class
        monkeypatch.delattr(enums, "InferenceCudaGraphScope")
        with pytest.raises(CheckpointError, match="full unpickling failed"):
            import_core(str(tmp_path / "core"), str(tmp_path / "o2"), trust_pickle=True)


def test_allowlist_names_every_enum_of_the_releases():
    allowed = {name for _, name in megatron_pickle.ALLOWED}
    for name in ["CudaGraphScope", *_ENUMS_0_19, "AttnBackend"]:
        assert f"megatron.core.transformer.enums.{name}" in allowed


# ---- uneven pipeline split in the torch format --------------------------------------------------
@pytest.mark.parametrize("first,last", [(1, None), (None, 1), (2, 1)])
def test_uneven_pipeline_split_torch_format_imports(first, last, tmp_path, core_state):
    """Stage files of a 4-layer model split unevenly over PP2/PP3, as megatron-core's
    get_transformer_layer_offset places the layers (local numbering per stage), import with
    megatron-core's logits."""
    layers, pp = 4, 3 if (first and last) else 2
    m = dataclasses.asdict(
        ModelConfig(vocab_size=VOCAB, max_position_embeddings=SEQ, seq_length=SEQ)
    )
    m["num_layers"] = layers
    args = _core_args(m, pipeline_model_parallel_size=pp)
    args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers = first, last
    # the whole model in one piece (megatron-core's stage split is the slow PP2 test's)
    model = _perturbed(_core_args(m))
    full = model.state_dict()
    if pp == 2:
        counts = [first, layers - first] if first else [layers - last, last]
    else:
        counts = [first, layers - first - last, last]
    iter_dir = os.path.join(str(tmp_path / "core"), files.iteration_dir_name(3))
    start = 0
    for stage, count in enumerate(counts):
        state = {}
        for key, tensor in full.items():
            if key.startswith("decoder.layers."):
                index, rest = key[len("decoder.layers.") :].split(".", 1)
                if start <= int(index) < start + count:
                    state[f"decoder.layers.{int(index) - start}.{rest}"] = tensor
            elif key.startswith("embedding.") and stage == 0:
                state[key] = tensor
            elif key.startswith(("decoder.final_layernorm", "output_layer")) and stage == pp - 1:
                state[key] = tensor
        if stage == pp - 1 and "output_layer.weight" not in state:  # tied: the head's copy
            state["output_layer.weight"] = full["embedding.word_embeddings.weight"]
        start += count
        path = files.model_file(iter_dir, 0, stage, pp)
        os.makedirs(os.path.dirname(path))
        torch.save({"args": args, "iteration": 3, "model": state}, path)
    files.write_tracker(str(tmp_path / "core"), 3)
    import_core(str(tmp_path / "core"), str(tmp_path / "ours"))
    diff = float((_our_logits(str(tmp_path / "ours")) - _core_logits(model)).abs().max())
    print(f"uneven first={first} last={last}: max |logit diff| {diff:.2e}")
    assert diff <= 1e-5


def test_gpt2_export_with_another_head_dim_is_refused(tmp_path, single_rank):
    pytest.importorskip("safetensors")
    from megatron_ul.checkpoint.interop.hf import export_checkpoint

    src = str(tmp_path / "src")
    _train(src, ["--kv-channels", "16"])
    with pytest.raises(CheckpointError, match="--kv-channels"):
        export_checkpoint(src, str(tmp_path / "hf"))
    assert not os.path.exists(tmp_path / "hf")


def test_window_exports_to_mistral_that_transformers_applies(tmp_path, single_rank):
    transformers = pytest.importorskip("transformers")
    from megatron_ul.checkpoint.interop.hf import export_checkpoint, import_checkpoint

    src, out, back = (str(tmp_path / n) for n in ("src", "hf", "back"))
    _train(src, LLAMA + ["--window-size", "4", "0"])
    export_checkpoint(src, out)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf_model).__name__ == "MistralForCausalLM"
    with torch.no_grad():
        theirs = hf_model(_tokens()).logits
    diff = float((_our_logits(src) - theirs).abs().max())
    hf_model.config.sliding_window = None  # the same weights without the window
    with torch.no_grad():
        without = float((hf_model(_tokens()).logits - theirs).abs().max())
    print(f"Mistral export: max |logit diff| {diff:.2e} (without the window: {without:.2e})")
    assert diff <= 1e-5 and without > 1e-2
    import_checkpoint(out, back)
    assert _model_of(back)["window_size"] == [4, 0]


def test_gpt2_export_with_window_is_refused(tmp_path, single_rank):
    pytest.importorskip("safetensors")
    from megatron_ul.checkpoint.interop.hf import export_checkpoint

    src = str(tmp_path / "src")
    _train(src, ["--window-size", "4", "0"])
    with pytest.raises(CheckpointError, match="--window-size"):
        export_checkpoint(src, str(tmp_path / "hf"))
    assert not os.path.exists(tmp_path / "hf")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


# ---- PP2 with megatron-core's own pipeline stages (two gloo ranks) ------------------------------
def core_pp_logits(rank: int, world: int, args, iter_dir: str, save: bool, fmt: str = "torch"):
    """On each of `world` ranks: megatron-core's GPTModel stage for pipeline rank `rank` (its
    own layer placement, uneven split included) either loads its stage file strictly or
    (`save`) is perturbed and saves its state_dict() there, as Megatron-LM lays the files out;
    the hidden states go from stage to stage as its schedule sends them. Returns the last
    stage's logits [b, s, padded vocab] (None elsewhere)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    with _cpu_shims():
        parallel_state.initialize_model_parallel(1, world)
        torch.manual_seed(5)
        try:
            model = megatron_core.core_model_from_args(
                args, pre_process=rank == 0, post_process=rank == world - 1
            )
            path = files.model_file(iter_dir, 0, rank, world)
            if save:
                g = torch.Generator().manual_seed(11 + rank)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.05 * torch.randn(p.shape, generator=g))
                if fmt == "torch_dist":  # every stage's sharded tensors, globally numbered
                    import multiprocessing

                    from megatron.core import dist_checkpointing

                    # its writer starts a multiprocessing Manager, which a daemonic process
                    # (these rank workers) may not; the flag only guards that check
                    multiprocessing.current_process()._config["daemon"] = False  # type: ignore[attr-defined]

                    os.makedirs(iter_dir, exist_ok=True)
                    state = {"args": args, "checkpoint_version": 3.0, "iteration": 3}
                    with megatron_core._cpu_only_shims():
                        dist_checkpointing.save(
                            {**state, "model": model.sharded_state_dict()}, iter_dir
                        )
                else:
                    os.makedirs(os.path.dirname(path))
                    state = {"args": args, "iteration": 3, "model": model.state_dict()}
                    torch.save(state, path)
            else:
                state = torch.load(path, weights_only=False)
                model.load_state_dict(state["model"], strict=True)
            model.eval()
            causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
            if rank > 0:
                hidden = torch.empty(SEQ, 2, args.hidden_size)
                dist.recv(hidden, rank - 1)
                model.set_input_tensor(hidden)
            with torch.no_grad():
                out = model(
                    input_ids=_tokens(),
                    position_ids=torch.arange(SEQ).expand(2, SEQ),
                    attention_mask=causal,
                )
            if rank < world - 1:
                dist.send(out.contiguous(), rank + 1)
                return None
            return out.float()
        finally:
            parallel_state.destroy_model_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("first,fmt", [(None, "torch"), (1, "torch"), (1, "torch_dist")])
def test_pp2_checkpoints_match_megatron_core_pipeline_stages(first, fmt, tmp_path, single_rank):
    """Our PP2 torch-format export loads into megatron-core's own two pipeline stages with our
    logits; their perturbed stages' state_dict() files (even split, and --decoder-first-
    pipeline-num-layers 1 placed by megatron-core itself) import with theirs."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    from tests.distributed import run_distributed

    src, out, saved, ours = (str(tmp_path / n) for n in ("src", "core", "saved", "ours"))
    m = _train(src, LLAMA, layers=3 if first else 4)
    if first is None:
        iter_dir, _ = export_core(src, out, "torch", "local", tp=1, pp=2)
        args = megatron_common.megatron_args(m, 1, 2, 1, {}, core=("torch", "local"))
        theirs = run_distributed(core_pp_logits, 2, args, iter_dir, False)[-1]
        diff = float((_our_logits(src) - theirs[..., :VOCAB]).abs().max())
        print(f"PP2 export: max |logit diff| ours vs megatron-core stages: {diff:.2e}")
        assert diff <= 1e-5
    args = megatron_common.megatron_args(m, 1, 2, 3, {}, core=(fmt, "local"))
    args.decoder_first_pipeline_num_layers = first
    saved_iter = os.path.join(saved, files.iteration_dir_name(3))
    theirs = run_distributed(core_pp_logits, 2, args, saved_iter, True, fmt)[-1]
    files.write_tracker(saved, 3)
    import_core(saved, ours)
    diff = float((_our_logits(ours) - theirs[..., :VOCAB]).abs().max())
    print(f"PP2 {fmt} (first stage {first}) import: max |logit diff| {diff:.2e}")
    assert diff <= 1e-5


# ---- legacy Megatron-LM ------------------------------------------------------------------------
def _legacy_checkpoint(tmp_path, m: dict, **changes) -> str:
    """A legacy (use_legacy_models) stage file whose args carry `changes`; no tensors needed
    to reach the settings check."""
    args = megatron_common.megatron_args(m, 1, 1, 3, {})
    for k, v in changes.items():
        setattr(args, k, v)
    load = str(tmp_path / "legacy")
    path = files.model_file(os.path.join(load, files.iteration_dir_name(3)), 0, 0, 1)
    os.makedirs(os.path.dirname(path))
    torch.save({"args": args, "iteration": 3, "model": {"language_model": {}}}, path)
    files.write_tracker(load, 3)
    return load


@pytest.mark.parametrize(
    "name,value,flag",
    [
        ("squared_relu", True, "--squared-relu"),
        ("apply_layernorm_1p", True, "--apply-layernorm-1p"),
    ],
)
def test_legacy_setting_we_do_not_compute_is_refused(name, value, flag, tmp_path):
    m = dataclasses.asdict(
        ModelConfig(vocab_size=VOCAB, max_position_embeddings=SEQ, seq_length=SEQ)
    )
    load = _legacy_checkpoint(tmp_path, m, **{name: value})
    with pytest.raises(CheckpointError, match=flag):
        megatron_lm.import_megatron(load, str(tmp_path / "ours"))
    assert not os.path.exists(tmp_path / "ours")


def test_legacy_window_is_read_as_the_full_attention_it_computed(caplog):
    m = dataclasses.asdict(
        ModelConfig(vocab_size=VOCAB, max_position_embeddings=SEQ, seq_length=SEQ)
    )
    args = megatron_common.megatron_args(m, 1, 1, 3, {})
    args.window_size = (4, 0)
    assert megatron_common.model_config_from_args(args)["window_size"] is None
    assert "ignores" in caplog.text
    core_args = megatron_common.megatron_args(m, 1, 1, 3, {}, core=("torch", "local"))
    core_args.window_size = (4, 0)
    assert megatron_common.model_config_from_args(core_args, core=True)["window_size"] == [4, 0]
    core_args.window_size = (4, 2)
    with pytest.raises(CheckpointError, match="causal windows only"):
        megatron_common.model_config_from_args(core_args, core=True)
