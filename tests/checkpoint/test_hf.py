"""Hugging Face import/export: our logits match GPT2LMHeadModel's and LlamaForCausalLM's within
1e-5 (fp32) after import, and theirs match ours after export (vocab padding, tied and untied
heads, GQA, Conv1D transposes and gelu_new all exercised)."""

import pytest
import torch

transformers = pytest.importorskip(
    "transformers",
    reason="transformers is an optional test dependency (pip install -r requirements-dev.txt)",
)
pytest.importorskip("safetensors", reason="safetensors is needed for Hugging Face files")

from megatron_ul.checkpoint import files  # noqa: E402
from megatron_ul.checkpoint.interop.hf import export_checkpoint, import_checkpoint  # noqa: E402
from megatron_ul.checkpoint.training.load import load_checkpoint  # noqa: E402
from megatron_ul.checkpoint.training.save import save_checkpoint  # noqa: E402
from megatron_ul.config import CheckpointConfig, Config, ModelConfig, resolve  # noqa: E402
from megatron_ul.model.gpt import GPTModel  # noqa: E402
from megatron_ul.mpu.parallel_state import single_rank_dims  # noqa: E402

VOCAB = 100  # not a multiple of 128: our table is padded, theirs is not


def _perturb(model):
    """HF inits biases to 0 and norms to 1; make every tensor matter."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def _ours(fields: dict) -> GPTModel:
    cfg = ModelConfig(**{**fields, "attention_dropout": 0.0, "hidden_dropout": 0.0})
    return GPTModel(cfg, seed=3, dims=single_rank_dims()).eval()


def _our_logits(model, tokens):
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, pos)[:, :, :VOCAB].transpose(0, 1)


def _their_logits(hf_model, tokens):
    with torch.no_grad():
        return hf_model(tokens).logits


def _hf_models():
    gpt2 = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        n_positions=32,
        vocab_size=VOCAB,
        resid_pdrop=0,
        embd_pdrop=0,
        attn_pdrop=0,
    )
    llama = dict(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=48,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        rms_norm_eps=1e-5,
        rope_theta=5000.0,
    )
    gpt2_untied = transformers.GPT2Config(**{**gpt2.to_dict(), "tie_word_embeddings": False})
    return {
        "gpt2": lambda: transformers.GPT2LMHeadModel(gpt2),
        "gpt2-untied": lambda: transformers.GPT2LMHeadModel(gpt2_untied),
        "llama-untied": lambda: transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**llama, tie_word_embeddings=False)
        ),
        "llama-tied": lambda: transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**llama, tie_word_embeddings=True)
        ),
    }


@pytest.mark.parametrize("kind", list(_hf_models()))
def test_import_then_export_matches_hugging_face(kind, tmp_path, single_rank):
    torch.manual_seed(0)
    theirs = _perturb(_hf_models()[kind]()).eval()
    theirs.save_pretrained(tmp_path / "hf", safe_serialization=True)
    iter_dir = import_checkpoint(str(tmp_path / "hf"), str(tmp_path / "ours"))
    fields = files.read_metadata(iter_dir)["model"]
    ours = _ours(fields)
    cfg = resolve(
        Config(
            model=ours.cfg, checkpoint=CheckpointConfig(load=str(tmp_path / "ours"), finetune=True)
        )
    )
    load_checkpoint(cfg, ours, None, None)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    import_diff = (_our_logits(ours, tokens) - _their_logits(theirs, tokens)).abs().max()

    # export weights trained/initialised on our side, not the ones we just imported
    ours = _ours(fields)
    cfg.checkpoint, cfg.train.global_batch_size = CheckpointConfig(save=str(tmp_path / "o2")), 1
    save_checkpoint(cfg, _perturb(ours), None, _NoSchedule(), 1)
    export_checkpoint(str(tmp_path / "o2"), str(tmp_path / "hf2"))
    back = type(theirs).from_pretrained(tmp_path / "hf2").eval()
    export_diff = (_our_logits(ours, tokens) - _their_logits(back, tokens)).abs().max()
    print(f"{kind}: import max |logit diff| {import_diff:.2e}, export {export_diff:.2e}")
    assert import_diff < 1e-5 and export_diff < 1e-5
    untied = not theirs.config.tie_word_embeddings
    assert fields["untie_embeddings_and_output_weights"] == untied
    assert back.config.tie_word_embeddings == theirs.config.tie_word_embeddings
    # a tokenizer-less run records Megatron's NullTokenizer end-of-document id
    assert (back.config.bos_token_id, back.config.eos_token_id) == (VOCAB - 1, VOCAB - 1)


def test_export_carries_the_imported_special_tokens(tmp_path, single_rank):
    torch.manual_seed(0)
    theirs = _hf_models()["llama-untied"]()
    theirs.config.bos_token_id, theirs.config.eos_token_id = 5, 7
    theirs.save_pretrained(tmp_path / "hf", safe_serialization=True)
    import_checkpoint(str(tmp_path / "hf"), str(tmp_path / "ours"))
    export_checkpoint(str(tmp_path / "ours"), str(tmp_path / "hf2"))
    back = transformers.AutoConfig.from_pretrained(tmp_path / "hf2")
    assert (back.bos_token_id, back.eos_token_id) == (5, 7)
    export_checkpoint(
        str(tmp_path / "ours"),
        str(tmp_path / "hf3"),
        special_tokens={"bos_token_id": 1, "eos_token_id": 2},
    )
    back = transformers.AutoConfig.from_pretrained(tmp_path / "hf3")
    assert (back.bos_token_id, back.eos_token_id) == (1, 2)


def test_import_validates_the_target_layout_before_writing(tmp_path, single_rank):
    from megatron_ul.checkpoint.files import CheckpointError

    _hf_models()["gpt2"]().save_pretrained(tmp_path / "hf", safe_serialization=True)
    with pytest.raises(CheckpointError, match="--tensor-model-parallel-size"):
        import_checkpoint(str(tmp_path / "hf"), str(tmp_path / "ours"), tp=8)
    assert not (tmp_path / "ours").exists()


class _NoSchedule:
    def state_dict(self):
        return {"num_steps": 0}


def test_swiglu_model_without_ffn_hidden_size_exports_its_real_width(tmp_path, single_rank):
    """Megatron's default SwiGLU width (8h/3 rounded down to 64) is what the weights have and
    what config.json must say; 4h would make from_pretrained fail on a size mismatch."""
    fields = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=8,
        num_query_groups=2,
        vocab_size=VOCAB,
        seq_length=16,
        max_position_embeddings=16,
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
    )
    ours = _ours(fields)
    assert ours.cfg.ffn_hidden_size is None and ours.cfg.ffn_size == 64 != 4 * 32
    cfg = resolve(Config(model=ours.cfg, checkpoint=CheckpointConfig(save=str(tmp_path / "ours"))))
    cfg.train.global_batch_size = 1
    save_checkpoint(cfg, _perturb(ours), None, _NoSchedule(), 1)
    export_checkpoint(str(tmp_path / "ours"), str(tmp_path / "hf"))
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert theirs.config.intermediate_size == 64
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    diff = (_our_logits(ours, tokens) - _their_logits(theirs, tokens)).abs().max()
    print(f"default-width SwiGLU export: max |logit diff| {diff:.2e}")
    assert diff < 1e-5
