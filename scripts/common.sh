# Sourced by the launch scripts. Gives them DATA_ARGS, run_args (checkpoints, TensorBoard, the
# time limit) and print_args_or_continue.
#
# Data: DATA_PATH=prefix (a tools/preprocess_data.py output, e.g. data/demo_text_document)
# with TOKENIZER_MODEL=x.model (SentencePiece), VOCAB_FILE + MERGE_FILE (GPT-2 BPE) or
# TOKENIZER_TYPE=NullTokenizer + VOCAB_SIZE (token ids as text).
# Without DATA_PATH the scripts train on --mock-data (random tokens) with VOCAB_SIZE.
if [[ -n "${DATA_PATH:-}" ]]; then
    if [[ "${TOKENIZER_TYPE:-}" == NullTokenizer ]]; then
        DATA_ARGS=(--data-path "$DATA_PATH" --tokenizer-type NullTokenizer
                   --vocab-size "${VOCAB_SIZE:?set VOCAB_SIZE for the NullTokenizer}")
    elif [[ -n "${TOKENIZER_MODEL:-}" ]]; then
        DATA_ARGS=(--data-path "$DATA_PATH" --tokenizer-type SentencePieceTokenizer
                   --tokenizer-model "$TOKENIZER_MODEL")
    else
        DATA_ARGS=(--data-path "$DATA_PATH" --tokenizer-type GPT2BPETokenizer
                   --vocab-file "${VOCAB_FILE:?set VOCAB_FILE (or TOKENIZER_MODEL)}"
                   --merge-file "${MERGE_FILE:?set MERGE_FILE (or TOKENIZER_MODEL)}")
    fi
else
    DATA_ARGS=(--mock-data --vocab-size "${VOCAB_SIZE:-50257}")
fi

# Every run checkpoints and resumes by default. Everything of a run lives in RUN_DIR:
#   RUN_NAME        the Slurm job name, else the script's name
#   RUN_DIR         runs/$RUN_NAME under the directory the script runs in (the submit directory)
#   CHECKPOINT_DIR  $RUN_DIR/checkpoints: --save and --load (a rerun, resubmission or requeue
#                   resumes from the latest complete checkpoint there; none yet: from scratch)
#   SAVE_INTERVAL   iterations between checkpoints (default 200)
#   TENSORBOARD_DIR $RUN_DIR/tensorboard (one curve across restarts)
#   CKPT_FORMAT     torch_dist (default: every rank writes and reads only its own pieces) or
#                   torch (one file per TP/PP rank). --load reads either, whatever this says.
#   ASYNC_SAVE=1    --async-save: torch_dist files are written in the background while
#                   training continues (off by default: the rank keeps a CPU copy of its pieces)
#   EXIT_DURATION_IN_MINS  inside a Slurm job: the job's time left minus EXIT_MARGIN_MINS
#                   (default 10; half the time left when that is shorter), so that the last
#                   checkpoint is written before the time limit; "none" turns it off.
# --exit-signal-handler: SIGTERM or SIGUSR1 saves at the end of the current iteration and
# exits 0 (docs/operations.md: which process receives which signal, and when).
run_args() {
    RUN_NAME=${RUN_NAME:-${SLURM_JOB_NAME:-$1}}
    RUN_DIR=${RUN_DIR:-$PWD/runs/$RUN_NAME}
    CHECKPOINT_DIR=${CHECKPOINT_DIR:-$RUN_DIR/checkpoints}
    TENSORBOARD_DIR=${TENSORBOARD_DIR:-$RUN_DIR/tensorboard}
    RUN_ARGS=(--save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR"
              --save-interval "${SAVE_INTERVAL:-200}" --tensorboard-dir "$TENSORBOARD_DIR"
              --exit-signal-handler --ckpt-format "${CKPT_FORMAT:-torch_dist}")
    if [[ "${ASYNC_SAVE:-0}" == 1 ]]; then
        RUN_ARGS+=(--async-save)
    fi
    local minutes=${EXIT_DURATION_IN_MINS:-$(minutes_before_time_limit)}
    if [[ -n "$minutes" && "$minutes" != none ]]; then
        RUN_ARGS+=(--exit-duration-in-mins "$minutes")
    fi
}

# Minutes to train before saving and exiting ahead of this Slurm job's time limit (empty
# outside Slurm or without a limit). squeue's %L is the time left: [D-]HH:MM:SS, MM:SS or
# UNLIMITED/NOT_SET.
minutes_before_time_limit() {
    [[ -n "${SLURM_JOB_ID:-}" ]] || return 0
    local left
    left=$(squeue -h -j "$SLURM_JOB_ID" -o %L 2>/dev/null) || return 0
    [[ "$left" =~ ^(([0-9]+)-)?(([0-9]+):)?([0-9]+):([0-9]+)$ ]] || return 0
    local seconds=$(( ((10#${BASH_REMATCH[2]:-0} * 24 + 10#${BASH_REMATCH[4]:-0}) * 60
                       + 10#${BASH_REMATCH[5]}) * 60 + 10#${BASH_REMATCH[6]} ))
    awk -v left="$seconds" -v margin="${EXIT_MARGIN_MINS:-10}" 'BEGIN {
        left /= 60; m = left - margin; if (m < left / 2) m = left / 2
        printf "%.2f\n", (m > 0.01 ? m : 0.01) }'
}

# PRINT_ARGS_ONLY=1: print the world size and then pretrain_gpt.py's arguments, one per line,
# and stop (tests/scripts/test_launch_scripts.py validates them with --dry-run).
print_args_or_continue() {
    local world=$1; shift
    if [[ -n "${PRINT_ARGS_ONLY:-}" ]]; then
        printf '%s\n' "$world" "$@"
        exit 0
    fi
}
