"""The layer spec's MLPs (model/layer_spec.py): fc1 (column-parallel) → activation → fc2
(row-parallel), optionally over sequence tiles (--tiled-mlp-chunk-size, model/tiled_mlp.py).

A variant sets how many ffn-wide blocks fc1 produces and how they are fused, its activation,
and how many [s, b, ffn/TP] tensors it keeps for backward (what the memory estimator counts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..mpu.layers import ColumnParallelLinear, RowParallelLinear
from ..mpu.parallel_state import ParallelDims
from ..mpu.param_spec import FUSED_GATE_UP
from .activation_shape import ActivationShape
from .init import normal_init, scaled_normal_init
from .tiled_mlp import tiled_mlp

# The MLP's gradients alive in its backward, as a fraction of what it saved (measured with
# tools/bench/bench_memory.py --peak).
GRADIENT_FRACTION = 0.75


class MLP(nn.Module):
    """fc1 → GELU (tanh-approximated for GPT-2) → fc2. Keeps GELU's input and output."""

    fc1_blocks = 1  # fc1's output is this many ffn-wide blocks
    fc1_fused: str | None = None  # their row layout (mpu/param_spec.py)
    saved_blocks = 2  # [s, b, ffn/TP] tensors kept for backward

    def __init__(
        self,
        cfg: ModelConfig,
        key: str,
        seed: int,
        sequence_parallel: bool,
        num_layers: int,
        device,
        dtype,
        *,
        dims: ParallelDims,
    ):
        super().__init__()
        self.gelu_approximate = cfg.gelu_approximate
        self.tile_tokens = cfg.tiled_mlp_chunk_size
        self.ffn = cfg.ffn_size
        # Several blocks are TP-split with that stride: each rank gets matching parts of all.
        self.fc1 = ColumnParallelLinear(
            cfg.hidden_size,
            self.ffn * self.fc1_blocks,
            normal_init(cfg.init_method_std, seed, key + ".fc1"),
            bias=cfg.add_bias_linear,
            sequence_parallel=sequence_parallel,
            stride=self.fc1_blocks,
            fused=self.fc1_fused,
            device=device,
            dtype=dtype,
            tp_group=dims.tp_group,
        )
        self.fc2 = RowParallelLinear(
            self.ffn,
            cfg.hidden_size,
            scaled_normal_init(cfg.init_method_std, num_layers, seed, key + ".fc2"),
            bias=cfg.add_bias_linear,
            sequence_parallel=sequence_parallel,
            device=device,
            dtype=dtype,
            tp_group=dims.tp_group,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tile_tokens is not None:
            return tiled_mlp(self._dense, x, self.tile_tokens)
        return self._dense(x)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(x)))

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        return F.gelu(h, approximate=self.gelu_approximate)

    def saved_bytes(self, shape: ActivationShape) -> float:
        """What the MLP keeps for backward beyond fc1's input; tiled, one tile's (alive
        while that tile is recomputed)."""
        ffn = shape.tokens * self.ffn / shape.tp
        if self.tile_tokens:
            ffn *= min(1.0, self.tile_tokens / shape.local_seq)
        return self.saved_blocks * ffn * shape.act_bytes

    def gradient_bytes(self, shape: ActivationShape) -> float:
        """The MLP's own gradients alive at once in its backward."""
        return GRADIENT_FRACTION * self.saved_bytes(shape)


class SwiGLUMLP(MLP):
    """Llama's MLP: fc1 is [gate; up], silu(gate) · up → fc2. Keeps [gate; up], silu(gate)
    and the product."""

    fc1_blocks = 2
    fc1_fused = FUSED_GATE_UP
    saved_blocks = 4

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
