"""Bytes autograd saves for backward per transformer layer and for the head (final norm,
output layer, loss), per rank, for the layouts whose activation memory the Megatron-SP linear
and GQA changes touch. Prints a Markdown table (no timing).

    python -m tools.bench.bench_saved_per_layer

Uses the measurement of tools/bench/saved_bytes.py (saved_tensors_hooks, each storage
counted once, parameters excluded), the ground truth tests/training/test_memory_estimator.py
checks the estimator against. To compare with an older commit, run this script from that
commit's tree (`git archive <commit> | tar -x -C DIR`, copy this file, run it there).
"""

from __future__ import annotations

from tools.bench.common import command_line, machine_info, markdown_table, run_ranks
from tools.bench.saved_bytes import measure_many

MODEL = [
    "--mock-data",
    "--vocab-size",
    "1000",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "256",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "2",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
]
LLAMA_GQA = [
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--position-embedding-type",
    "rope",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
]
CASES = {  # world -> [(name, flags)]
    1: [("GPT, 1 rank", []), ("Llama GQA 4q/2kv, 1 rank", LLAMA_GQA)],
    2: [
        ("GPT, TP2", ["--tensor-model-parallel-size", "2"]),
        (
            "GPT, TP2 --sequence-parallel",
            ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        ),
        ("Llama GQA 4q/2kv, Ulysses SP2", LLAMA_GQA + ["--ds-sequence-parallel-size", "2"]),
    ],
}


def main() -> None:
    rows = []
    for world, cases in CASES.items():
        results = run_ranks(measure_many, world, [MODEL + flags for _, flags in cases])[0]
        for (name, _), got in zip(cases, results):
            saved = got["saved"]
            rows.append([name, saved["layer0"], saved["layer1"], saved.get("head", 0)])
    print(
        f"Command: `{command_line()}`  \nMachine: {machine_info()}  \n"
        f"Model: {' '.join(MODEL[1:])}\n"
    )
    print(markdown_table(["layout", "layer0 B", "layer1 B", "head B"], rows))


if __name__ == "__main__":
    main()
