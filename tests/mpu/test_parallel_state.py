"""The rank grid: rank = tp + TP·(sp + SP·(cp + CP·(dp + DP·pp))) and every group sliced
from it; the ParallelDims object says what the module-level getters say."""
import pytest

from megatron_ul.mpu import parallel_state as ps
from tests.distributed import RankFailure, run_distributed


def _groups(rank, world, tp, sp, pp, cp):
    dims = ps.initialize_model_parallel(tp, sp, pp, context_parallel_size=cp)
    assert dims is ps.get_parallel_dims()
    names = ["tp", "sp", "cp", "dp", "pp", "dp_sp", "sp_cp", "mp", "embedding"]
    # The grid object handed to the model and optimizer says what the getters say.
    assert (dims.tp, dims.sp, dims.cp, dims.dp, dims.pp, dims.world_size) == (
        ps.get_tensor_model_parallel_world_size(), ps.get_sequence_parallel_world_size(),
        ps.get_context_parallel_world_size(), ps.get_data_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(), world)
    assert (dims.tp_group, dims.sp_group, dims.cp_group, dims.dp_group, dims.pp_group,
            dims.dp_sp_group, dims.mp_group, dims.tp_sp_group, dims.embedding_group) == (
        ps.get_tensor_model_parallel_group(), ps.get_sequence_parallel_group(),
        ps.get_context_parallel_group(), ps.get_data_parallel_group(),
        ps.get_pipeline_model_parallel_group(), ps.get_data_sequence_parallel_group(),
        ps.get_model_parallel_group(), ps.get_tensor_sequence_parallel_group(),
        ps.get_embedding_group())
    assert (dims.next_stage_rank, dims.prev_stage_rank, dims.is_first_stage,
            dims.is_last_stage, dims.dp_sp_rank, dims.dp_sp_size) == (
        ps.get_pipeline_model_parallel_next_rank(), ps.get_pipeline_model_parallel_prev_rank(),
        ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage(),
        ps.get_data_sequence_parallel_rank(), ps.get_data_sequence_parallel_world_size())
    return {"groups": {n: ps.get_group_ranks(n) for n in names},
            "coords": (ps.get_tensor_model_parallel_rank(), ps.get_sequence_parallel_rank(),
                       ps.get_context_parallel_rank(), ps.get_data_parallel_rank(),
                       ps.get_pipeline_model_parallel_rank()),
            "dims_coords": (dims.tp_rank, dims.sp_rank, dims.cp_rank, dims.dp_rank,
                            dims.pp_rank),
            "dp_sp_rank": ps.get_data_sequence_parallel_rank(),
            "dp_sp_size": ps.get_data_sequence_parallel_world_size(),
            "split": ps.get_sequence_split(),
            "ring_neighbours": (ps.get_context_parallel_prev_rank(),
                                ps.get_context_parallel_next_rank()),
            "sizes": (ps.get_tensor_model_parallel_world_size(),
                      ps.get_sequence_parallel_world_size(),
                      ps.get_context_parallel_world_size(),
                      ps.get_data_parallel_world_size(),
                      ps.get_pipeline_model_parallel_world_size())}


@pytest.mark.parametrize("tp,sp,pp,cp", [(2, 2, 2, 1), (1, 4, 1, 1), (1, 2, 1, 2)])
def test_rank_grid_and_groups(tp, sp, pp, cp):
    world = 8
    dp = world // (tp * sp * pp * cp)

    def rank_of(t, s, c, d, p):
        return t + tp * (s + sp * (c + cp * (d + dp * p)))

    results = run_distributed(_groups, world, tp, sp, pp, cp)
    for rank, r in enumerate(results):
        t, s, c, d, p = r["coords"]
        assert r["dims_coords"] == r["coords"]
        assert rank_of(t, s, c, d, p) == rank
        assert r["sizes"] == (tp, sp, cp, dp, pp)
        g = r["groups"]
        assert g["tp"] == [rank_of(i, s, c, d, p) for i in range(tp)]
        assert g["sp"] == [rank_of(t, i, c, d, p) for i in range(sp)]
        assert g["cp"] == [rank_of(t, s, i, d, p) for i in range(cp)]
        assert g["dp"] == [rank_of(t, s, c, i, p) for i in range(dp)]
        assert g["pp"] == [rank_of(t, s, c, d, i) for i in range(pp)]
        assert r["ring_neighbours"] == (rank_of(t, s, (c - 1) % cp, d, p),
                                        rank_of(t, s, (c + 1) % cp, d, p))
        # every rank that shares the parameters: data, ring and Ulysses replicas
        assert sorted(g["dp_sp"]) == sorted(rank_of(t, j, k, i, p) for i in range(dp)
                                            for j in range(sp) for k in range(cp))
        assert g["dp_sp"][r["dp_sp_rank"]] == rank and r["dp_sp_size"] == dp * sp * cp
        assert sorted(g["sp_cp"]) == sorted(rank_of(t, j, k, d, p) for j in range(sp)
                                            for k in range(cp))
        assert r["split"] == (s + sp * c, sp * cp)
        assert sorted(g["mp"]) == sorted(rank_of(i, s, c, d, j)
                                         for i in range(tp) for j in range(pp))
        assert g["embedding"] == sorted({rank_of(t, s, c, d, 0), rank_of(t, s, c, d, pp - 1)})


def _bad_world(rank, world):
    ps.initialize_model_parallel(4, 1, 1)


def test_world_not_divisible_is_an_error():
    with pytest.raises(RankFailure, match="not divisible by TP\\*SP\\*CP\\*PP"):
        run_distributed(_bad_world, 2)
