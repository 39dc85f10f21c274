"""The rank grid and every process group.

world = PP x DP x CP x SP x TP with TP varying fastest, then SP (Ulysses), CP (ring), DP, PP:
    rank = tp + TP * (sp + SP * (cp + CP * (dp + DP * pp)))
The chattiest axes sit on the closest ranks: TP and the Ulysses all-to-all within a node, the
ring's neighbour-to-neighbour p2p next (Megatron-LM also puts CP between TP and DP).
A sequence is split over SP x CP ranks; parameters are replicated over DP x CP x SP.
Each group is a slice of `torch.arange(world).view(PP, DP, CP, SP, TP)` along some axes.
This is the only module that creates process groups.

`initialize_model_parallel` builds one `ParallelDims` (the grid's sizes, this rank's
coordinates and its groups) and returns it; code is handed it and uses it directly. Unlike
Megatron's parallel_state this module keeps no state: there are no module-level getters, so
nothing can reach the grid except through the object it was handed
(tests/test_explicit_groups.py keeps it that way).
"""

from __future__ import annotations

import datetime
import functools
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

_AXES = ("pp", "dp", "cp", "sp", "tp")  # the grid's axes, slowest first


@dataclass(frozen=True)
class GridGroups:
    """One entry per group this rank belongs to (a ProcessGroup, or its list of global ranks),
    named by the grid axes it spans, in grid order."""

    tp: Any
    sp: Any  # Ulysses
    cp: Any  # the ring: k/v blocks travel between its ranks
    dp: Any
    pp: Any
    cp_sp: Any  # all ranks that split one sequence
    dp_cp_sp: Any  # parameters are replicated over these: grads sum here (and ZeRO shards)
    cp_sp_tp: Any  # one model replica's data-parallel-free slice (checks)
    pp_tp: Any  # model-parallel (one copy of the model): clipping norms, consistency checks
    embedding: Any  # first and last pipeline stage of this rank's (dp, cp, sp, tp) column
    # Expert parallelism splits dp_cp_sp (index sp + SP·(cp + CP·dp)) as ep + EP·expert_dp,
    # EP fastest (megatron-core carves EP from DP × CP the same way, after expert-TP = TP).
    ep: Any = None  # the experts are sharded over these; tokens travel between them
    expert_dp: Any = None  # replicas of one expert shard: expert gradients sum here


# The axes each GridGroups field (but embedding, built on its own) spans.
_GROUP_AXES = (
    ("tp", ("tp",)),
    ("sp", ("sp",)),
    ("cp", ("cp",)),
    ("dp", ("dp",)),
    ("pp", ("pp",)),
    ("cp_sp", ("cp", "sp")),
    ("dp_cp_sp", ("dp", "cp", "sp")),
    ("cp_sp_tp", ("cp", "sp", "tp")),
    ("pp_tp", ("pp", "tp")),
)


