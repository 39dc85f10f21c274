"""The GPT: embeddings, transformer layers, Ulysses attention, norms, RoPE."""
