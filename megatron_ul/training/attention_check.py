"""Attention the run cannot compute, refused before anything is built: the configuration's
attention call on this run's device, judged by attention_dispatch (the one decision)."""

from __future__ import annotations

import torch

from ..config import ResolvedConfig, ConfigError
from ..model.attention_dispatch import AttentionCall, kernel_refusal
from .dry_run import precision_of


def attention_call(cfg: ResolvedConfig, device: torch.device) -> AttentionCall:
    """The attention call every layer of this run makes (per-rank head counts)."""
    m, p = cfg.model, cfg.parallel
    heads = p.tensor_model_parallel_size * p.ds_sequence_parallel_size
    q_heads = m.num_attention_heads // heads
    kv_heads = max(q_heads * m.query_groups // m.num_attention_heads, 1)
    return AttentionCall(
        device,
        precision_of(cfg)[1],
        m.head_dim,
        q_heads,
        kv_heads,
        cfg.data.reset_attention_mask,
        m.attention_window,
        p.context_parallel_size > 1,
        m.use_flash_attn,
        dropout=m.attention_dropout > 0,
    )


def refuse_unrunnable_attention(cfg: ResolvedConfig, device: torch.device) -> None:
    """Raise ConfigError (every rank, same message) where no fused kernel takes the call."""
    why = kernel_refusal(attention_call(cfg, device))
    if why is not None:
        raise ConfigError(why)
