"""Hugging Face Mixtral (MixtralForCausalLM) <-> megatron_ul MoE weights.

Mixtral is Mistral with every MLP a mixture of experts (transformers'
models/mixtral/modeling_mixtral.py, MixtralTopKRouter and MixtralExperts): softmax over all
experts, top-k, the k weights renormalised to sum 1 — the same function as our router without
--moe-router-pre-softmax (top-k logits, softmax over the k) — and every token routed (no
capacity). Each expert is a SwiGLU MLP.

Tensor layout: Mixtral checkpoints on the Hub, and the ones written here, keep each expert
apart (`block_sparse_moe.experts.<e>.w1 / w3 / w2`: gate, up, down; the router
`block_sparse_moe.gate`); transformers 5 fuses them on load into `mlp.experts.gate_up_proj`
[E, 2f, h] ([gate; up]) and `mlp.experts.down_proj` [E, h, f], and that form is read too. Our
experts (model/moe/experts.py) are `mlp.experts.local_experts.<e>.linear_fc1` [gate; up] and
`linear_fc2`, the router `mlp.router.weight` [E, h]. Attention, norms and embeddings map as
Mistral's (hf.py).
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
from . import hf
from .base import Check, Options, Source, Written, weights_only
from .settings import check_carried

# config.json keys of a MixtralConfig: Mistral's, plus the experts'; the router's aux-loss
# settings and jitter change training only (jitter multiplies the input in training mode).
MIXTRAL_KEYS: dict[str, Any] = {
    **hf.HF_KEYS["mistral"],
    "num_local_experts": hf.MAPPED,
    "num_experts_per_tok": hf.MAPPED,
}
MIXTRAL_NO_EFFECT = frozenset(
    {"output_router_logits", "router_aux_loss_coef", "router_jitter_noise"}
)


def _error(what: str) -> CheckpointError:
    return CheckpointError(f"Hugging Face config.json (mixtral): {what}")


def mixtral_model_config(config: dict) -> dict:
    """Our ModelConfig fields for a MixtralConfig dict; unknown keys refused naming them."""
    bad = [
        f"{key} = {value!r}"
        for key, value in config.items()
        if key not in hf.HF_NO_EFFECT
        and key not in MIXTRAL_NO_EFFECT
        and MIXTRAL_KEYS.get(key) != hf.MAPPED
        and not (key in MIXTRAL_KEYS and value in MIXTRAL_KEYS[key])
    ]
    if bad:
        raise _error(f"{', '.join(bad)}: not a setting megatron_ul computes; not imported")
    dense = hf.llama_model_config(
        {k: v for k, v in config.items() if k in hf.HF_KEYS["mistral"] or k in hf.HF_NO_EFFECT}
        | {"model_type": "mistral"}
    )
    experts, k = int(config["num_local_experts"]), int(config.get("num_experts_per_tok", 2))
    if not 1 <= k <= experts:
        raise _error(f"num_experts_per_tok {k} must be between 1 and num_local_experts {experts}")
    return {
        **dense,
        "num_experts": experts,
        "moe_router_topk": k,
        "moe_ffn_hidden_size": config["intermediate_size"],
        "moe_layer_freq": 1,
    }


def mixtral_to_ours(sd: dict, m: dict) -> dict:
    """Our full parameters from a Mixtral state dict (per-expert or fused expert tensors)."""
    out = hf.llama_to_ours(sd, m, dense_mlp=False)  # everything but the MLPs
    sd = {k.removeprefix("model."): v for k, v in sd.items()}
    for i in range(m["num_layers"]):
        theirs, ours = f"layers.{i}.", f"layers.{i}."
        fused = theirs + "mlp.experts.gate_up_proj"
        if fused in sd:  # transformers 5's in-memory form
            out[ours + "mlp.router.weight"] = sd[theirs + "mlp.gate.weight"]
            fc1 = list(sd[fused].unbind(0))
            fc2 = list(sd[theirs + "mlp.experts.down_proj"].unbind(0))
        else:  # the Hub's per-expert form
            moe = theirs + "block_sparse_moe."
            out[ours + "mlp.router.weight"] = sd[moe + "gate.weight"]
            fc1 = [
                torch.cat([sd[f"{moe}experts.{e}.w1.weight"], sd[f"{moe}experts.{e}.w3.weight"]])
                for e in range(m["num_experts"])
            ]
            fc2 = [sd[f"{moe}experts.{e}.w2.weight"] for e in range(m["num_experts"])]
        for e, (w1, w2) in enumerate(zip(fc1, fc2)):
            out[f"{ours}mlp.experts.local_experts.{e}.linear_fc1.weight"] = w1
            out[f"{ours}mlp.experts.local_experts.{e}.linear_fc2.weight"] = w2
    return {k: v.float().contiguous() for k, v in out.items()}


def ours_to_mixtral(p: dict, m: dict) -> tuple[dict, dict]:
    """(state dict in the Hub's per-expert form, config.json) of our MoE model."""
    if m.get("num_experts") is None:
        raise CheckpointError("this model has no experts (--num-experts); export it as llama")
    if not m["swiglu"] or m["normalization"] != "RMSNorm" or m["position_embedding_type"] != "rope":
        raise CheckpointError(
            "this MoE model is not Mixtral shaped (needs RMSNorm, --swiglu, RoPE, no biases)"
        )
    check_carried(m, "hf_mixtral", "Hugging Face Mixtral")
    cfg = ModelConfig(**m)
    if cfg.moe_layer_freq != 1:
        raise CheckpointError(
            f"--moe-layer-freq {cfg.moe_layer_freq}: Mixtral makes every layer MoE; not exported"
        )
    if cfg.moe_ffn_size != cfg.ffn_size:
        raise CheckpointError(
            f"--moe-ffn-hidden-size {cfg.moe_ffn_size} differs from --ffn-hidden-size "
            f"{cfg.ffn_size}: Mixtral has one intermediate_size; not exported"
        )
    # Llama's mapping for everything but the MLPs.
    sd, config = hf.ours_to_llama(p, {**m, "num_experts": None}, dense_mlp=False)
    for i in range(m["num_layers"]):
        moe, ours = f"model.layers.{i}.block_sparse_moe.", f"layers.{i}.mlp."
        sd[moe + "gate.weight"] = p[ours + "router.weight"]
        for e in range(m["num_experts"]):
            gate, up = p[f"{ours}experts.local_experts.{e}.linear_fc1.weight"].chunk(2, dim=0)
            sd[f"{moe}experts.{e}.w1.weight"] = gate
            sd[f"{moe}experts.{e}.w3.weight"] = up
            sd[f"{moe}experts.{e}.w2.weight"] = p[
                f"{ours}experts.local_experts.{e}.linear_fc2.weight"
            ]
    config = {k: v for k, v in config.items() if k not in ("attention_bias", "mlp_bias")}
    config.update(
        model_type="mixtral",
        architectures=["MixtralForCausalLM"],
        num_local_experts=m["num_experts"],
        num_experts_per_tok=m["moe_router_topk"],
        sliding_window=config.get("sliding_window"),
        router_jitter_noise=0.0,
        output_router_logits=False,
    )
    return {k: v.contiguous() for k, v in sd.items()}, config


class HuggingFaceMixtral:
    name = "hf_mixtral"
    help = "a Hugging Face Mixtral model directory (config.json and *.safetensors)"
    notes: tuple[str, ...] = ()

    def read(self, load_dir: str, opts: Options, check: Check) -> FullCheckpoint:
        """Iteration 0, weights only."""
        config = hf.read_hf_config(load_dir)
        if config.get("model_type") != "mixtral":
            raise _error(
                f"model_type {config.get('model_type')!r}: --from hf_mixtral reads mixtral"
            )
        model = asdict(ModelConfig(**mixtral_model_config(config)))
        check(Source(model, 0, None))
        _, state = hf.read_hf_dir(load_dir)
        params = mixtral_to_ours(state, model)
        hf._check_names(params, layout_table({"model": model}, 1, 1, None), load_dir)
        return weights_only(
            params,
            model,
            0,
            "hugging face mixtral",
            special_tokens={k: config.get(k) for k in ("bos_token_id", "eos_token_id")},
        )

    def check(self, source: Source, save_dir: str, opts: Options) -> None:
        target = os.path.join(save_dir, "model.safetensors")
        if os.path.exists(target):
            raise CheckpointError(f"{target} already exists; choose an empty --hf-dir")

    def write(self, full: FullCheckpoint, save_dir: str, opts: Options) -> Written:
        from safetensors.torch import save_file

        state, config = ours_to_mixtral(full.params, full.metadata["model"])
        config.update(hf._special_tokens(full.metadata, opts.special_tokens))
        if config.get("tie_word_embeddings"):
            state.pop("lm_head.weight")
        target = os.path.join(save_dir, "model.safetensors")
        if os.path.exists(target):
            raise CheckpointError(f"{target} already exists; choose an empty --hf-dir")
        os.makedirs(save_dir, exist_ok=True)
        save_file({k: v.clone() for k, v in state.items()}, target, metadata={"format": "pt"})
        with open(os.path.join(save_dir, "config.json"), "w") as f:
            json.dump({**config, "torch_dtype": "float32"}, f, indent=1)
        return Written(save_dir)
