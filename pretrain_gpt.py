#!/usr/bin/env python
"""Pretrain a GPT with TP × SP (Ulysses) × PP × DP.

    torchrun --nproc-per-node 4 pretrain_gpt.py --ds-sequence-parallel-size 2 \
        --tensor-model-parallel-size 2 --mock-data --vocab-size 1024 ...
"""
import sys

from megatron_ul.training.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
