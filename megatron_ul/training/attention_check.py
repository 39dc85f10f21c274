"""Attention the run cannot compute, refused before anything is built: the configuration's
attention call on this run's device, judged by the attention backends' one selection."""

from __future__ import annotations

import torch

from ..config import ConfigError, ResolvedConfig
from ..model.attention.backends import kernel_refusal
from .dry_run import attention_call

__all__ = ["attention_call", "refuse_unrunnable_attention"]


def refuse_unrunnable_attention(cfg: ResolvedConfig, device: torch.device) -> None:
    """Raise ConfigError (every rank, same message) where no fused kernel takes the call."""
    why = kernel_refusal(attention_call(cfg, device))
    if why is not None:
        raise ConfigError(why)
