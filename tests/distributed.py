"""Multi-rank tests run through tools.local_ranks (gloo on loopback, timeouts everywhere)."""

from tools.local_ranks import RankFailure, free_port, run_on_local_ranks

run_distributed = run_on_local_ranks

__all__ = ["RankFailure", "free_port", "run_distributed"]
