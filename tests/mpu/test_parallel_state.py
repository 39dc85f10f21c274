"""The rank grid: rank = tp + TP·(sp + SP·(dp + DP·pp)) and every group sliced from it."""
import pytest

from megatron_ul.mpu import parallel_state as ps
from tests.distributed import RankFailure, run_distributed


def _groups(rank, world, tp, sp, pp):
    dims = ps.initialize_model_parallel(tp, sp, pp)
    assert dims is ps.get_parallel_dims()
    names = ["tp", "sp", "dp", "pp", "dp_sp", "mp", "embedding"]
    # The grid object handed to the model and optimizer says what the getters say.
    assert (dims.tp, dims.sp, dims.dp, dims.pp, dims.world_size) == (
        ps.get_tensor_model_parallel_world_size(), ps.get_sequence_parallel_world_size(),
        ps.get_data_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(), world)
    assert (dims.tp_group, dims.sp_group, dims.dp_group, dims.pp_group, dims.dp_sp_group,
            dims.mp_group, dims.tp_sp_group, dims.embedding_group) == (
        ps.get_tensor_model_parallel_group(), ps.get_sequence_parallel_group(),
        ps.get_data_parallel_group(), ps.get_pipeline_model_parallel_group(),
        ps.get_data_sequence_parallel_group(), ps.get_model_parallel_group(),
        ps.get_tensor_sequence_parallel_group(), ps.get_embedding_group())
    assert (dims.next_stage_rank, dims.prev_stage_rank, dims.is_first_stage,
            dims.is_last_stage, dims.dp_sp_rank, dims.dp_sp_size) == (
        ps.get_pipeline_model_parallel_next_rank(), ps.get_pipeline_model_parallel_prev_rank(),
        ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage(),
        ps.get_data_sequence_parallel_rank(), ps.get_data_sequence_parallel_world_size())
    return {"groups": {n: ps.get_group_ranks(n) for n in names},
            "coords": (ps.get_tensor_model_parallel_rank(), ps.get_sequence_parallel_rank(),
                       ps.get_data_parallel_rank(), ps.get_pipeline_model_parallel_rank()),
            "dims_coords": (dims.tp_rank, dims.sp_rank, dims.dp_rank, dims.pp_rank),
            "dp_sp_rank": ps.get_data_sequence_parallel_rank(),
            "sizes": (ps.get_tensor_model_parallel_world_size(),
                      ps.get_sequence_parallel_world_size(),
                      ps.get_data_parallel_world_size(),
                      ps.get_pipeline_model_parallel_world_size())}


def _rank(tp_r, sp_r, dp_r, pp_r, TP, SP, DP):
    return tp_r + TP * (sp_r + SP * (dp_r + DP * pp_r))


@pytest.mark.parametrize("tp,sp,pp", [(2, 2, 2), (1, 4, 1)])
def test_rank_grid_and_groups(tp, sp, pp):
    world = 8
    dp = world // (tp * sp * pp)
    results = run_distributed(_groups, world, tp, sp, pp)
    for rank, r in enumerate(results):
        t, s, d, p = r["coords"]
        assert r["dims_coords"] == r["coords"]
        assert _rank(t, s, d, p, tp, sp, dp) == rank
        assert r["sizes"] == (tp, sp, dp, pp)
        g = r["groups"]
        assert g["tp"] == [_rank(i, s, d, p, tp, sp, dp) for i in range(tp)]
        assert g["sp"] == [_rank(t, i, d, p, tp, sp, dp) for i in range(sp)]
        assert g["dp"] == [_rank(t, s, i, p, tp, sp, dp) for i in range(dp)]
        assert g["pp"] == [_rank(t, s, d, i, tp, sp, dp) for i in range(pp)]
        assert sorted(g["dp_sp"]) == sorted(_rank(t, j, i, p, tp, sp, dp)
                                            for i in range(dp) for j in range(sp))
        assert g["dp_sp"][r["dp_sp_rank"]] == rank
        assert sorted(g["mp"]) == sorted(_rank(i, s, d, j, tp, sp, dp)
                                         for i in range(tp) for j in range(pp))
        assert g["embedding"] == sorted({_rank(t, s, d, 0, tp, sp, dp),
                                         _rank(t, s, d, pp - 1, tp, sp, dp)})


def _bad_world(rank, world):
    ps.initialize_model_parallel(4, 1, 1)


def test_world_not_divisible_is_an_error():
    with pytest.raises(RankFailure, match="not divisible by TP\\*SP\\*PP"):
        run_distributed(_bad_world, 2)
