"""The layer spec (model/layer_spec.py) is the one place a layer's modules are chosen: a norm
defined and registered here, in the test only, builds, trains, and is counted by the memory
estimator and the parameter table with no edit to either."""

from dataclasses import asdict
from typing import get_args, get_type_hints

import pytest
import torch

from megatron_ul.checkpoint.files import CheckpointError
from megatron_ul.checkpoint.interop import hf, megatron_core, megatron_lm
from megatron_ul.config import ModelConfig
from megatron_ul.model.gpt import GPTModel
from megatron_ul.model.layer_spec import NORMS, described_layer, layer_spec
from megatron_ul.model.mlp import MLP, SwiGLUMLP
from megatron_ul.model.norms import Norm
from megatron_ul.model.transformer import TransformerLayer
from megatron_ul.mpu.parallel_state import single_rank_dims
from megatron_ul.mpu.param_init import Constant, new_parameter
from megatron_ul.mpu.random import model_parallel_seed
from megatron_ul.pipeline.param_table import parameter_table
from megatron_ul.training import memory_estimator as me
from tools.bench.saved_bytes import saved_activation_bytes


class ScaleNorm(Norm):
    """Nguyen & Salazar's ScaleNorm, g · x / ||x|| · sqrt(h), written naively: one scalar
    weight, and autograd keeps both x and x / ||x|| (two [s, b, h] tensors)."""

    def create_parameters(self, size, device, dtype):
        self.weight = new_parameter(Constant(1.0), (1,), device=device, dtype=dtype)

    def forward(self, x):
        unit = x / x.norm(dim=-1, keepdim=True).clamp_min(self.eps)
        return unit * (self.weight * self.size[0] ** 0.5)

    def saved_bytes(self, shape):
        return 2 * shape.norm_tokens * self.size[0] * shape.residual_bytes


H, S, B = 64, 128, 2


def _model(normalization: str, **extra) -> ModelConfig:
    return ModelConfig(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=4,
        seq_length=S,
        position_embedding_type="rope",  # (a learned table is built through a slow first import)
        vocab_size=256,
        normalization=normalization,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        **extra,
    )


@pytest.fixture
def scale_norm(monkeypatch):
    monkeypatch.setitem(NORMS, "ScaleNorm", ScaleNorm)


def test_the_norms_are_the_configs_choices():
    choices = get_args(get_type_hints(ModelConfig)["normalization"])
    assert set(NORMS) == set(choices)
    assert layer_spec(_model("RMSNorm", swiglu=True)).mlp is SwiGLUMLP
    assert layer_spec(_model("LayerNorm")).mlp is MLP


def test_a_windowed_layer_is_described():
    # The window is a list: the description's cache must still take the config.
    windowed = _model("RMSNorm", window_size=[16, 0])
    assert described_layer(windowed).attention is not None
    assert described_layer(windowed) is described_layer(_model("RMSNorm", window_size=[16, 0]))


def test_an_unknown_norm_names_the_flag():
    with pytest.raises(ValueError, match="--normalization 'ScaleNorm'"):
        layer_spec(_model("ScaleNorm"))


def test_a_new_norm_runs_forward_and_backward(scale_norm):
    cfg, dims = _model("ScaleNorm"), single_rank_dims()
    model_parallel_seed(0, dims)
    model = GPTModel(cfg, seed=3, dims=dims)
    tokens = torch.randint(0, cfg.vocab_size, (B, S))
    positions = torch.arange(S).expand(B, S)
    loss = model(tokens, positions, labels=torch.roll(tokens, -1, 1)).mean()
    loss.backward()
    assert torch.isfinite(loss)
    for name in ("layers.0.input_norm.weight", "final_norm.weight"):
        grad = dict(model.named_parameters())[name].grad
        assert grad.shape == (1,) and grad.abs().item() > 0, name


def test_the_parameter_table_and_the_estimator_count_a_new_norm(scale_norm):
    cfg = _model("ScaleNorm")
    model = GPTModel(cfg, seed=3, dims=single_rank_dims())
    held = {name: tuple(p.shape) for name, p in model.named_parameters()}
    table = parameter_table(cfg)
    assert {name: tuple(e["shape"]) for name, e in table.items()} == held
    assert table["layers.1.post_attention_norm.weight"]["partition_dim"] is None
    assert me.stage_parameters(cfg, 1, 1) == sum(p.numel() for p in model.parameters())
    # With LayerNorm: 2·h parameters per norm instead of 1, in 2 layers × 2 norms + the final.
    layer_norm = me.stage_parameters(_model("LayerNorm"), 1, 1)
    assert layer_norm - me.stage_parameters(cfg, 1, 1) == 5 * (2 * H - 1)


def _measured_layer_saved_bytes(cfg: ModelConfig) -> int:
    torch.manual_seed(0)
    layer = TransformerLayer(cfg, 1, 3, False, dims=single_rank_dims(), spec=layer_spec(cfg))
    x = torch.randn(S, B, H, requires_grad=True)
    _, saved = saved_activation_bytes(lambda: layer(x), exclude=layer.parameters())
    return saved


def test_the_estimator_counts_what_a_new_norm_keeps(scale_norm):
    """Against a measurement: ScaleNorm in place of RMSNorm changes one layer's saved bytes by
    what autograd really keeps (the estimate leaves out RMSNorm's per-token reciprocal RMS,
    1/h of its input: the tolerance)."""
    layout, precision = me.Layout(micro_batch_size=B), me.Precision()

    def estimated(cfg):
        return me.layer_activation_bytes(cfg, layout, precision)

    scale, rms = _model("ScaleNorm"), _model("RMSNorm")
    measured = _measured_layer_saved_bytes(scale) - _measured_layer_saved_bytes(rms)
    assert measured > 0
    assert estimated(scale) - estimated(rms) == pytest.approx(measured, rel=1.5 / H)


def test_the_checkpoint_formats_refuse_a_norm_they_do_not_have():
    """Hugging Face and Megatron exports map our slot names to theirs: a norm of ours with no
    counterpart there must be refused, not written under their norm's name."""
    m = asdict(_model("ScaleNorm", swiglu=True, add_bias_linear=False))
    for export in (megatron_lm.check_exportable, megatron_core.check_exportable):
        with pytest.raises(CheckpointError, match="--normalization ScaleNorm"):
            export(m)
    with pytest.raises(CheckpointError, match="not Llama shaped"):
        hf.ours_to_llama({}, m)
    with pytest.raises(CheckpointError, match="not GPT-2 shaped"):
        hf.ours_to_gpt2({}, {**m, "swiglu": False, "add_bias_linear": True})
