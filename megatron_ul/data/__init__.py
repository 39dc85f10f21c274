"""Data pipeline: tokenizers, MMIDIDX files, GPT datasets with blending, micro-batches."""
