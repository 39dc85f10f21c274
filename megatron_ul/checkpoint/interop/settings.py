"""What each converter carries: every model setting is mapped, refused, or has no effect on
the function the checkpoint computes.

Reading a Megatron checkpoint: megatron-core's TransformerConfig (built by Megatron-LM's
core_transformer_config_from_args from the args of the same name, with the renames in
CORE_FIELDS) and the GPTModel-level args in MEGATRON_ARGS are classified here field by field.
A refused setting whose recorded value is not its neutral one stops the import with its flag
named; a field this table does not know is a test failure (tests/checkpoint/
test_interop_settings.py enumerates the installed megatron-core's TransformerConfig).

Writing: our ModelConfig fields are classified per converter in OURS; a field set to a value
other than its default that the target cannot carry is refused before anything is written.
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any

from ...config import ModelConfig
from ..files import CheckpointError

# ---- megatron-core's TransformerConfig ---------------------------------------------------------
MAPPED = "mapped"  # read into our ModelConfig (or the layer placement) by the importers
NO_EFFECT = "no effect"  # parallelism, kernels, precision, init, training-only, logging


def _refused(flag: str, *neutral: Any, arg: str | None = None) -> tuple:
    """A setting we do not compute: ("refused", the args attribute, its Megatron flag, the
    values that mean "off")."""
    return ("refused", arg, flag, neutral)


_NO_EFFECT_FIELDS = """
tensor_model_parallel_size pipeline_model_parallel_comm_backend pipeline_model_parallel_size
virtual_pipeline_model_parallel_size sequence_parallel context_parallel_size
hierarchical_context_parallel_sizes max_seqlen_per_dp_cp_rank hybrid_context_parallel
expert_model_parallel_size expert_tensor_parallel_size moe_extended_tp perform_initialization
use_cpu_initialization fp16 bf16 params_dtype timers finalize_model_grads_func grad_scale_func
no_sync_func grad_sync_func param_sync_func deterministic_mode enable_autocast autocast_dtype
num_microbatches_with_partial_activation_checkpoints gradient_accumulation_fusion
async_tensor_model_parallel_allreduce use_te_rng_tracker tp_comm_overlap tp_comm_bulk_wgrad
tp_comm_bulk_dgrad tp_comm_overlap_ag tp_comm_overlap_rs tp_comm_overlap_rs_dgrad
tp_comm_split_ag tp_comm_atomic_ag tp_comm_split_rs tp_comm_atomic_rs cross_entropy_loss_fusion
cross_entropy_fusion_impl tp_comm_overlap_disable_qkv tp_comm_overlap_disable_fc1
tp_comm_bootstrap_backend overlap_moe_expert_parallel_comm delay_wgrad_compute
ep_overlap_early_attn_memory_release pipeline_dtype variable_seq_lengths overlap_p2p_comm
batch_p2p_comm batch_p2p_sync use_ring_exchange_p2p deallocate_pipeline_outputs
defer_embedding_wgrad_compute wgrad_deferral_limit overlap_p2p_comm_warmup_flush
microbatch_group_size_per_vp_stage cpu_offloading cpu_offloading_num_layers
_cpu_offloading_context cpu_offloading_activations cpu_offloading_weights
cpu_offloading_double_buffering barrier_with_L1_time attention_backend hidden_dropout
attention_dropout fp32_residual_connection activation_func_fp8_input_store test_mode
calculate_per_token_loss init_method output_layer_init_method init_method_std
embedding_init_method embedding_init_method_std init_model_with_meta_device
apply_query_key_layer_scaling attention_softmax_in_fp32 disable_bf16_reduced_precision_matmul
masked_softmax_fusion persist_layer_norm memory_efficient_layer_norm bias_dropout_fusion
apply_rope_fusion use_fused_weighted_squared_relu fused_single_qkv_rope recompute_granularity
recompute_method recompute_num_layers distribute_saved_activations recompute_modules fp8
fp8_recipe fp8_param fp8_quantizer_factory fp8_margin fp8_interval fp8_amax_history_len
fp8_amax_compute_algo fp8_wgrad fp8_dot_product_attention fp8_multi_head_attention
tp_only_amax_red first_last_layers_bf16 num_layers_at_start_in_bf16 num_layers_at_end_in_bf16
use_kitchen use_kitchen_attention kitchen_attention_backend fp4 fp4_recipe fp4_param
fp4_quantizer_factory quant_recipe cp_comm_type enable_cuda_graph
cuda_graph_use_single_mempool cuda_graph_retain_backward_graph cuda_graph_warmup_steps
external_cuda_graph cuda_graph_impl cuda_graph_scope clone_scatter_output_in_embedding
disable_parameter_transpose_cache config_logger_dir flash_decode batch_invariant_mode
inference_rng_tracker inference_sampling_seed symmetric_ar_type use_inference_optimized_layers
inference_fuse_tp_communication mlp_chunks_for_prefill fine_grained_activation_offloading
offload_modules min_offloaded_tensor_size qk_clip qk_clip_alpha qk_clip_threshold
log_max_attention_logit mtp_standalone mtp_loss_scaling_factor hetereogenous_dist_checkpoint
"""
# Only meaningful together with a refused setting (mixture of experts, Mamba, DSA and linear
# attention variants): they cannot matter once that setting is refused.
_WITH_REFUSED = {
    "num_moe_experts": [
        n
        for n in """
        moe_shared_expert_intermediate_size moe_shared_expert_gate moe_shared_expert_overlap
        moe_layer_freq moe_ffn_hidden_size moe_router_load_balancing_type moe_router_topk
        moe_enable_routing_replay moe_router_topk_limited_devices
        moe_router_padding_for_quantization moe_router_padding_for_fp8 moe_router_num_groups
        moe_router_group_topk moe_router_pre_softmax moe_router_topk_scaling_factor
        moe_router_score_function moe_router_dtype moe_router_enable_expert_bias
        moe_router_bias_update_rate moe_router_force_load_balancing moe_grouped_gemm
        moe_use_legacy_grouped_gemm moe_aux_loss_coeff moe_z_loss_coeff moe_input_jitter_eps
        moe_token_dropping moe_token_dispatcher_type moe_enable_deepep
        moe_flex_dispatcher_backend moe_per_layer_logging moe_expert_capacity_factor
        moe_pad_expert_input_to_capacity moe_token_drop_policy moe_layer_recompute
        moe_permute_fusion moe_router_fusion moe_apply_probs_on_input moe_latent_size
        moe_deepep_num_sms moe_hybridep_num_sms""".split()
    ],
    "is_hybrid_model": "mamba_state_dim mamba_head_dim mamba_num_groups mamba_num_heads "
    "use_mamba_mem_eff_path".split(),
    "experimental_attention_variant": "dsa_indexer_n_heads dsa_indexer_head_dim "
    "dsa_indexer_topk dsa_indexer_loss_coeff dsa_indexer_use_sparse_loss".split(),
    "linear_attention_freq": "linear_conv_kernel_dim linear_key_head_dim "
    "linear_value_head_dim linear_num_key_heads linear_num_value_heads".split(),
}

# {TransformerConfig field: MAPPED | NO_EFFECT | ("with", refused field) | refused tuple}
CORE_FIELDS: dict[str, Any] = {name: NO_EFFECT for name in _NO_EFFECT_FIELDS.split()}
CORE_FIELDS.update(
    {name: ("with", owner) for owner, names in _WITH_REFUSED.items() for name in names}
)
CORE_FIELDS.update(
    {
        name: MAPPED
        for name in """num_layers hidden_size num_attention_heads num_query_groups
        ffn_hidden_size kv_channels layernorm_epsilon add_bias_linear add_qkv_bias
        gated_linear_unit activation_func bias_activation_fusion normalization window_size
        num_layers_in_first_pipeline_stage num_layers_in_last_pipeline_stage
        transformer_impl""".split()
    }
)
CORE_FIELDS.update(
    {
        "apply_residual_connection_post_layernorm": _refused(
            "--apply-residual-connection-post-layernorm", False, None
        ),
        "layernorm_zero_centered_gamma": _refused(
            "--apply-layernorm-1p", False, None, arg="apply_layernorm_1p"
        ),
        "softmax_scale": _refused("--softmax-scale", None),
        "softmax_type": _refused("--softmax-type", "vanilla", None),
        "glu_linear_offset": _refused("--glu-linear-offset", 0.0, None),
        "activation_func_clamp_value": _refused("--activation-func-clamp-value", None),
        "num_moe_experts": _refused(  # Megatron-DeepSpeed records [1] for its dense model
            "--num-experts (mixture of experts)", None, 0, 1, [1], arg="num_experts"
        ),
        "rotary_interleaved": _refused("--rotary-interleaved", False, None),
        "window_attn_skip_freq": _refused("--window-attn-skip-freq", None),
        "qk_layernorm": _refused("--qk-layernorm", False, None),
        "qk_l2_norm": _refused("--qk-l2-norm", False, None),
        "attention_output_gate": _refused("--attention-output-gate", False, None),
        "multi_latent_attention": _refused("--multi-latent-attention", False, None),
        "no_rope_freq": _refused("--no-rope-freq (NoPE layers)", None),
        "experimental_attention_variant": _refused("--experimental-attention-variant", None),
        "linear_attention_freq": _refused("--linear-attention-freq", None),
        "mtp_num_layers": _refused("--mtp-num-layers (multi-token prediction)", None, 0),
        "mrope_section": _refused("--mrope-section", None),
        "is_hybrid_model": _refused("a hybrid (Mamba) model", False, None),
        "heterogeneous_block_specs": _refused(
            "--heterogeneous-layers-config-path", None, arg="heterogeneous_layers_config_path"
        ),
        "use_te_activation_func": _refused("--use-te-activation-func", False, None),
        # layer placement other than the first/last stage sizes (torch-format stage files)
        "pipeline_model_parallel_layout": _refused("--pipeline-model-parallel-layout", None),
        "account_for_embedding_in_pipeline_split": _refused(
            "--account-for-embedding-in-pipeline-split", False, None
        ),
        "account_for_loss_in_pipeline_split": _refused(
            "--account-for-loss-in-pipeline-split", False, None
        ),
    }
)

# GPTModel-level args outside TransformerConfig that change what the model computes.
MEGATRON_ARGS: dict[str, Any] = {
    "rotary_percent": _refused("--rotary-percent < 1", 1.0, None),
    "use_rope_scaling": _refused("--use-rope-scaling", False, None),
    "rotary_seq_len_interpolation_factor": _refused(
        "--rotary-seq-len-interpolation-factor", None, 1, 1.0
    ),
    "add_position_embedding": _refused("--no-position-embedding", True, None),
    "squared_relu": _refused("--squared-relu", False, None),
    "quick_geglu": _refused("--quick-geglu", False, None),
    "spec": _refused("--spec (a custom layer spec)", None),
    "hybrid_override_pattern": _refused("--hybrid-override-pattern", None),
    "position_embedding_type": MAPPED,
    "rotary_base": MAPPED,
    "untie_embeddings_and_output_weights": MAPPED,
    "swiglu": MAPPED,
    "openai_gelu": MAPPED,  # the legacy model's tanh GELU; megatron-core never reads it
    "group_query_attention": MAPPED,
    "norm_epsilon": MAPPED,
    "vocab_size": MAPPED,
    "padded_vocab_size": MAPPED,
    "seq_length": MAPPED,
    "max_position_embeddings": MAPPED,
    "make_vocab_size_divisible_by": MAPPED,
    "decoder_first_pipeline_num_layers": MAPPED,
    "decoder_last_pipeline_num_layers": MAPPED,
}


def refused_megatron_settings(args) -> list[str]:
    """The flags of the refused settings `args` (a Megatron-LM checkpoint's) sets to a value
    other than neutral; fields its release does not have count as neutral."""
    out = []
    for name, kind in [*CORE_FIELDS.items(), *MEGATRON_ARGS.items()]:
        if not (isinstance(kind, tuple) and kind[0] == "refused"):
            continue
        _, arg, flag, neutral = kind
        value = getattr(args, arg or name, neutral[0])
        if not any(value is n or (n is not None and value == n) for n in neutral):
            out.append(f"{flag} ({value!r})")
    return out


def refuse_megatron_settings(args, what: str) -> None:
    refused = refused_megatron_settings(args)
    if refused:
        raise CheckpointError(
            f"the {what} uses {', '.join(refused)}, which megatron_ul does not compute; not "
            f"imported (it would compute other logits)"
        )


# ---- our ModelConfig, per export target --------------------------------------------------------
# Fields that never change the function a checkpoint computes (training, memory, kernels).
OUR_NO_EFFECT = frozenset(
    """attention_dropout hidden_dropout init_method_std use_flash_attn recompute_granularity
    recompute_method recompute_num_layers fused_layers fused_layers_backend
    tiled_loss_chunk_size tiled_mlp_chunk_size attention_block_tiles
    activation_checkpoint_cpu_offload moe_router_load_balancing_type moe_aux_loss_coeff
    moe_z_loss_coeff moe_grouped_gemm moe_token_dispatcher_type""".split()
)
# What a mixture-of-experts model computes beyond its dense shape; meaningless without
# --num-experts (effective() spells them as their defaults then).
_MOE = """num_experts moe_ffn_hidden_size moe_router_topk moe_layer_freq moe_router_pre_softmax
moe_shared_expert_intermediate_size""".split()
_MOE_CAPACITY = """moe_expert_capacity_factor moe_token_drop_policy
moe_pad_expert_input_to_capacity""".split()
_SHAPE = """num_layers hidden_size num_attention_heads ffn_hidden_size seq_length
max_position_embeddings vocab_size make_vocab_size_divisible_by normalization norm_epsilon
untie_embeddings_and_output_weights""".split()
# {converter: the fields it carries}; every other field outside OUR_NO_EFFECT must keep its
# default (checked by check_carried).
OURS: dict[str, frozenset] = {
    "megatron_core": frozenset(
        _SHAPE
        + """num_query_groups kv_channels position_embedding_type rotary_base swiglu
        add_bias_linear gelu_approximate window_size""".split()
    ),
    "megatron_lm": frozenset(
        _SHAPE
        + """num_query_groups kv_channels position_embedding_type rotary_base swiglu
        add_bias_linear gelu_approximate""".split()
    ),
    "hf_gpt2": frozenset(_SHAPE + ["add_bias_linear", "gelu_approximate"]),
    # transformers' Mixtral routes every token (no capacity) with top-k softmax as ours
    # without --moe-router-pre-softmax; every layer sparse (hf_moe.py)
    "hf_mixtral": frozenset(
        _SHAPE
        + """num_query_groups kv_channels position_embedding_type rotary_base swiglu
        add_bias_linear window_size num_experts moe_ffn_hidden_size moe_router_topk
        moe_layer_freq""".split()
    ),
    "hf_llama": frozenset(
        _SHAPE
        + """num_query_groups kv_channels position_embedding_type rotary_base swiglu
        add_bias_linear gelu_approximate window_size""".split()
    ),
}
_FLAGS = {f.name: "--" + f.name.replace("_", "-") for f in fields(ModelConfig)}
_FLAGS["add_bias_linear"] = "--disable-bias-linear"


def _default(name: str) -> Any:
    f = {f.name: f for f in fields(ModelConfig)}[name]
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    raise TypeError(f"ModelConfig.{name} has no default")


def effective(m: dict) -> dict:
    """`m` with each setting that computes as its default spelled as the default: a window
    of -1 (unlimited), the default head dim or one query group per head given explicitly, a
    RoPE base without RoPE, a GELU variant without GELU."""
    out = dict(m)
    if out.get("window_size") is not None and out["window_size"][0] < 0:
        out["window_size"] = None
    heads = out["num_attention_heads"]
    if out.get("kv_channels") and out["kv_channels"] * heads == out["hidden_size"]:
        out["kv_channels"] = None
    if out.get("num_query_groups") == heads:
        out["num_query_groups"] = None
    if out.get("position_embedding_type") != "rope":
        out["rotary_base"] = _default("rotary_base")
    if out.get("swiglu"):
        out["gelu_approximate"] = _default("gelu_approximate")
    if out.get("num_experts") is None:
        for name in _MOE[1:] + _MOE_CAPACITY:
            out[name] = _default(name)
    elif out.get("moe_ffn_hidden_size") == out.get("ffn_hidden_size"):
        out["moe_ffn_hidden_size"] = None
    return out


def check_carried(m: dict, converter: str, target: str) -> None:
    """Refuse, naming the flag, a model whose non-default settings `converter` cannot carry
    into `target` (words for the message)."""
    carried, m = OURS[converter], effective(m)
    bad = [
        f"{_FLAGS[name]} {m[name]!r}"
        for name in m
        if name not in carried and name not in OUR_NO_EFFECT and m[name] != _default(name)
    ]
    if bad:
        raise CheckpointError(
            f"the model uses {', '.join(bad)}, which {target} cannot carry; not exported "
            f"(it would compute other logits)"
        )
