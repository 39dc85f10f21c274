"""--fused-layers: torch.compile each transformer layer, as torchtitan does, so that the
elementwise work around the matmuls (bias + GeLU, SwiGLU, bias + dropout + residual add, the
norms, RoPE) runs as fused kernels and keeps fewer intermediates for backward.

Only the layer's `forward` is compiled, not its `__call__`: module hooks (FSDP2's all-gather and
reshard, recompute, the memory probe's) stay eager around it. The Ulysses attention (all-to-all,
attention kernel, all-to-all) is excluded and runs eagerly between two compiled regions: it is
one kernel and two collectives, nothing to fuse. So is the tiled MLP's tile loop
(--tiled-mlp-chunk-size, a checkpoint per tile); each tile's MLP is compiled on its own. TP's
collectives live in autograd Functions that call torch.distributed directly; dynamo breaks the
graph there, so they run eagerly too.
Random numbers (dropout) use PyTorch's generator as in eager mode (inductor's fallback_random),
so the RNG tracker, recompute and every layout draw the same masks as eager layers do.
"""

from __future__ import annotations

import torch

COMPILERS = ("inductor", "aot_eager")  # aot_eager: traced and differentiated, not fused


def fuse_layers(layers, compiler: str = "inductor") -> None:
    """Compile the forward of every layer in `layers` in place (parameters and names stay)."""
    if compiler not in COMPILERS:
        raise ValueError(f"unknown torch.compile backend {compiler!r}; use one of {COMPILERS}")
    import torch._inductor.config as inductor_config

    inductor_config.fallback_random = True
    for layer in layers:
        attention = layer.attention
        attention.core = torch.compiler.disable(attention.core, recursive=True)
        mlp = layer.mlp
        if mlp.tile_tokens is not None:
            # The tiled MLP checkpoints each tile with the RNG tracker's snapshot, which dynamo
            # cannot trace: the tiling loop runs eagerly and each tile's MLP is compiled alone.
            mlp._dense = torch.compile(mlp._dense, backend=compiler, dynamic=False)
            mlp.forward = torch.compiler.disable(mlp.forward, recursive=True)
        layer.forward = torch.compile(layer.forward, backend=compiler, dynamic=False)
