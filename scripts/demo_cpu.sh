#!/usr/bin/env bash
# The README's CPU demo, end to end on real text (Python's standard library sources):
# build the corpus → train a SentencePiece tokenizer → preprocess → train a small GPT with
# Ulysses over 2 CPU processes (gloo). About 2-3 minutes on 2 cores; the loss falls from ~8.
#   bash scripts/demo_cpu.sh            (WORKDIR=data/demo, TRAIN_ITERS=200, NPROC=2)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/common.sh

WORKDIR=${WORKDIR:-data/demo}
NPROC=${NPROC:-2}
TRAIN_ITERS=${TRAIN_ITERS:-200}
mkdir -p "$WORKDIR"

PRETRAIN_ARGS=(
    --data-path "$WORKDIR/demo_text_document" --tokenizer-type SentencePieceTokenizer
    --tokenizer-model "$WORKDIR/tokenizer.model" --split 98,2,0
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 256
    --position-embedding-type rope --normalization RMSNorm --swiglu
    --ds-sequence-parallel-size "$NPROC" --micro-batch-size 8 --global-batch-size 8
    --train-iters "$TRAIN_ITERS" --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 10
    --attention-dropout 0 --hidden-dropout 0 --log-interval 10
    --eval-interval "$TRAIN_ITERS" --eval-iters 4 "$@"
)
print_args_or_continue "$NPROC" "${PRETRAIN_ARGS[@]}"

if [[ ! -f "$WORKDIR/demo_text_document.idx" ]]; then
    python -m tools.make_demo_corpus --output "$WORKDIR/corpus.jsonl" --max-mb 4
    python -m tools.train_tokenizer --input "$WORKDIR/corpus.jsonl" \
        --model-prefix "$WORKDIR/tokenizer" --vocab-size 2000
    python -m tools.preprocess_data --input "$WORKDIR/corpus.jsonl" \
        --output-prefix "$WORKDIR/demo" --tokenizer-type SentencePieceTokenizer \
        --tokenizer-model "$WORKDIR/tokenizer.model" --append-eod --workers 2
fi
OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
    "${PRETRAIN_ARGS[@]}"
