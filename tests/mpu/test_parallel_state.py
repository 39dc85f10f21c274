"""The rank grid: rank = tp + TP·(sp + SP·(cp + CP·(dp + DP·pp))) and every group sliced
from it; each group of the ParallelDims holds exactly the ranks it lists."""

import dataclasses

import pytest
import torch.distributed as dist

from megatron_ul.mpu import parallel_state as ps
from tests.distributed import RankFailure, run_distributed


def _groups(rank, world, tp, sp, pp, cp):
    dims = ps.initialize_model_parallel(tp, sp, pp, context_parallel_size=cp)
    names = [f.name for f in dataclasses.fields(ps.GridGroups)]
    # The listed ranks are what the process group objects hold; the caller checks those lists
    # against the grid formula, and the accessors the model and optimizer use hand out the
    # same groups.
    for name in names:
        assert dist.get_process_group_ranks(getattr(dims.groups, name)) == getattr(
            dims.group_ranks, name
        ), name
    accessors = {
        name: dist.get_process_group_ranks(getattr(dims, f"{name}_group"))
        for name in names
        if hasattr(dims, f"{name}_group")
    }
    assert accessors == {name: getattr(dims.group_ranks, name) for name in accessors}
    assert set(accessors) >= {"tp", "sp", "cp", "dp", "pp", "dp_cp_sp", "pp_tp", "embedding"}
    assert dims.world_size == world
    assert (dims.is_first_stage, dims.is_last_stage) == (dims.pp_rank == 0, dims.pp_rank == pp - 1)
    return {
        "groups": {n: list(getattr(dims.group_ranks, n)) for n in names},
        "coords": (dims.tp_rank, dims.sp_rank, dims.cp_rank, dims.dp_rank, dims.pp_rank),
        "dp_cp_sp_rank": dims.dp_cp_sp_rank,
        "dp_cp_sp_size": dims.dp_cp_sp_size,
        "split": dims.sequence_split,
        "ring_neighbours": (dims.cp_prev_rank, dims.cp_next_rank),
        "stage_neighbours": (dims.prev_stage_rank, dims.next_stage_rank),
        "sizes": (dims.tp, dims.sp, dims.cp, dims.dp, dims.pp),
    }


@pytest.mark.parametrize(
    "tp,sp,pp,cp",
    [(2, 2, 2, 1)]
    + [pytest.param(*g, marks=pytest.mark.slow) for g in ((1, 4, 1, 1), (1, 2, 1, 2))],
)
def test_rank_grid_and_groups(tp, sp, pp, cp):
    world = 8
    dp = world // (tp * sp * pp * cp)

    def rank_of(t, s, c, d, p):
        return t + tp * (s + sp * (c + cp * (d + dp * p)))

    results = run_distributed(_groups, world, tp, sp, pp, cp)
    for rank, r in enumerate(results):
        t, s, c, d, p = r["coords"]
        assert rank_of(t, s, c, d, p) == rank
        assert r["sizes"] == (tp, sp, cp, dp, pp)
        g = r["groups"]
        assert g["tp"] == [rank_of(i, s, c, d, p) for i in range(tp)]
        assert g["sp"] == [rank_of(t, i, c, d, p) for i in range(sp)]
        assert g["cp"] == [rank_of(t, s, i, d, p) for i in range(cp)]
        assert g["dp"] == [rank_of(t, s, c, i, p) for i in range(dp)]
        assert g["pp"] == [rank_of(t, s, c, d, i) for i in range(pp)]
        assert r["ring_neighbours"] == (
            rank_of(t, s, (c - 1) % cp, d, p),
            rank_of(t, s, (c + 1) % cp, d, p),
        )
        assert r["stage_neighbours"] == (
            rank_of(t, s, c, d, (p - 1) % pp),
            rank_of(t, s, c, d, (p + 1) % pp),
        )
        # every rank that shares the parameters: data, ring and Ulysses replicas
        assert sorted(g["dp_cp_sp"]) == sorted(
            rank_of(t, j, k, i, p) for i in range(dp) for j in range(sp) for k in range(cp)
        )
        assert g["dp_cp_sp"][r["dp_cp_sp_rank"]] == rank and r["dp_cp_sp_size"] == dp * sp * cp
        assert sorted(g["cp_sp"]) == sorted(
            rank_of(t, j, k, d, p) for j in range(sp) for k in range(cp)
        )
        assert r["split"] == (s + sp * c, sp * cp)
        assert sorted(g["pp_tp"]) == sorted(
            rank_of(i, s, c, d, j) for i in range(tp) for j in range(pp)
        )
        assert sorted(g["cp_sp_tp"]) == sorted(
            rank_of(i, j, k, d, p) for i in range(tp) for j in range(sp) for k in range(cp)
        )
        assert g["embedding"] == sorted({rank_of(t, s, c, d, 0), rank_of(t, s, c, d, pp - 1)})


def _bad_world(rank, world):
    ps.initialize_model_parallel(4, 1, 1)


def test_world_not_divisible_is_an_error():
    with pytest.raises(RankFailure, match="not divisible by TP\\*SP\\*CP\\*PP"):
        run_distributed(_bad_world, 2)
