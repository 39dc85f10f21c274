"""The transformer layer: norm → fused QKV (column-parallel) → Ulysses attention →
row-parallel projection → residual → norm → MLP → residual.

Shapes (sequence first): between layers [N/SP, b, h] (÷TP again under Megatron-SP).
The fused QKV weight is laid out by query group, [groups, (q_per_group + 2), head_dim, h]
(Megatron's layout), so a contiguous TP slice holds whole groups with their q, k and v.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..mpu.layers import ColumnParallelLinear, RowParallelLinear
from ..mpu.parallel_state import ParallelDims
from ..mpu.param_spec import FUSED_QKV
from ..mpu.random import get_rng_tracker
from ..timers import NO_TIMERS, Timers
from .attention.block_sparse import SparseHeads
from .attention.block_tiles import tiled_attention_block
from .attention.documents import DocumentMask
from .attention.layer import LayerAttention, model_call
from .attention.ring import Ring
from .attention.ulysses import DistributedAttention
from .init import normal_init, scaled_normal_init
from .norms import Norm
from .qkv import split_qkv
from .rotary import apply_rotary

if TYPE_CHECKING:  # the spec names this module's classes
    from .layer_spec import LayerSpec


def dropout(x: torch.Tensor, p: float, training: bool, sharded_sequence: bool) -> torch.Tensor:
    """Hidden dropout; on Megatron-SP sequence chunks it draws from the per-rank stream."""
    if not training or p == 0.0:
        return x
    if sharded_sequence:
        with get_rng_tracker().fork():
            return F.dropout(x, p, True)
    return F.dropout(x, p, True)


def norm_in_weight_dtype(norm: Norm, x: torch.Tensor) -> torch.Tensor:
    """norm(x) in the norm's weight dtype: under --fp32-residual-connection the residual x is
    fp32 while the weights (and the sublayer after the norm) are half precision."""
    return norm(x.to(norm.weight.dtype))


class SelfAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        key: str,
        seed: int,
        sequence_parallel: bool,
        num_layers: int,
        device,
        dtype,
        timers: Timers = NO_TIMERS,
        *,
        dims: ParallelDims,
    ):
        super().__init__()
        tp = dims.tp
        self.head_dim = cfg.head_dim
        self.q_heads = cfg.num_attention_heads // tp
        self.kv_heads = cfg.query_groups // tp
        qkv_size = (cfg.num_attention_heads + 2 * cfg.query_groups) * cfg.head_dim
        self.qkv = ColumnParallelLinear(
            cfg.hidden_size,
            qkv_size,
            normal_init(cfg.init_method_std, seed, key + ".qkv"),
            bias=cfg.add_bias_linear,
            sequence_parallel=sequence_parallel,
            fused=FUSED_QKV,
            device=device,
            dtype=dtype,
            tp_group=dims.tp_group,
        )
        self.proj = RowParallelLinear(
            cfg.num_attention_heads * cfg.head_dim,
            cfg.hidden_size,
            scaled_normal_init(cfg.init_method_std, num_layers, seed, key + ".proj"),
            bias=cfg.add_bias_linear,
            sequence_parallel=sequence_parallel,
            device=device,
            dtype=dtype,
            tp_group=dims.tp_group,
        )
        # The attention call's description, built once for the layer from the model's
        # configuration (the micro-batch adds its length and whether it has documents).
        call = model_call(
            cfg,
            torch.device(device) if device else torch.device("cpu"),
            dtype or torch.get_default_dtype(),
            tp=tp,
            sp=dims.sp,
            cp=dims.cp,
            documents=False,
        )
        layer_attention = LayerAttention(
            call,
            ring=Ring.from_dims(dims),
            recompute=cfg.recompute_granularity == "selective",
        )
        self.core = DistributedAttention(dims.sp, layer_attention, dims.sp_group, timers=timers)
        self.attention_dropout = cfg.attention_dropout

    def forward(self, x, rotary=None, documents: DocumentMask | None = None):
        return self.output(self.attend(self.project(x, rotary), documents))

    def project(self, x, rotary=None) -> list[torch.Tensor]:
        """[q, k, v] of x's tokens (RoPE applied), each in a buffer of its own."""
        qkv = self.qkv(x)  # [s, b, groups/TP * (qpg+2) * d]
        s, b = qkv.shape[:2]
        per_group = self.q_heads // self.kv_heads
        # Three owned buffers; no name keeps the fused output (or q, k, v) alive past its use.
        q, k, v = split_qkv(qkv.view(s, b, self.kv_heads, per_group + 2, self.head_dim), per_group)
        del qkv
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        return [q, k, v]

    def attend(
        self, qkv_list: list[torch.Tensor], documents: DocumentMask | None = None
    ) -> torch.Tensor:
        """The attention output [s, b, heads/TP, d]; empties qkv_list (see DistributedAttention)."""
        return self.core(
            qkv_list,
            dropout_p=self.attention_dropout if self.training else 0.0,
            documents=documents,
        )

    def output(self, out: torch.Tensor) -> torch.Tensor:
        s, b = out.shape[:2]
        return self.proj(out.reshape(s, b, self.q_heads * self.head_dim))


class TransformerLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_number: int,
        seed: int,
        sequence_parallel: bool,
        device=None,
        dtype=torch.float32,
        timers: Timers = NO_TIMERS,
        *,
        dims: ParallelDims,
        spec: LayerSpec,
    ):
        super().__init__()
        key = f"layers.{layer_number}"
        self.layer_number = layer_number
        args = (seed, sequence_parallel, cfg.num_layers, device, dtype)
        self.input_norm = spec.build_norm(cfg, sequence_parallel, device, dtype)
        self.attention = spec.attention(cfg, key + ".attention", *args, timers=timers, dims=dims)
        if cfg.sparse_attention is not None:  # this layer's layout (its own random blocks)
            self.attention.core.attention.use_sparse_heads(
                SparseHeads.of(cfg, dims, seed, layer_number)
            )
        self.post_attention_norm = spec.build_norm(cfg, sequence_parallel, device, dtype)
        self.mlp = spec.mlp_for(cfg, layer_number)(cfg, key + ".mlp", *args, dims=dims)
        self.hidden_dropout = cfg.hidden_dropout
        self.sequence_parallel = sequence_parallel
        self.attention_tiles = cfg.attention_block_tiles
        self.tile_ranks = dims.tp if sequence_parallel else 1  # Megatron-SP shards per tile

    def forward(
        self, x: torch.Tensor, rotary=None, documents: DocumentMask | None = None
    ) -> torch.Tensor:
        def drop(t: torch.Tensor) -> torch.Tensor:
            return dropout(t, self.hidden_dropout, self.training, self.sequence_parallel)

        x = x + drop(self._attention_block(x, rotary, documents))
        return x + drop(self.mlp(norm_in_weight_dtype(self.post_attention_norm, x)))

    def _attention_block(self, x, rotary, documents) -> torch.Tensor:
        """The attention sublayer before dropout and the residual add: the input norm and the
        attention (tiled along the sequence under --attention-block-tiles)."""
        attention = self.attention
        if self.attention_tiles == 1:
            return attention(norm_in_weight_dtype(self.input_norm, x), rotary, documents)
        return tiled_attention_block(
            lambda x_tile, rotary_tile: attention.project(
                norm_in_weight_dtype(self.input_norm, x_tile), rotary_tile
            ),
            lambda qkv_list: attention.attend(qkv_list, documents),
            attention.output,
            x,
            rotary,
            self.attention_tiles,
            self.tile_ranks,
        )
