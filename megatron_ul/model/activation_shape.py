"""One rank's share of a layer's activations for one micro-batch: what a layer-spec module
(model/layer_spec.py) is told when it says how many bytes it keeps for backward.

Shapes are sequence first, [s, b, h]: s tokens of each sequence sit on a rank between layers
(N / (SP·CP)), a TP rank's linear layers see all s of them (gathered under Megatron-SP), the
norms only s / TP under Megatron-SP.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ActivationShape:
    seq: float  # tokens of one sequence on this rank between layers: N / (SP·CP)
    batch: int  # micro-batch size
    tp: int
    sequence_parallel: bool  # Megatron-SP: the norms and the residual stream are ÷TP again
    act_bytes: int  # element of a matmul input or output
    residual_bytes: int  # element of the residual stream (the norms' inputs)

    @property
    def local_seq(self) -> float:
        """Tokens of one sequence a norm sees (and a tiled MLP cuts into chunks)."""
        return self.seq / (self.tp if self.sequence_parallel else 1)

    @property
    def norm_tokens(self) -> float:
        """Rows of a norm's input: local_seq × batch."""
        return self.local_seq * self.batch

    @property
    def tokens(self) -> float:
        """Rows of a TP rank's linear layers' inputs and outputs: seq × batch."""
        return self.seq * self.batch
