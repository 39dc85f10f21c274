"""Ranks see the caller's environment, sys.path and working directory as they are at the call,
start from fresh module state, a rank's error reaches the caller, and ranks do not outlive a
killed caller."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.distributed import RankFailure, run_distributed

PROBE = "MEGATRON_UL_TEST_RANK_PROBE"


def report_surroundings(rank, world):
    import tools.local_ranks as local_ranks

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
    import tools.local_ranks as local_ranks

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


def write_pid_and_wait(rank, world, folder):
    with open(os.path.join(folder, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(300)


CALLER = """
import sys
from tools.local_ranks import run_on_local_ranks
from tests.test_local_ranks import write_pid_and_wait
run_on_local_ranks(write_pid_and_wait, 2, sys.argv[1], timeout=600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ranks_end_when_their_caller_is_killed(tmp_path):
    """A killed caller runs none of its clean-up: its ranks see it gone and exit."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER, str(tmp_path)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": root},
    )
    try:
        pid_files = [tmp_path / f"rank{r}.pid" for r in range(2)]
        deadline = time.monotonic() + 120
        while not all(f.exists() and f.read_text() for f in pid_files):
            assert time.monotonic() < deadline and caller.poll() is None, "ranks did not start"
            time.sleep(0.2)
        pids = [int(f.read_text()) for f in pid_files]
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait()
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in pids if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "ranks outlived their killed caller"
