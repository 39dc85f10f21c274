"""Checkpoints: Megatron's directory layout, crash-safe saves, exact resume, layout conversion
and Hugging Face import/export."""
