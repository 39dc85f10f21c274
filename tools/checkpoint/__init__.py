"""Checkpoint tools: layout conversion, Hugging Face import/export, crash-safety trial."""
