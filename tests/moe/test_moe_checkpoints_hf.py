"""Hugging Face Mixtral import and export (checkpoint/interop/hf_moe.py) against transformers'
own MixtralForCausalLM: our exported MoE model loaded by transformers gives our logits, a
transformers-built Mixtral imported gives its logits, and export then import returns every
weight bit for bit."""

import json
import os

import pytest
import torch

from megatron_ul.checkpoint import files
from megatron_ul.checkpoint.files import CheckpointError
from megatron_ul.checkpoint.interop import HuggingFaceMixtral, MegatronUl
from megatron_ul.checkpoint.interop.base import Options, convert
from megatron_ul.checkpoint.interop.hf_moe import mixtral_to_ours
from megatron_ul.checkpoint.interop.settings import check_carried
from tests.checkpoint import conftest as checkpoint_fixtures
from tests.checkpoint.runs import NO_DROPOUT, TINY
from tests.checkpoint.test_megatron_core import LLAMA, SEQ, VOCAB, _model_of, _our_logits, _tokens

single_rank = checkpoint_fixtures.single_rank  # the one-rank gloo group's fixture
MIXTRAL = LLAMA + ["--num-experts", "4", "--moe-router-topk", "2", "--ffn-hidden-size", "48"]


def _train(save: str, extra: list) -> None:
    from megatron_ul.training.pretrain import configure, setup

    argv = TINY + NO_DROPOUT + ["--train-iters", "2", "--lr-warmup-iters", "0", "--save", save]
    setup(configure(argv + extra, 1)).train()


def _stage(save_dir: str, iteration: int) -> dict:
    path = files.model_file(os.path.join(save_dir, files.iteration_dir_name(iteration)), 0, 0, 1)
    return torch.load(path, weights_only=False)["model"]


def _hf_logits(hf_dir: str) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    model = transformers.MixtralForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(_tokens()).logits[..., :VOCAB]


def test_mixtral_export_gives_our_logits_and_imports_back_bit_exact(tmp_path, single_rank):
    pytest.importorskip("transformers")
    src, hf_dir, back = (str(tmp_path / n) for n in ("src", "hf", "back"))
    _train(src, MIXTRAL)
    convert(MegatronUl(), HuggingFaceMixtral(), src, hf_dir, Options())
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    assert config["num_local_experts"] == 4 and config["num_experts_per_tok"] == 2
    theirs, ours = _hf_logits(hf_dir), _our_logits(src)
    diff = float((theirs - ours).abs().max())
    print(f"export: max |logit diff| {diff:.2e} (logits up to {float(ours.abs().max()):.2f})")
    assert diff <= 1e-5
    convert(HuggingFaceMixtral(), MegatronUl(), hf_dir, back, Options())
    m = _model_of(back)
    assert (m["num_experts"], m["moe_router_topk"]) == (4, 2)
    a, b = (_stage(d, i) for d, i in ((src, 2), (back, 0)))
    assert set(a) == set(b)
    for name in a:  # padded vocabulary rows are outside the softmax: import pads zeros
        rows = VOCAB if name in ("word_embeddings.weight", "output_layer.weight") else None
        assert torch.equal(a[name][:rows], b[name][:rows]), name


def test_transformers_mixtral_imports_with_its_logits(tmp_path, single_rank):
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_theta=10000.0,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # init leaves norms at 1: perturb everything
            p.add_(0.05 * torch.randn_like(p))
    hf_dir, ours = str(tmp_path / "hf"), str(tmp_path / "ours")
    model.save_pretrained(hf_dir, safe_serialization=True)
    convert(HuggingFaceMixtral(), MegatronUl(), hf_dir, ours, Options())
    with torch.no_grad():
        theirs = model(_tokens()).logits
    diff = float((_our_logits(ours) - theirs).abs().max())
    print(f"import: max |logit diff| {diff:.2e}")
    assert diff <= 1e-5
    # transformers' in-memory (fused) expert tensors map to the same weights as the files
    fused = mixtral_to_ours(model.state_dict(), _model_of(ours))
    saved = _stage(ours, 0)
    for name, t in fused.items():
        assert torch.equal(t, saved[name][: t.shape[0]]), name


def test_mixtral_export_refuses_what_mixtral_cannot_compute():
    from dataclasses import asdict

    from megatron_ul.config import ModelConfig

    m = asdict(ModelConfig(vocab_size=100, num_experts=4, swiglu=True))
    for change, flag in [
        ({"moe_router_pre_softmax": True}, "--moe-router-pre-softmax"),
        ({"moe_shared_expert_intermediate_size": 16}, "--moe-shared-expert-intermediate-size"),
        ({"moe_expert_capacity_factor": 1.0}, "--moe-expert-capacity-factor"),
    ]:
        with pytest.raises(CheckpointError, match=flag):
            check_carried({**m, **change}, "hf_mixtral", "Hugging Face Mixtral")
