"""Checkpoints of other frameworks (Hugging Face, Megatron-LM, megatron-core) read into and
written from megatron_ul checkpoints."""
