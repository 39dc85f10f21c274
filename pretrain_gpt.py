#!/usr/bin/env python
"""Pretrain a GPT with TP × SP (Ulysses) × PP × DP.

    torchrun --nproc-per-node 4 pretrain_gpt.py --ds-sequence-parallel-size 2 \
        --tensor-model-parallel-size 2 --mock-data --vocab-size 1024 ...
"""

import sys

from megatron_ul.exit_signals import catch_exit_signals

if __name__ == "__main__":
    # Before torch is imported: a SIGTERM/SIGUSR1 from Slurm during start-up must not kill
    # the rank (megatron_ul/exit_signals.py).
    catch_exit_signals()
    from megatron_ul.training.pretrain import main

    sys.exit(main())
