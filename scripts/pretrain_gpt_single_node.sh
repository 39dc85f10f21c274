#!/usr/bin/env bash
# One node, torchrun. Every size is an environment variable:
#   NPROC=8 TP=1 SP=8 SEQ_LENGTH=32768 bash scripts/pretrain_gpt_single_node.sh [extra flags]
# Defaults: a 1.3B GPT (24 layers, hidden 2048, 16 heads) at 32K tokens, Ulysses over 8 GPUs.
# Ulysses needs NUM_HEADS divisible by TP×SP and SEQ_LENGTH divisible by SP.
# Checkpoints and TensorBoard go to runs/single-node/ (RUN_NAME, CHECKPOINT_DIR, SAVE_INTERVAL:
# scripts/common.sh); running the script again resumes from the latest checkpoint there.
# torchrun forwards SIGTERM/SIGINT to the ranks, which save at the end of the iteration, and
# SIGKILLs them TORCH_ELASTIC_SHUTDOWN_TIMEOUT s later (30 s by default). Inside a Slurm job
# prefer scripts/slurm/*.sbatch with --nodes=1 (no torchrun; docs/operations.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/common.sh

NPROC=${NPROC:-8}
TP=${TP:-1}
SP=${SP:-$((NPROC / TP))}
NUM_LAYERS=${NUM_LAYERS:-24}
HIDDEN_SIZE=${HIDDEN_SIZE:-2048}
NUM_HEADS=${NUM_HEADS:-16}
SEQ_LENGTH=${SEQ_LENGTH:-32768}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-$((MICRO_BATCH * NPROC / (TP * SP)))}
TRAIN_ITERS=${TRAIN_ITERS:-1000}
run_args single-node
PRECISION=${PRECISION---bf16}           # PRECISION= (empty) for fp32, e.g. on CPU

PRETRAIN_ARGS=(
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --num-attention-heads "$NUM_HEADS"
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
    --position-embedding-type rope
    --tensor-model-parallel-size "$TP" --ds-sequence-parallel-size "$SP"
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
    --train-iters "$TRAIN_ITERS" --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 100
    --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0
    --use-flash-attn $PRECISION --log-interval 10
    "${DATA_ARGS[@]}" "${RUN_ARGS[@]}" "$@"
)
print_args_or_continue "$NPROC" "${PRETRAIN_ARGS[@]}"

export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron: keep communication kernels ordered with compute
exec torchrun --standalone --nproc-per-node "$NPROC" pretrain_gpt.py "${PRETRAIN_ARGS[@]}"