@dataclass(frozen=True)
class ParallelDims:
    """The rank grid of a run, this rank's coordinates in it, and its process groups."""

    tp: int
    sp: int
    dp: int
    pp: int
    coords: dict[str, int]  # axis -> this rank's coordinate
    groups: GridGroups  # ProcessGroup each (None: a single-rank grid)
    group_ranks: GridGroups  # list of global ranks each
    embedding_ranks: list[int]  # first and last pipeline stage of this rank's column
    cp: int = 1  # ring-attention degree (--context-parallel-size)
    ep: int = 1  # expert-parallel degree (--expert-model-parallel-size), within DP × CP × SP

    @property
    def world_size(self) -> int:
        return self.tp * self.sp * self.cp * self.dp * self.pp

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def sp_rank(self) -> int:
        return self.coords["sp"]

    @property
    def cp_rank(self) -> int:
        return self.coords["cp"]

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def dp_cp_sp_size(self) -> int:
        """Ranks that replicate the parameters: DP x CP x SP."""
        return self.dp * self.cp * self.sp

    @property
    def dp_cp_sp_rank(self) -> int:
        return self.coords["sp"] + self.sp * (self.coords["cp"] + self.cp * self.coords["dp"])

    @property
    def ep_rank(self) -> int:
        return self.dp_cp_sp_rank % self.ep

    @property
    def expert_dp_size(self) -> int:
        return self.dp_cp_sp_size // self.ep

    @property
    def expert_dp_rank(self) -> int:
        return self.dp_cp_sp_rank // self.ep

    @property
    def ep_group(self):
        """The ranks the experts are sharded over (MoE token all-to-all)."""
        return self.groups.ep

    @property
    def expert_dp_group(self):
        """Ranks holding the same experts: expert gradients sum here (not over EP)."""
        return self.groups.expert_dp

    @property
    def sequence_split(self) -> tuple[int, int]:
        """(rank, size) of this rank among all that split one sequence: Ulysses x ring, the
        Ulysses coordinate varying fastest (data/sequence_layout.py: which tokens)."""
        return self.coords["sp"] + self.sp * self.coords["cp"], self.sp * self.cp

    @property
    def tp_group(self):
        return self.groups.tp

    @property
    def sp_group(self):
        """The Ulysses (DeepSpeed sequence-parallel) group."""
        return self.groups.sp

    @property
    def cp_group(self):
        """The ring: ranks with the same Ulysses coordinate and different chunk pairs of one
        sequence; k/v blocks travel between them."""
        return self.groups.cp

    @property
    def cp_next_rank(self) -> int:
        """Global rank of the next ring neighbour (k/v blocks go there)."""
        ranks = self.group_ranks.cp
        return ranks[(self.cp_rank + 1) % len(ranks)]

    @property
    def cp_prev_rank(self) -> int:
        ranks = self.group_ranks.cp
        return ranks[(self.cp_rank - 1) % len(ranks)]

    @property
    def dp_group(self):
        return self.groups.dp

    @property
    def pp_group(self):
        return self.groups.pp

    @property
    def dp_cp_sp_group(self):
        """DP x CP x SP: gradient reduction and ZeRO sharding (parameters are replicated over
        all three)."""
        return self.groups.dp_cp_sp

    @property
    def pp_tp_group(self):
        """PP x TP (model-parallel): ranks that together hold one copy of the model."""
        return self.groups.pp_tp

    @property
    def embedding_group(self):
        return self.groups.embedding

    @functools.cached_property
    def dp_cp_sp_mesh(self):
        """1-D DeviceMesh over this rank's dp_cp_sp group, for FSDP2 (ZeRO-3). Built on first
        use from the existing group, so it creates no new communicator."""
        from torch.distributed.device_mesh import DeviceMesh

        device_type = "cuda" if dist.get_backend(self.dp_cp_sp_group) == "nccl" else "cpu"
        return DeviceMesh.from_group(self.dp_cp_sp_group, device_type, mesh_dim_names=("dp_cp_sp",))

    @functools.cached_property
    def checkpoint_group(self):
        """A gloo group of all ranks for torch.distributed.checkpoint's own coordination, made
        on first use (collective: every rank's first torch_dist save or load). It shares no
        group or device with training's collectives, so an asynchronous save can use it from
        its thread."""
        return dist.new_group(backend="gloo")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def next_stage_rank(self) -> int:
        ranks = self.group_ranks.pp
        return ranks[(self.pp_rank + 1) % len(ranks)]

    @property
    def prev_stage_rank(self) -> int:
        ranks = self.group_ranks.pp
        return ranks[(self.pp_rank - 1) % len(ranks)]


def _grid(world: int, tp: int, sp: int, pp: int, cp: int = 1) -> torch.Tensor:
    dp = world // (tp * sp * pp * cp)
    return torch.arange(world).view(pp, dp, cp, sp, tp)


