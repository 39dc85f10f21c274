"""Hugging Face GPT-2 (GPT2LMHeadModel), Llama (LlamaForCausalLM) and Mistral
(MistralForCausalLM: Llama with a sliding window) <-> megatron_ul weights.

Tensor mappings on full (TP1) state dicts keyed by our canonical names, and the converter
(HuggingFace, at the end) that reads and writes the model directory. Layout facts the mapping
relies on:
  - our fused QKV is [groups, q_per_group + 2, head_dim, hidden] (model/transformer.py);
    HF keeps q, k, v apart (Llama) or as [q; k; v] in one Conv1D (GPT-2);
  - GPT-2's Conv1D stores weights as [in, out]: transposed against nn.Linear;
  - SwiGLU fc1 is [gate; up]; RoPE is rotate-half in both, so no permutation;
  - our vocabulary is padded, and padded rows are outside the softmax: import pads with
    zeros, export drops them;
  - GPT-2 uses gelu_new (tanh approximation): imported as gelu_approximate = "tanh";
  - every config.json key is read, known to change nothing, or refused (HF_KEYS), and every
    setting of ours is carried or refused (checkpoint/interop/settings.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any

import torch

from ...config import ModelConfig
from ..files import CheckpointError
from ..full import FullCheckpoint
from ..layout.reshard import layout_table
from .base import Check, Options, Source, Written, convert, weights_only
from .ours import MegatronUl
from .settings import check_carried


def _hf_error(what: str) -> CheckpointError:
    return CheckpointError(f"Hugging Face config.json: {what}")


# config.json keys that never change the logits (bookkeeping, token ids, dropout, init,
# generation and head-summary settings), for every model type.
HF_NO_EFFECT = frozenset(
    """_name_or_path architectures model_type transformers_version torch_dtype dtype
    bos_token_id eos_token_id pad_token_id sep_token_id decoder_start_token_id use_cache
    initializer_range attention_dropout attn_pdrop embd_pdrop resid_pdrop output_attentions
    output_hidden_states return_dict problem_type id2label label2id chunk_size_feed_forward
    is_encoder_decoder add_cross_attention task_specific_params n_ctx summary_activation
    summary_first_dropout summary_proj_to_labels summary_type summary_use_proj
    reorder_and_upcast_attn pretraining_tp tokenizer_class prefix finetuning_task
    max_length min_length do_sample num_beams temperature top_k top_p repetition_penalty
    length_penalty no_repeat_ngram_size bad_words_ids num_return_sequences""".split()
)
# {model_type: {config key: the values we compute, or MAPPED (read by the mapping)}}
MAPPED = "mapped"
HF_KEYS: dict[str, dict[str, Any]] = {
    "gpt2": {
        **{
            k: MAPPED
            for k in """n_layer n_embd n_head n_inner n_positions vocab_size layer_norm_epsilon
            activation_function tie_word_embeddings""".split()
        },
        "scale_attn_weights": (True,),
        "scale_attn_by_inverse_layer_idx": (False,),
    },
    "llama": {
        **{
            k: MAPPED
            for k in """num_hidden_layers hidden_size num_attention_heads num_key_value_heads
            head_dim intermediate_size vocab_size max_position_embeddings rms_norm_eps
            hidden_act rope_theta rope_parameters rope_scaling tie_word_embeddings""".split()
        },
        "attention_bias": (False,),
        "mlp_bias": (False,),
    },
}
# Mistral is Llama with a causal sliding window over the last `sliding_window` tokens.
HF_KEYS["mistral"] = {
    **{k: v for k, v in HF_KEYS["llama"].items() if k not in ("attention_bias", "mlp_bias")},
    "sliding_window": MAPPED,
}


def check_hf_keys(hf: dict) -> None:
    """Refuse, naming the key, a config.json setting the mapping neither reads nor computes."""
    known = HF_KEYS[str(hf.get("model_type"))]
    bad = [
        f"{key} = {value!r}"
        for key, value in hf.items()
        if key not in HF_NO_EFFECT
        and known.get(key) != MAPPED
        and not (key in known and value in known[key])
    ]
    if bad:
        raise _hf_error(
            f"{', '.join(bad)}: not a setting megatron_ul computes (or knows to change "
            f"nothing); not imported"
        )


# ---- GPT-2 -------------------------------------------------------------------------------------
def gpt2_model_config(hf: dict) -> dict:
    """Our ModelConfig fields for a GPT2Config dict."""
    check_hf_keys(hf)
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
        raise _hf_error(f"activation_function {act!r} is not supported (gelu_new or gelu)")
    if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
        raise _hf_error("only GPT-2's default attention scaling 1/sqrt(head_dim) is supported")
    h = hf["n_embd"]
    return {
        "num_layers": hf["n_layer"],
        "hidden_size": h,
        "num_attention_heads": hf["n_head"],
        "ffn_hidden_size": hf.get("n_inner") or 4 * h,
        "vocab_size": hf["vocab_size"],
        "max_position_embeddings": hf["n_positions"],
        "seq_length": hf["n_positions"],
        "position_embedding_type": "learned_absolute",
        "normalization": "LayerNorm",
        "norm_epsilon": hf.get("layer_norm_epsilon", 1e-5),
        "swiglu": False,
        "add_bias_linear": True,
        "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", True),
        "gelu_approximate": "none" if act == "gelu" else "tanh",
        "num_query_groups": None,
        "kv_channels": None,
    }


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """q [heads·d, ...], k, v [groups·d, ...] -> our [groups·(q_per_group+2)·d, ...]."""
    tail = q.shape[1:]
    qg = q.reshape(groups, -1, *tail)  # [groups, q_per_group·d, ...]
    kg, vg = k.reshape(groups, -1, *tail), v.reshape(groups, -1, *tail)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *tail)


def _split_qkv(qkv: torch.Tensor, groups: int, q_per_group: int, head_dim: int):
    tail = qkv.shape[1:]
    per = qkv.reshape(groups, q_per_group + 2, head_dim, *tail)
    q = per[:, :q_per_group].reshape(-1, *tail)
    return q, per[:, q_per_group].reshape(-1, *tail), per[:, q_per_group + 1].reshape(-1, *tail)


# Per-layer GPT-2 tensors with a weight and a bias: (their name, ours, transposed?). GPT-2's
# Conv1D stores linear weights [in, out]; ours are [out, in]. Serves import and export.
GPT2_LAYER_NAMES = [
    ("ln_1", "input_norm", False),
    ("ln_2", "post_attention_norm", False),
    ("attn.c_proj", "attention.proj", True),
    ("mlp.c_fc", "mlp.fc1", True),
    ("mlp.c_proj", "mlp.fc2", True),
]


def gpt2_to_ours(sd: dict, m: dict) -> dict:
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    heads = m["num_attention_heads"]
    out = {
        "word_embeddings.weight": sd["wte.weight"],
        "position_embeddings.weight": sd["wpe.weight"],
        "final_norm.weight": sd["ln_f.weight"],
        "final_norm.bias": sd["ln_f.bias"],
    }
    if m["untie_embeddings_and_output_weights"]:
        out["output_layer.weight"] = sd["lm_head.weight"]
    for i in range(m["num_layers"]):
        hf, ours = f"h.{i}.", f"layers.{i}."
        w = sd[hf + "attn.c_attn.weight"].t()  # Conv1D [in, out] -> [out, in]
        b = sd[hf + "attn.c_attn.bias"]
        (wq, wk, wv), (bq, bk, bv) = w.chunk(3, dim=0), b.chunk(3, dim=0)
        out[ours + "attention.qkv.weight"] = _fuse_qkv(wq, wk, wv, heads)
        out[ours + "attention.qkv.bias"] = _fuse_qkv(bq, bk, bv, heads)
        for their, mine, transpose in GPT2_LAYER_NAMES:
            weight = sd[hf + their + ".weight"]
            out[ours + mine + ".weight"] = weight.t() if transpose else weight
            out[ours + mine + ".bias"] = sd[hf + their + ".bias"]
    return {k: v.float().contiguous() for k, v in out.items()}


def ours_to_gpt2(p: dict, m: dict) -> tuple[dict, dict]:
    """(GPT2LMHeadModel state dict, GPT2Config dict) from our full unpadded parameters."""
    if (
        m["swiglu"]
        or m["normalization"] != "LayerNorm"
        or not m["add_bias_linear"]
        or m["position_embedding_type"] != "learned_absolute"
        or m.get("num_query_groups") not in (None, m["num_attention_heads"])
    ):
        raise CheckpointError(
            "this model is not GPT-2 shaped (needs LayerNorm, GELU, biases, "
            "learned positions, no GQA); export it as llama"
        )
    check_carried(m, "hf_gpt2", "Hugging Face GPT-2 (GPT2LMHeadModel)")
    tied = not m["untie_embeddings_and_output_weights"]
    heads, d = m["num_attention_heads"], m["hidden_size"] // m["num_attention_heads"]
    sd = {
        "transformer.wte.weight": p["word_embeddings.weight"],
        "transformer.wpe.weight": p["position_embeddings.weight"],
        "transformer.ln_f.weight": p["final_norm.weight"],
        "transformer.ln_f.bias": p["final_norm.bias"],
        "lm_head.weight": p["word_embeddings.weight" if tied else "output_layer.weight"],
    }
    for i in range(m["num_layers"]):
        hf, ours = f"transformer.h.{i}.", f"layers.{i}."
        q, k, v = _split_qkv(p[ours + "attention.qkv.weight"], heads, 1, d)
        sd[hf + "attn.c_attn.weight"] = torch.cat([q, k, v]).t()
        sd[hf + "attn.c_attn.bias"] = torch.cat(
            _split_qkv(p[ours + "attention.qkv.bias"], heads, 1, d)
        )
        for their, mine, transpose in GPT2_LAYER_NAMES:
            weight = p[ours + mine + ".weight"]
            sd[hf + their + ".weight"] = weight.t() if transpose else weight
            sd[hf + their + ".bias"] = p[ours + mine + ".bias"]
    config = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "n_layer": m["num_layers"],
        "n_embd": m["hidden_size"],
        "n_head": heads,
        "n_inner": ModelConfig(**m).ffn_size,
        "n_positions": m["max_position_embeddings"],
        "vocab_size": m["vocab_size"],
        "layer_norm_epsilon": m["norm_epsilon"],
        "activation_function": "gelu_new" if m["gelu_approximate"] == "tanh" else "gelu",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": tied,
    }
    return {k: v.contiguous() for k, v in sd.items()}, config


# ---- Llama -------------------------------------------------------------------------------------
def _rope_theta(hf: dict) -> float:
    rope = hf.get("rope_parameters") or {}
    if (rope.get("rope_type") or "default") != "default" or hf.get("rope_scaling"):
        raise _hf_error(f"rope scaling {rope or hf.get('rope_scaling')} is not supported")
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def llama_model_config(hf: dict) -> dict:
    """Our ModelConfig fields for a LlamaConfig or MistralConfig dict."""
    check_hf_keys(hf)
    if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias") or hf.get("mlp_bias"):
        raise _hf_error("only SiLU (SwiGLU) MLPs without biases are supported")
    heads = hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "num_attention_heads": heads,
        "num_query_groups": groups if groups != heads else None,
        "kv_channels": head_dim if head_dim * heads != hf["hidden_size"] else None,
        "ffn_hidden_size": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"],
        "max_position_embeddings": hf["max_position_embeddings"],
        "seq_length": hf["max_position_embeddings"],
        "position_embedding_type": "rope",
        "rotary_base": _rope_theta(hf),
        "normalization": "RMSNorm",
        "norm_epsilon": hf.get("rms_norm_eps", 1e-6),
        "swiglu": True,
        "add_bias_linear": False,
        "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", False),
        "gelu_approximate": "none",
        "window_size": _window_from_hf(hf),
    }


def _window_from_hf(hf: dict) -> list[int] | None:
    """Mistral's sliding_window W: a query sees itself and the W - 1 tokens before it
    (transformers' sliding_window_overlay: kv_idx > q_idx - W), our --window-size W-1,0."""
    window = hf.get("sliding_window") if hf.get("model_type") == "mistral" else None
    if window is None:
        return None
    if window < 1:
        raise _hf_error(f"sliding_window {window}: must be at least 1")
    return [int(window) - 1, 0]


def llama_to_ours(sd: dict, m: dict, dense_mlp: bool = True) -> dict:
    """Our full parameters from a Llama state dict; without `dense_mlp` the MLPs are left to the
    caller (Mixtral's experts)."""
    sd = {k.removeprefix("model."): v for k, v in sd.items()}
    groups = m["num_query_groups"] or m["num_attention_heads"]
    out = {
        "word_embeddings.weight": sd["embed_tokens.weight"],
        "final_norm.weight": sd["norm.weight"],
    }
    if m["untie_embeddings_and_output_weights"]:
        out["output_layer.weight"] = sd["lm_head.weight"]
    for i in range(m["num_layers"]):
        hf, ours = f"layers.{i}.", f"layers.{i}."
        a = hf + "self_attn."
        out[ours + "attention.qkv.weight"] = _fuse_qkv(
            sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"], groups
        )
        out[ours + "attention.proj.weight"] = sd[a + "o_proj.weight"]
        out[ours + "input_norm.weight"] = sd[hf + "input_layernorm.weight"]
        out[ours + "post_attention_norm.weight"] = sd[hf + "post_attention_layernorm.weight"]
        if not dense_mlp:
            continue
        out[ours + "mlp.fc1.weight"] = torch.cat(
            [sd[hf + "mlp.gate_proj.weight"], sd[hf + "mlp.up_proj.weight"]]
        )
        out[ours + "mlp.fc2.weight"] = sd[hf + "mlp.down_proj.weight"]
    return {k: v.float().contiguous() for k, v in out.items()}


def ours_to_llama(p: dict, m: dict, dense_mlp: bool = True) -> tuple[dict, dict]:
    """(state dict, config.json) of a Llama-shaped model; without `dense_mlp` the MLPs are left
    to the caller (Mixtral's experts)."""
    if (
        not m["swiglu"]
        or m["normalization"] != "RMSNorm"
        or m["add_bias_linear"]
        or m["position_embedding_type"] != "rope"
    ):
        raise CheckpointError(
            "this model is not Llama shaped (needs RMSNorm, SwiGLU, no "
            "biases, RoPE); export it as gpt2"
        )
    check_carried(m, "hf_llama", "Hugging Face Llama / Mistral")
    window = ModelConfig(**m).attention_window
    heads = m["num_attention_heads"]
    groups = m["num_query_groups"] or heads
    head_dim = m["kv_channels"] or m["hidden_size"] // heads
    tied = not m["untie_embeddings_and_output_weights"]
    sd = {
        "model.embed_tokens.weight": p["word_embeddings.weight"],
        "model.norm.weight": p["final_norm.weight"],
        "lm_head.weight": p["word_embeddings.weight" if tied else "output_layer.weight"],
    }
    for i in range(m["num_layers"]):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        q, k, v = _split_qkv(p[ours + "attention.qkv.weight"], groups, heads // groups, head_dim)
        sd.update(
            {
                hf + "self_attn.q_proj.weight": q,
                hf + "self_attn.k_proj.weight": k,
                hf + "self_attn.v_proj.weight": v,
                hf + "self_attn.o_proj.weight": p[ours + "attention.proj.weight"],
                hf + "input_layernorm.weight": p[ours + "input_norm.weight"],
                hf + "post_attention_layernorm.weight": p[ours + "post_attention_norm.weight"],
            }
        )
        if dense_mlp:
            gate, up = p[ours + "mlp.fc1.weight"].chunk(2, dim=0)
            sd[hf + "mlp.gate_proj.weight"] = gate
            sd[hf + "mlp.up_proj.weight"] = up
            sd[hf + "mlp.down_proj.weight"] = p[ours + "mlp.fc2.weight"]
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": m["num_layers"],
        "hidden_size": m["hidden_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": head_dim,
        "intermediate_size": ModelConfig(**m).ffn_size,
        "vocab_size": m["vocab_size"],
        "max_position_embeddings": m["max_position_embeddings"],
        "rms_norm_eps": m["norm_epsilon"],
        "hidden_act": "silu",
        "rope_theta": m["rotary_base"],
        "rope_parameters": {"rope_theta": m["rotary_base"], "rope_type": "default"},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
    }
    if window is not None:  # Llama has no window: Mistral is Llama with one
        config.update(
            model_type="mistral",
            architectures=["MistralForCausalLM"],
            sliding_window=window + 1,
        )
        del config["attention_bias"], config["mlp_bias"]
    return {k: v.contiguous() for k, v in sd.items()}, config


def detect(hf_config: dict) -> str:
    """'gpt2' or 'llama' (Mistral maps as Llama with its window)."""
    kind = hf_config.get("model_type")
    if kind not in HF_KEYS:
        hint = "; read Mixtral with --from hf_mixtral" if kind == "mixtral" else ""
        raise _hf_error(f"model_type {kind!r} is not supported (gpt2, llama or mistral){hint}")
    return "gpt2" if kind == "gpt2" else "llama"


def to_ours(hf_config: dict, hf_state: dict) -> tuple[dict, dict]:
    """(our ModelConfig fields, our full unpadded parameters) from a Hugging Face model."""
    kind = detect(hf_config)
    m = gpt2_model_config(hf_config) if kind == "gpt2" else llama_model_config(hf_config)
    return m, (gpt2_to_ours if kind == "gpt2" else llama_to_ours)(hf_state, m)


def to_hf(kind: str, params: dict, m: dict) -> tuple[dict, dict]:
    if kind not in ("gpt2", "llama"):
        raise CheckpointError(f"--model-type {kind!r}: choose gpt2 or llama")
    return (ours_to_gpt2 if kind == "gpt2" else ours_to_llama)(params, m)


# ---- files ---------------------------------------------------------------------------------------
def read_hf_config(hf_dir: str) -> dict:

    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise CheckpointError(
            f"{config_path}: missing; --hf-dir must be a Hugging Face model "
            f"directory (config.json + *.safetensors)"
        )
    try:
        with open(config_path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{config_path}: cannot be parsed ({e})") from e


def read_hf_dir(hf_dir: str) -> tuple[dict, dict]:
    """(config.json, tensors) of a Hugging Face model directory saved as safetensors."""
    import glob

    from safetensors.torch import load_file

    config = read_hf_config(hf_dir)
    shards = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not shards:
        raise CheckpointError(
            f"{hf_dir}: no *.safetensors files (PyTorch .bin files are not "
            f"read; re-save with safe_serialization=True)"
        )
    state = {}
    for path in shards:
        try:
            state.update(load_file(path))
        except Exception as e:
            raise CheckpointError(f"{path}: cannot be read ({e})") from e
    return config, state


def _check_names(params: dict, table: dict, hf_dir: str) -> None:
    """The mapped tensors must be exactly the model's parameters, shaped as the table says
    (vocabulary rows are padded later)."""
    missing, extra = set(table) - set(params), set(params) - set(table)
    bad = [
        n
        for n in set(params) & set(table)
        if not table[n]["vocab_padded"] and list(params[n].shape) != table[n]["shape"]
    ]
    if missing or extra or bad:
        raise CheckpointError(
            f"{hf_dir}: the mapped weights do not fit the model: missing "
            f"{sorted(missing)[:4]}, unexpected {sorted(extra)[:4]}, "
            f"wrong shape {sorted(bad)[:4]}"
        )


def _special_tokens(meta: dict, overrides: dict) -> dict:
    """bos/eos ids for the exported config: overrides, else the checkpoint's record, else the
    end-of-document id of a tokenizer-less (mock-data) run, vocab_size - 1 as Megatron's
    NullTokenizer has it."""
    import logging

    recorded = meta.get("special_tokens") or {}
    out = {}
    for key in ("bos_token_id", "eos_token_id"):
        value = overrides.get(key)
        if value is None:
            value = recorded.get(key)
        if value is None:
            value = meta["model"]["vocab_size"] - 1
            logging.getLogger("megatron_ul").warning(
                "the checkpoint records no %s; exporting %d (vocab_size - 1); pass --%s to choose",
                key,
                value,
                key.replace("_", "-"),
            )
        out[key] = int(value)
    return out


class HuggingFace:
    name = "hf"
    help = (
        "a Hugging Face GPT-2 / Llama / Mistral model directory (config.json and *.safetensors; "
        "written as config.json and model.safetensors)"
    )
    notes: tuple[str, ...] = ()

    def read(self, load_dir: str, opts: Options, check: Check) -> FullCheckpoint:
        """Iteration 0, weights only."""
        config = read_hf_config(load_dir)
        kind = detect(config)
        fields = gpt2_model_config(config) if kind == "gpt2" else llama_model_config(config)
        model = asdict(ModelConfig(**fields))
        check(Source(model, 0, None))
        _, state = read_hf_dir(load_dir)
        _, params = to_ours(config, state)
        _check_names(params, layout_table({"model": model}, 1, 1, None), load_dir)
        return weights_only(
            params,
            model,
            0,
            f"hugging face {config['model_type']}",
            special_tokens={k: config.get(k) for k in ("bos_token_id", "eos_token_id")},
        )

    def check(self, source: Source, save_dir: str, opts: Options) -> None:
        if opts.model_type is not None and opts.model_type not in ("gpt2", "llama"):
            raise CheckpointError(f"--model-type {opts.model_type!r}: choose gpt2 or llama")
        target = os.path.join(save_dir, "model.safetensors")
        if os.path.exists(target):
            raise CheckpointError(f"{target} already exists; choose an empty --hf-dir")

    def write(self, full: FullCheckpoint, save_dir: str, opts: Options) -> Written:
        """config.json and model.safetensors that transformers' from_pretrained loads;
        opts.special_tokens ({bos_token_id, eos_token_id}) overrides the ids recorded in the
        checkpoint (from its tokenizer, or from the Hugging Face model it was imported from)."""
        from safetensors.torch import save_file

        m = full.metadata["model"]
        kind = opts.model_type or ("llama" if m["swiglu"] else "gpt2")
        state, config = to_hf(kind, full.params, m)
        config.update(_special_tokens(full.metadata, opts.special_tokens))
        if config.get("tie_word_embeddings"):  # Hugging Face re-ties it on load
            state.pop("lm_head.weight")
        target = os.path.join(save_dir, "model.safetensors")
        if os.path.exists(target):
            raise CheckpointError(f"{target} already exists; choose an empty --hf-dir")
        os.makedirs(save_dir, exist_ok=True)
        save_file({k: v.clone() for k, v in state.items()}, target, metadata={"format": "pt"})
        with open(os.path.join(save_dir, "config.json"), "w") as f:
            json.dump({**config, "torch_dtype": "float32"}, f, indent=1)
        return Written(save_dir)


def import_checkpoint(hf_dir: str, save_dir: str, tp: int = 1, pp: int = 1) -> str:
    """Write a Hugging Face model as iteration 0 of a megatron_ul checkpoint (weights only).
    Returns the iteration directory."""
    return convert(HuggingFace(), MegatronUl(), hf_dir, save_dir, Options(tp=tp, pp=pp)).path


def export_checkpoint(
    load_dir: str, hf_dir: str, kind: str | None = None, special_tokens: dict | None = None
) -> tuple[str, list[str]]:
    """Write the latest iteration of `load_dir` (any layout) as a Hugging Face model directory;
    refuses to overwrite a model there. Returns (the directory, no flags)."""
    opts = Options(model_type=kind, special_tokens=special_tokens or {})
    out = convert(MegatronUl(), HuggingFace(), load_dir, hf_dir, opts)
    return out.path, out.flags
