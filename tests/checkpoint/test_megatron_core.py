"""megatron-core GPTModel interop (checkpoint/interop/megatron_core.py), against megatron-core
itself.

Reference: megatron-core's own GPTModel (local layer spec, CPU, fp32), loaded by its own code
(load_state_dict strict for --ckpt-format torch, dist_checkpointing.load for torch_dist), and
checkpoints written by its own code (state_dict() / dist_checkpointing.save) from a GPTModel
whose parameters are all perturbed (so a swapped norm or q/k/v row would show). The args in the
files the tests write are built by our exporter's megatron_args (Megatron-LM's training loop is
not run here). The megatron-core tests skip without megatron-core; the layout round trip needs
nothing extra.
"""

import contextlib
import os

import pytest
import torch

from megatron_ul.checkpoint import files
from megatron_ul.checkpoint.files import CheckpointError
from megatron_ul.checkpoint.interop import megatron_common, megatron_core
from megatron_ul.checkpoint.interop.megatron_core import export_core, import_core
from megatron_ul.checkpoint.layout import reshard
from megatron_ul.inference.generate import load_for_generation
from megatron_ul.training.pretrain import configure, setup
from tests.checkpoint.runs import NO_DROPOUT, TINY
from tools.checkpoint import megatron_core as tool

LLAMA = [
    "--position-embedding-type",
    "rope",
    "--rotary-base",
    "500000",
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
VARIANTS = {"gpt2": [], "llama": LLAMA}
VOCAB, SEQ = 200, 16
# Llama-style covers GQA, RoPE, SwiGLU, RMSNorm and the untied head; GPT-2 (tied, learned
# positions, LayerNorm with biases, GELU) runs with --run-slow
CORE_VARIANTS = [pytest.param("gpt2", marks=pytest.mark.slow), "llama"]


def _train(variant: str, save: str, layers: int = 4) -> None:
    argv = (
        TINY
        + NO_DROPOUT
        + [
            "--num-layers",
            str(layers),
            "--train-iters",
            "1",
            "--lr-warmup-iters",
            "0",
            "--save",
            save,
        ]
    )
    setup(configure(argv + VARIANTS[variant], 1)).train()


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))


def _our_logits(load_dir: str) -> torch.Tensor:
    model = load_for_generation(load_dir)
    with torch.no_grad():
        logits = model(_tokens(), torch.arange(SEQ).expand(2, SEQ))[..., :VOCAB]
    return logits.transpose(0, 1)  # ours are [s, b, vocab]


def _core_logits(model) -> torch.Tensor:
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    model.eval()
    with torch.no_grad():
        out = model(
            input_ids=_tokens(),
            position_ids=torch.arange(SEQ).expand(2, SEQ),
            attention_mask=causal,
        )
    return out[..., :VOCAB].float()  # [b, s, vocab]


def _model_of(load_dir: str) -> dict:
    iteration = files.read_tracker(load_dir)
    return files.read_metadata(files.find_iteration_dir(load_dir, iteration))["model"]


@pytest.fixture
def core_parallel(single_rank, monkeypatch):
    """megatron-core's TP1/PP1 model-parallel state on the test's one-rank gloo group."""
    core = pytest.importorskip("megatron.core", reason="megatron-core not installed")
    from megatron.core import parallel_state

    # its attention takes a scratch buffer on torch.cuda.current_device(); here that is the CPU
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    # ... and forks the CUDA dropout generator; dropout is 0, so no generator is needed
    if not torch.cuda.is_available():  # its writer waits for host copies: none here
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    from megatron.core import tensor_parallel

    monkeypatch.setattr(
        tensor_parallel.get_cuda_rng_tracker(), "fork", lambda *a, **k: contextlib.nullcontext()
    )
    parallel_state.initialize_model_parallel(1, 1)
    yield core
    parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("variant", CORE_VARIANTS)
def test_export_loads_into_megatron_core_with_the_same_logits(
    variant, fmt, tmp_path, core_parallel
):
    from megatron.core import dist_checkpointing

    src, out = str(tmp_path / "src"), str(tmp_path / "core")
    _train(variant, src)
    iter_dir, flags = export_core(src, out, fmt, "local")
    assert flags[:4] == ["--ckpt-format", fmt, "--transformer-impl", "local"]
    model = megatron_core.core_model(_model_of(src))
    if fmt == "torch":
        state = torch.load(files.model_file(iter_dir, 0, 0, 1), weights_only=False)
        assert state["args"].use_legacy_models is False
        model.load_state_dict(state["model"], strict=True)
    else:
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, iter_dir)
        model.load_state_dict(loaded["model"], strict=True)
    diff = float((_our_logits(src) - _core_logits(model)).abs().max())
    print(f"{variant} {fmt}: max |logit diff| ours vs megatron-core after export: {diff:.2e}")
    assert diff <= 1e-5