def _groups_varying(grid: torch.Tensor, axes: tuple[str, ...]) -> list[list[int]]:
    """All rank lists in which exactly `axes` vary and the other coordinates are fixed."""
    keep = [i for i, a in enumerate(_AXES) if a in axes]
    fixed = [i for i, a in enumerate(_AXES) if a not in axes]
    perm = grid.permute(*fixed, *keep)
    n = 1
    for i in keep:
        n *= grid.shape[i]
    return [row.tolist() for row in perm.reshape(-1, n)]


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    ulysses_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    timeout: datetime.timedelta | None = None,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
) -> ParallelDims:
    """Build every group and return the grid. Must be called on all ranks after
    init_process_group. Keeps nothing: the caller hands the result to what needs it."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    tp, sp, pp = tensor_model_parallel_size, ulysses_size, pipeline_model_parallel_size
    cp = context_parallel_size
    if world % (tp * sp * pp * cp) != 0:
        raise ValueError(
            f"world size {world} is not divisible by TP*SP*CP*PP = {tp}*{sp}*{cp}*{pp}"
        )
    grid = _grid(world, tp, sp, pp, cp)
    dp = grid.shape[1]
    ep = expert_model_parallel_size
    if (dp * cp * sp) % ep != 0:
        raise ValueError(f"DP×CP×SP = {dp}×{cp}×{sp} is not divisible by EP = {ep}")
    where = (grid == rank).nonzero()[0].tolist()
    coords = dict(zip(_AXES, where))

    groups: dict[str, Any] = {}
    group_ranks: dict[str, list[int]] = {}
    for name, axes in _GROUP_AXES:
        # new_group is collective over the world: every rank creates every group, in order.
        for ranks in _groups_varying(grid, axes):
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                groups[name], group_ranks[name] = group, ranks

    # Embedding group: first and last pipeline stage of each (dp, cp, sp, tp) column, for tied
    # input/output embeddings.
    embedding_ranks = None
    for pp_ranks in _groups_varying(grid, ("pp",)):
        ranks = sorted({pp_ranks[0], pp_ranks[-1]})
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            groups["embedding"], embedding_ranks = group, ranks
    groups.setdefault("embedding", None)  # a middle stage holds no embedding
    group_ranks["embedding"] = embedding_ranks or []
    for name, ranks_list in _expert_groups(grid, ep).items():
        for ranks in ranks_list:
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                groups[name], group_ranks[name] = group, ranks
    return ParallelDims(
        tp,
        sp,
        dp,
        pp,
        coords,
        GridGroups(**groups),
        GridGroups(**group_ranks),
        embedding_ranks or [],
        cp=cp,
        ep=ep,
    )


def _expert_groups(grid: torch.Tensor, ep: int) -> dict[str, list[list[int]]]:
    """EP and expert-DP rank lists: each (pp, tp) slice's dp_cp_sp ranks in dp_cp_sp order,
    cut into consecutive runs of EP (the EP groups) and their strided complements."""
    pp, dp, cp, sp, tp = grid.shape
    per_slice = grid.permute(0, 4, 1, 2, 3).reshape(pp * tp, dp * cp * sp // ep, ep)
    return {
        "ep": [row.tolist() for row in per_slice.reshape(-1, ep)],
        "expert_dp": [
            row.tolist() for row in per_slice.transpose(1, 2).reshape(-1, dp * cp * sp // ep)
        ],
    }


def single_rank_dims() -> ParallelDims:
    """A grid of one rank with no groups (sizes 1, coordinates 0): every mpu collective on a
    None group is the identity. For models built without communication (generation, the
    parameter table's meta-device build)."""
    names = [f.name for f in fields(GridGroups)]
    return ParallelDims(
        1,
        1,
        1,
        1,
        dict.fromkeys(_AXES, 0),
        GridGroups(**dict.fromkeys(names)),
        GridGroups(**{n: [0] for n in names}),
        [],
    )
