"""Multi-rank tests run through megatron_ul.local_ranks (gloo on loopback, timeouts everywhere)."""

from megatron_ul.local_ranks import RankFailure, free_port, run_on_local_ranks

run_distributed = run_on_local_ranks

__all__ = ["RankFailure", "free_port", "run_distributed"]
