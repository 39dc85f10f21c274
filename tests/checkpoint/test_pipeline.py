"""Checkpoints under pipeline parallelism: exact resume is in test_resume.py (TP2·PP2 and
interleaved PP2); here a TP2·PP2 checkpoint with tied embeddings converted to PP1, back to PP2
interleaved, and resharded on load to PP4 continues the original loss curve within 1e-5, and
a PP2 checkpoint exports to Hugging Face GPT-2 with matching logits."""

import os

import pytest
import torch

from tests.checkpoint.runs import (
    NO_DROPOUT,
    TINY,
    assert_continues_the_curve,
    convert_pipeline_chain,
)
from tests.distributed import run_distributed
from tests.training.equivalence import run_layout

FOUR_LAYERS = TINY + NO_DROPOUT + ["--num-layers", "4"]


def test_interleaved_stage_names_follow_the_runtime_assignment():
    """Chunks of 1 layer on PP2: stage 0 runs layers 0 and 2, stage 1 layers 1 and 3 (the
    pipeline's chunk c·PP + r rule), and the last stage gets the tied table's replica."""
    from megatron_ul.config import ModelConfig
    from megatron_ul.pipeline.param_table import parameter_table, stage_parameter_names

    model = ModelConfig(num_layers=4, max_position_embeddings=16, vocab_size=100)

    def stage(s, pp=2, vp=1, **kw):
        table = parameter_table(ModelConfig(**{**model.__dict__, **kw}), 1, pp, vp)
        return [
            n
            for n in stage_parameter_names(table, s)
            if n.endswith("fc1.weight") or "word_embeddings" in n
        ]

    assert stage(0) == [
        "word_embeddings.weight",
        "layers.0.mlp.fc1.weight",
        "layers.2.mlp.fc1.weight",
    ]
    assert stage(1) == [
        "layers.1.mlp.fc1.weight",
        "replica.word_embeddings.weight",
        "layers.3.mlp.fc1.weight",
    ]
    assert "replica.word_embeddings.weight" not in stage(
        1, untie_embeddings_and_output_weights=True
    )


def test_bad_virtual_pipeline_target_is_refused_before_writing(tmp_path, single_rank):
    from megatron_ul.checkpoint.files import CheckpointError
    from megatron_ul.checkpoint.layout.reshard import convert
    from megatron_ul.training.pretrain import configure, setup

    src = str(tmp_path / "src")
    one_iter = ["--train-iters", "1", "--lr-warmup-iters", "0", "--save", src]
    setup(configure(TINY + one_iter, 1)).train()
    with pytest.raises(
        CheckpointError,
        match="refused by the trainer(.|\n)*--num-layers-per-virtual-pipeline-stage = 2×3",
    ):
        convert(src, str(tmp_path / "out"), tp=1, pp=2, vp=3)
    assert not os.path.exists(tmp_path / "out")


def test_pipeline_conversions_continue_the_loss_curve(tmp_path):
    out = run_distributed(convert_pipeline_chain, 4, FOUR_LAYERS, str(tmp_path))[0]
    assert_continues_the_curve(out)


def _logits(model, tokens, vocab):
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, pos)[:, :, :vocab].transpose(0, 1)


def test_pp2_checkpoint_exports_to_hugging_face_and_generates(tmp_path, single_rank):
    """Train PP2 (tied embeddings) and save; the trained parameters, gathered by their global
    names straight from the ranks, loaded into a PP1 GPTModel by module name, give the logits
    of the Hugging Face export and of the generation loader (both read the checkpoint)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from megatron_ul.checkpoint.files import METADATA, read_json
    from megatron_ul.checkpoint.interop.hf import export_checkpoint
    from megatron_ul.config import ModelConfig
    from megatron_ul.inference.generate import load_for_generation
    from megatron_ul.model.gpt import GPTModel

    save = str(tmp_path / "pp2")
    _, trained = run_layout(
        TINY
        + NO_DROPOUT
        + ["--train-iters", "2", "--save", save, "--pipeline-model-parallel-size", "2"],
        2,
    )
    meta = read_json(os.path.join(save, "iter_0000002", METADATA), "metadata")
    assert meta["layout"]["pp"] == 2 and "replica.word_embeddings.weight" in meta["params"]
    ours = GPTModel(ModelConfig(**meta["model"]), seed=0, dims=single_rank).eval()
    params = dict(ours.named_parameters())
    assert params.keys() == trained.keys()  # global names are the PP1 module names
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(trained[name])
    export_checkpoint(save, str(tmp_path / "hf"))
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    vocab = meta["model"]["vocab_size"]
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(2))
    reference = _logits(ours, tokens, vocab)
    with torch.no_grad():
        hf_diff = float((theirs(tokens).logits - reference).abs().max())
    gen_diff = float((_logits(load_for_generation(save), tokens, vocab) - reference).abs().max())
    print(f"PP2 -> HF GPT-2 max |logit diff| {hf_diff:.2e}; generation loader {gen_diff:.2e}")
    assert hf_diff < 1e-5 and gen_diff < 1e-5
