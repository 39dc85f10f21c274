# Sourced by the launch scripts. Gives them DATA_ARGS and print_args_or_continue.
#
# Data: DATA_PATH=prefix (a tools/preprocess_data.py output, e.g. data/demo_text_document)
# with TOKENIZER_MODEL=x.model (SentencePiece) or VOCAB_FILE + MERGE_FILE (GPT-2 BPE).
# Without DATA_PATH the scripts train on --mock-data (random tokens) with VOCAB_SIZE.
if [[ -n "${DATA_PATH:-}" ]]; then
    if [[ -n "${TOKENIZER_MODEL:-}" ]]; then
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

# PRINT_ARGS_ONLY=1: print the world size and then pretrain_gpt.py's arguments, one per line,
# and stop (tests/scripts/test_launch_scripts.py validates them with --dry-run).
print_args_or_continue() {
    local world=$1; shift
    if [[ -n "${PRINT_ARGS_ONLY:-}" ]]; then
        printf '%s\n' "$world" "$@"
        exit 0
    fi
}
