"""Ranks see the caller's environment, sys.path and working directory as they are at the call,
start from fresh module state, and a rank's error reaches the caller."""

import os
import sys

import pytest

from tests.distributed import RankFailure, run_distributed

PROBE = "MEGATRON_UL_TEST_RANK_PROBE"


def report_surroundings(rank, world):
    import megatron_ul.local_ranks as local_ranks

    return {
        "probe": os.environ.get(PROBE),
        "rank": os.environ["RANK"],
        "cwd": os.getcwd(),
        "path_head": sys.path[0],
        "marker": getattr(local_ranks, "caller_marker", None),
    }


def fail_on_rank_one(rank, world):
    if rank == 1:
        raise ValueError("rank one says no")
    return rank


def test_ranks_see_the_callers_environment_at_the_call(tmp_path, monkeypatch):
    run_distributed(report_surroundings, 2)  # the fork server is running before the change
    monkeypatch.setenv(PROBE, "after")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import megatron_ul.local_ranks as local_ranks

    monkeypatch.setattr(local_ranks, "caller_marker", "parent only", raising=False)
    reports = run_distributed(report_surroundings, 2)
    assert [report["rank"] for report in reports] == ["0", "1"]
    for report in reports:
        assert report["probe"] == "after"
        assert report["cwd"] == str(tmp_path)
        assert report["path_head"] == str(tmp_path)
        assert report["marker"] is None  # module state is the rank's own, as with spawn


def test_a_ranks_error_reaches_the_caller():
    with pytest.raises(RankFailure, match="rank one says no"):
        run_distributed(fail_on_rank_one, 2)