def _perturbed_core_model(m: dict, tp: int = 1, seed: int = 11):
    model = megatron_core.core_model(m, tp=tp)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def _save_core(model, m: dict, fmt: str, save_dir: str, iteration: int = 3) -> None:
    """A checkpoint as Megatron-LM's save_checkpoint lays it out, written by megatron-core."""
    from megatron.core import dist_checkpointing
    from megatron.core.enums import ModelType

    args = megatron_common.megatron_args(m, 1, 1, iteration, {}, core=(fmt, "local"))
    args.model_type = ModelType.encoder_or_decoder  # as Megatron-LM's pretrain() records it
    iter_dir = os.path.join(save_dir, files.iteration_dir_name(iteration))
    common = {"args": args, "checkpoint_version": 3.0, "iteration": iteration}
    if fmt == "torch":
        path = files.model_file(iter_dir, 0, 0, 1)
        os.makedirs(os.path.dirname(path))
        torch.save({**common, "model": model.state_dict()}, path)
    else:
        os.makedirs(iter_dir)
        dist_checkpointing.save({**common, "model": model.sharded_state_dict()}, iter_dir)
    files.write_tracker(save_dir, iteration)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("variant", CORE_VARIANTS)
def test_megatron_core_checkpoint_imports_with_the_same_logits(
    variant, fmt, tmp_path, core_parallel
):
    shape_of, core_dir, ours = (
        str(tmp_path / "shape"),
        str(tmp_path / "core"),
        str(tmp_path / "ours"),
    )
    _train(variant, shape_of, layers=2)
    m = _model_of(shape_of)
    model = _perturbed_core_model(m)
    _save_core(model, m, fmt, core_dir)
    out = import_core(core_dir, ours, tp=2, pp=2)
    assert files.read_metadata(out)["layout"]["tp"] == 2
    diff = float((_our_logits(ours) - _core_logits(model)).abs().max())
    print(f"{variant} {fmt}: max |logit diff| ours vs megatron-core after import: {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.parametrize("variant,spec", [("gpt2", "transformer_engine"), ("llama", "local")])
def test_torch_format_tp2_pp2_round_trip_is_exact(variant, spec, tmp_path, single_rank, capsys):
    """Stage files for TP2·PP2 with megatron-core names (local layer numbers, the last stage's
    output_layer, the spec's norm names) import back to the same parameters bit for bit."""
    src, tp2pp2, core, back = (str(tmp_path / n) for n in ("src", "tp2pp2", "core", "back"))
    _train(variant, src)
    reshard.convert(src, tp2pp2, tp=2, pp=2)
    assert (
        tool.main(
            [
                "export",
                "--load-dir",
                tp2pp2,
                "--save-dir",
                core,
                "--ckpt-format",
                "torch",
                "--transformer-impl",
                spec,
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "only the model weights are converted" in printed
    assert f"--ckpt-format torch --transformer-impl {spec}" in printed
    iter_dir = os.path.join(core, "iter_0000001")
    assert sorted(os.listdir(iter_dir)) == [
        "mp_rank_00_000",
        "mp_rank_00_001",
        "mp_rank_01_000",
        "mp_rank_01_001",
    ]
    first = torch.load(files.model_file(iter_dir, 0, 0, 2), weights_only=False)["model"]
    last = torch.load(files.model_file(iter_dir, 1, 1, 2), weights_only=False)["model"]
    norm = (
        "self_attention.linear_qkv.layer_norm_weight"
        if spec == "transformer_engine"
        else "input_layernorm.weight"
    )
    assert (
        f"decoder.layers.1.{norm}" in last and "decoder.layers.2.mlp.linear_fc2.weight" not in last
    )
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert last["output_layer.weight"].shape[0] == 224 // 2  # tied copy or untied head
    assert "decoder.final_layernorm.weight" in last
    assert tool.main(["import", "--load-dir", core, "--save-dir", back]) == 0
    a, b = (reshard.read_full(os.path.join(d, "iter_0000001"), False) for d in (src, back))
    assert a.params.keys() == b.params.keys()
    assert all(torch.equal(a.params[n], b.params[n]) for n in a.params)


def test_unknown_megatron_core_tensor_is_refused_naming_it(tmp_path, single_rank):
    src, core = str(tmp_path / "src"), str(tmp_path / "core")
    _train("gpt2", src, layers=2)
    iter_dir, _ = export_core(src, core, "torch", "local")
    path = files.model_file(iter_dir, 0, 0, 1)
    state = torch.load(path, weights_only=False)
    state["model"]["decoder.layers.0.self_attention.q_layernorm.weight"] = torch.ones(8)
    torch.save(state, path)
    with pytest.raises(CheckpointError, match="q_layernorm"):
        import_core(core, str(tmp_path / "back"))


def test_torch_dist_export_without_megatron_core_says_so(tmp_path, monkeypatch, saved):
    import builtins

    real_import = builtins.__import__

    def no_megatron(name, *args, **kwargs):
        if name.startswith("megatron.core") or name == "megatron":
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_megatron)
    with pytest.raises(CheckpointError, match="needs megatron-core"):
        export_core(saved, str(tmp_path / "core"), "torch_dist")
    assert not os.path.exists(tmp_path / "core")


def core_tp_logits(rank: int, world: int, model: dict, iter_dir: str, save: bool) -> torch.Tensor:
    """On each of `world` ranks: megatron-core's GPTModel at TP `world` either loads its stage
    file of `iter_dir` strictly or (`save`) is perturbed and saves its state_dict() there, as
    Megatron-LM lays the files out; returns its vocabulary-parallel logits
    [b, s, padded_vocab / TP]."""
    import contextlib as ctx

    from megatron.core import parallel_state, tensor_parallel

    torch.cuda.current_device = lambda: "cpu"  # as in core_parallel above
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: ctx.nullcontext()
    parallel_state.initialize_model_parallel(world, 1)
    # replicated parameters (learned positions) come from torch's default generator: the same
    # seed on every rank, as Megatron-LM's training sets it, so the ranks hold one model
    torch.manual_seed(5)
    try:
        path = files.model_file(iter_dir, rank, 0, 1)
        if save:
            core = _perturbed_core_model(model, tp=world)  # same noise: replicas agree
            args = megatron_common.megatron_args(model, world, 1, 3, {}, core=("torch", "local"))
            os.makedirs(os.path.dirname(path))
            torch.save(
                {
                    "args": args,
                    "checkpoint_version": 3.0,
                    "iteration": 3,
                    "model": core.state_dict(),
                },
                path,
            )
        else:
            core = megatron_core.core_model(model, tp=world)
            core.load_state_dict(torch.load(path, weights_only=False)["model"], strict=True)
        causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
        core.eval()
        with torch.no_grad():
            return core(
                input_ids=_tokens(),
                position_ids=torch.arange(SEQ).expand(2, SEQ),
                attention_mask=causal,
            ).float()
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["gpt2", "llama"])
def test_tp2_checkpoints_match_megatron_core_at_tp2(variant, tmp_path, single_rank):
    """megatron-core's own TP2 GPTModel on two gloo ranks (Llama: GQA 8/2, one query group per
    rank, SwiGLU [gate_r; up_r]; GPT-2: MHA, tied) loads our TP2 export, and its perturbed TP2
    state_dict() files import, with the same logits."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    from tests.distributed import run_distributed

    src, out, saved, ours = (str(tmp_path / n) for n in ("src", "core", "saved", "ours"))
    _train(variant, src)
    iter_dir, _ = export_core(src, out, "torch", "local", tp=2, pp=1)
    m = _model_of(src)
    theirs = torch.cat(run_distributed(core_tp_logits, 2, m, iter_dir, False), dim=-1)
    diff = float((_our_logits(src) - theirs[..., :VOCAB]).abs().max())
    print(f"{variant} TP2 export: max |logit diff| ours vs megatron-core TP2: {diff:.2e}")
    assert diff <= 1e-5
    saved_iter = os.path.join(saved, files.iteration_dir_name(3))
    theirs = torch.cat(run_distributed(core_tp_logits, 2, m, saved_iter, True), dim=-1)
    files.write_tracker(saved, 3)
    import_core(saved, ours)
    diff = float((_our_logits(ours) - theirs[..., :VOCAB]).abs().max())
    print(f"{variant} TP2 import: max |logit diff| ours vs megatron-core TP2: {diff:.2e}")
    assert diff <= 1e-5
