"""The experts of one MoE layer on this rank: its EP share of the experts, each TP-split like
the dense MLP (fc1 column-wise, fc2 row-wise; expert-TP = TP), and the shared expert.

Parameter names are megatron-core's: `experts.local_experts.<e>.linear_fc1.weight` with `e`
the GLOBAL expert index (so names do not depend on EP), `shared_experts.linear_fc1.weight`.
Each expert is initialised from its own key, so its values do not depend on the layout.

The experts see tokens already grouped by expert (`counts[i]` rows for local expert i, on the
host: the dispatcher's one sync). Their fc2 output is this TP rank's partial sum; the MoE
layer reduces it over TP once, after combining. Two ways to run the matmuls:
  - per expert: one F.linear pair per local expert on its rows (megatron-core's
    SequentialMLP): a Python loop over the E/EP local experts, never over tokens;
  - grouped (--moe-grouped-gemm): torch._grouped_mm over all local experts at once, the
    weights stacked per call. Its CUDA kernel (aten/src/ATen/native/cuda/GroupedBlas.cpp,
    _grouped_mm_cuda) runs CUTLASS only for bf16 on sm90/sm100; elsewhere it falls back to
    one mm per group after reading the offsets on the host (GroupedMMUtils.h,
    _grouped_mm_fallback), the CPU's path too. Its rows need 16-byte aligned strides.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ...config import ModelConfig
from ...mpu.layers import ColumnParallelLinear, RowParallelLinear
from ...mpu.param_spec import FUSED_GATE_UP, set_param_spec
from ..init import normal_init, scaled_normal_init


def grouped_gemm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


def activation(h: torch.Tensor, swiglu: bool, gelu_approximate: str) -> torch.Tensor:
    if swiglu:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h, approximate=gelu_approximate)


class ExpertMLP(nn.Module):
    """linear_fc1 (column-parallel, [gate; up] under SwiGLU) → activation → linear_fc2
    (row-parallel): weights only, no bias; called on already dispatched rows."""

    def __init__(
        self,
        cfg: ModelConfig,
        ffn: int,
        key: str,
        seed: int,
        device,
        dtype,
        *,
        tp_group,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        blocks = 2 if cfg.swiglu else 1
        self.swiglu, self.gelu_approximate = cfg.swiglu, cfg.gelu_approximate
        self.linear_fc1 = ColumnParallelLinear(
            cfg.hidden_size,
            ffn * blocks,
            normal_init(cfg.init_method_std, seed, key + ".linear_fc1"),
            bias=False,
            sequence_parallel=sequence_parallel,
            stride=blocks,
            fused=FUSED_GATE_UP if cfg.swiglu else None,
            device=device,
            dtype=dtype,
            tp_group=tp_group,
        )
        self.linear_fc2 = RowParallelLinear(
            ffn,
            cfg.hidden_size,
            scaled_normal_init(cfg.init_method_std, cfg.num_layers, seed, key + ".linear_fc2"),
            bias=False,
            sequence_parallel=sequence_parallel,
            device=device,
            dtype=dtype,
            tp_group=tp_group,
        )


class Experts(nn.Module):
    """This EP rank's experts; `forward(rows, counts)` → this TP rank's partial outputs."""

    def __init__(
        self,
        cfg: ModelConfig,
        key: str,
        seed: int,
        device,
        dtype,
        *,
        ep_rank: int,
        ep_size: int,
        tp_group,
    ):
        super().__init__()
        assert cfg.num_experts is not None
        per_rank = cfg.num_experts // ep_size
        self.first = ep_rank * per_rank
        self.num_local = per_rank
        self.swiglu, self.gelu_approximate = cfg.swiglu, cfg.gelu_approximate
        self.grouped = cfg.moe_grouped_gemm
        self.local_experts = nn.ModuleDict(
            {
                str(e): ExpertMLP(
                    cfg,
                    cfg.moe_ffn_size,
                    f"{key}.experts.{e}",
                    seed,
                    device,
                    dtype,
                    tp_group=tp_group,
                )
                for e in range(self.first, self.first + per_rank)
            }
        )
        if ep_size > 1:
            for p in self.local_experts.parameters():
                # Replicated over expert-DP only: gradients sum there (not over EP).
                set_param_spec(p, grad_group="expert_dp")

    def experts(self) -> list[ExpertMLP]:
        return [cast(ExpertMLP, e) for e in self.local_experts.values()]

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if self.grouped:
            return self._grouped(rows, counts)
        outs = []
        for expert, chunk in zip(self.experts(), rows.split(counts)):
            h = activation(
                F.linear(chunk, expert.linear_fc1.weight), self.swiglu, self.gelu_approximate
            )
            outs.append(F.linear(h, expert.linear_fc2.weight))
        return torch.cat(outs) if outs else rows[:0]

    def _grouped(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        experts = self.experts()
        offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        offsets = offsets.to(rows.device, non_blocking=True)
        fc1 = torch.stack([e.linear_fc1.weight for e in experts]).transpose(1, 2)
        fc2 = torch.stack([e.linear_fc2.weight for e in experts]).transpose(1, 2)
        h = torch._grouped_mm(rows, fc1, offs=offsets)
        h = activation(h, self.swiglu, self.gelu_approximate)
        return torch._grouped_mm(h, fc2, offs=offsets)


class SharedExpert(ExpertMLP):
    """megatron-core's SharedExpertMLP without a gate: a dense MLP every token goes through,
    on the layer's own layout (Megatron-SP included)."""

    def __init__(
        self,
        cfg: ModelConfig,
        ffn: int,
        key: str,
        seed: int,
        sequence_parallel: bool,
        device,
        dtype,
        *,
        tp_group,
    ):
        super().__init__(
            cfg,
            ffn,
            key,
            seed,
            device,
            dtype,
            tp_group=tp_group,
            sequence_parallel=sequence_parallel,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = activation(self.linear_fc1(x), self.swiglu, self.gelu_approximate)
        return self.linear_fc2(h)
