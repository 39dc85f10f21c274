"""Checkpoint tools: the conversion command (convert.py: between layouts and frameworks), its
per-framework forms (hf.py, megatron_lm.py, megatron_core.py), crash-safety trials."""
