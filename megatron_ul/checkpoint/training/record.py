"""What a checkpoint records of the run besides its tensors: where training resumes, and the
parallel layout that saved it (compared on load: the RNG states continue only on the same one)."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import ResolvedConfig


@dataclass
class Resume:
    iteration: int = 0
    consumed_samples: int = 0
    consumed_valid_samples: int = 0


def run_layout(cfg: ResolvedConfig) -> dict:
    p = cfg.parallel
    # "cp" only when there is a ring: layouts saved before the ring axis existed still match.
    ring = {"cp": p.context_parallel_size} if p.context_parallel_size > 1 else {}
    return {
        **ring,
        "tp": p.tensor_model_parallel_size,
        "sp": p.ds_sequence_parallel_size,
        "pp": p.pipeline_model_parallel_size,
        "dp": p.data_parallel_size,
        "world": p.world_size,
        "sequence_parallel": p.sequence_parallel,
        "vp": p.num_layers_per_virtual_pipeline_stage,
    }
