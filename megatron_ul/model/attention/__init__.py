"""Attention: which kernel runs a call (dispatch), the kernels, and the communication around
them (Ulysses' all-to-all, the ring's p2p).

  dispatch       the one decision of the kernel, what the log and --dry-run report
  local          dense causal attention on whole heads (flash-attn or torch SDPA)
  documents      documents and sliding windows (flash-attn varlen, per-document blocks, tiles)
  document_tiles documents and windows on fused kernels in query tiles
  lse_kernels    fused kernels that return the log-sum-exp (the blocks' unit kernels)
  ring           ring attention over the context-parallel group
  ulysses        the Ulysses all-to-all around the local attention
  block_tiles    the attention block's token-wise work (norm, QKV, RoPE, projection) in tiles

Submodules are imported where used: this package imports none of them, so that importing
one never pulls the others in.
"""
