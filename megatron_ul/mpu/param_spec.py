"""How a parameter is laid out across ranks, attached to it by the layer that creates it.

The layers in mpu/layers.py own the sharding rules, so they are the only place that writes
these facts; everything that needs them (checkpoint resharding and conversion, ZeRO state, the
Hugging Face and Megatron-LM mappings) reads them back from `param_spec(p)` or from the table
built from a model (pipeline/param_table.py), never from the parameter's name.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

# Values of ParamSpec.fused: how the rows (dim 0) of a fused weight are organised.
FUSED_QKV = "qkv"  # [query groups, q_per_group + 2, head_dim, ...]: each group's q, k, v
FUSED_GATE_UP = "gate_up"  # [gate; up] of a SwiGLU MLP (TP-split with stride 2)


@dataclass(frozen=True)
class ParamSpec:
    partition_dim: int | None = None  # TP split dimension; None = replicated over TP
    partition_stride: int = 1  # blocks laid end to end along partition_dim
    vocab_padded: bool = False  # dim 0 is the vocabulary, padded for the TP size
    fused: str | None = None  # FUSED_QKV, FUSED_GATE_UP or None
    # How training treats the parameter in this run, not how it is stored (so not in to_json):
    sequence_parallel: bool = False  # TP-replicated, sees a sequence chunk: grads sum over TP
    tied_replica: bool = False  # the last stage's copy of the tied word embeddings
    # The ParallelDims group (named without `_group`) its gradient sums over: dp_cp_sp for
    # dense parameters; an expert's names its expert-data-parallel group.
    grad_group: str = "dp_cp_sp"

    @property
    def tensor_parallel(self) -> bool:
        return self.partition_dim is not None

    def to_json(self) -> dict:
        """The stored layout (the parameter table's columns)."""
        return {
            "partition_dim": self.partition_dim,
            "partition_stride": self.partition_stride,
            "vocab_padded": self.vocab_padded,
            "fused": self.fused,
        }


def param_spec(p: torch.Tensor) -> ParamSpec:
    """The spec a layer attached to `p` (replicated when none was: norms, position table)."""
    return getattr(p, "spec", None) or ParamSpec()


def set_param_spec(p: torch.Tensor, **changes) -> None:
    """Attach `p`'s spec with `changes` applied (the one way parameters are tagged)."""
    # an attribute of the parameter (as Megatron's tensor_model_parallel): every copy and
    # wrapper of the parameter that keeps its attributes keeps its layout
    p.spec = replace(param_spec(p), **changes)  # type: ignore[attr-defined]


def full_shape(p: torch.Tensor, tp: int) -> list[int]:
    """The TP-merged shape of this rank's piece `p` (padded vocabulary rows included)."""
    spec, shape = param_spec(p), list(p.shape)
    if spec.partition_dim is not None:
        shape[spec.partition_dim] *= tp
    return shape
