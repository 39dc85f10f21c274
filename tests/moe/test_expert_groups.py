"""EP and expert-DP groups: carved from DP × CP × SP as megatron-core carves EP from DP × CP
(its RankGenerator over expert-TP, EP, expert-DP, PP with our CP × SP as its CP)."""

import pytest
import torch.distributed as dist

from megatron_ul.mpu import parallel_state as ps
from tests.distributed import run_distributed


def _expert_groups(rank, world, layouts):
    out = []
    for tp, sp, cp, pp, ep in layouts:
        dims = ps.initialize_model_parallel(
            tp, sp, pp, context_parallel_size=cp, expert_model_parallel_size=ep
        )
        assert dist.get_process_group_ranks(dims.ep_group) == dims.group_ranks.ep
        assert dist.get_process_group_ranks(dims.expert_dp_group) == dims.group_ranks.expert_dp
        assert dims.ep_rank == dims.group_ranks.ep.index(rank)
        assert dims.expert_dp_rank == dims.group_ranks.expert_dp.index(rank)
        assert dims.expert_dp_size * dims.ep == dims.dp_cp_sp_size
        out.append((dims.group_ranks.ep, dims.group_ranks.expert_dp))
    return out


LAYOUTS = {  # world -> layouts (tp, sp, cp, pp, ep)
    4: [(2, 2, 1, 1, 2), (1, 2, 1, 1, 2)],
    8: [(2, 2, 1, 1, 2), (2, 2, 1, 1, 4), (1, 2, 2, 1, 4), (1, 2, 1, 2, 2), (1, 1, 1, 1, 8)],
}


@pytest.mark.parametrize("world", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_expert_groups_match_megatron_core(world):
    core_ps = pytest.importorskip("megatron.core.parallel_state")
    layouts = LAYOUTS[world]
    results = run_distributed(_expert_groups, world, layouts)
    for i, (tp, _sp, _cp, pp, ep) in enumerate(layouts):
        expert_dp = world // (tp * pp * ep)
        generator = core_ps.RankGenerator(
            tp=tp, ep=ep, dp=expert_dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp"
        )
        want_ep = {tuple(r) for r in generator.get_ranks("ep")}
        want_dp = {tuple(r) for r in generator.get_ranks("dp")}
        for rank_groups in results:
            ep_ranks, dp_ranks = rank_groups[i]
            assert tuple(ep_ranks) in want_ep, (layouts[i], ep_ranks)
            assert tuple(dp_ranks) in want_dp, (layouts[i], dp_ranks)
        assert {tuple(r[i][0]) for r in results} == want_ep
        assert {tuple(r[i][1]) for r in results} == want_dp
