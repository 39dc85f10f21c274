"""GPTModel: embedding → transformer layers → final norm → (tied) output head → loss.

One pipeline stage of it, in general: `pre_process` builds the embedding (first stage),
`post_process` the final norm, head and loss (last stage), and `layer_numbers` says which
global layers (1-based) this stage holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import ResolvedModelConfig
from ..mpu.cross_entropy import vocab_parallel_cross_entropy
from ..mpu.layers import ColumnParallelLinear, VocabParallelEmbedding, sequence_parallel_linear
from ..mpu.mappings import copy_to_tensor_model_parallel_region, scatter_to_sequence_parallel_region
from ..mpu.offload import HostOffloader
from ..mpu.parallel_state import ParallelDims
from ..mpu.param_init import new_parameter
from ..mpu.recompute import layers_to_checkpoint, run_layers
from ..timers import NO_TIMERS, Timers
from .attention.documents import DocumentMask
from .chunks import model_chunks
from .fusion import fuse_layers
from .init import normal_init
from .layer_spec import layer_spec
from .rotary import rotary_cos_sin
from .tiled_loss import tiled_logits_loss
from .transformer import TransformerLayer, dropout, norm_in_weight_dtype


class GPTModel(nn.Module):
    def __init__(
        self,
        cfg: ResolvedModelConfig,
        *,
        seed: int,
        sequence_parallel: bool = False,
        pre_process: bool = True,
        post_process: bool = True,
        layer_numbers: Iterable[int] | None = None,
        device=None,
        dtype=torch.float32,
        timers: Timers = NO_TIMERS,
        dims: ParallelDims,
    ):
        super().__init__()
        self.cfg, self.sequence_parallel = cfg, sequence_parallel
        self.pre_process, self.post_process = pre_process, post_process
        self.dims = dims  # the rank grid: every layer takes its groups here
        self.tp_group, self.tp_size = dims.tp_group, dims.tp
        tp = dims.tp
        self.padded_vocab_size = cfg.padded_vocab_size(tp)
        std = cfg.init_method_std
        self.share_embeddings = not cfg.untie_embeddings_and_output_weights
        self._tied_weight_read_hooks: list[Callable[[], None]] = []
        # What the residual stream and pipeline traffic carry (use_half_precision sets them).
        self.activation_dtype: torch.dtype = dtype
        self.fp32_residual = False

        if pre_process or (post_process and self.share_embeddings):
            # With tied weights the last stage keeps its own copy of the table (Megatron's
            # "embedding group" keeps the copies identical under pipelining).
            self.word_embeddings = VocabParallelEmbedding(
                self.padded_vocab_size,
                cfg.hidden_size,
                normal_init(std, seed, "embedding.word"),
                device=device,
                dtype=dtype,
                tp_group=dims.tp_group,
            )
        if pre_process and cfg.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(
                cfg.max_position_embeddings, cfg.hidden_size, device="meta", dtype=dtype
            )
            self.position_embeddings.weight = new_parameter(
                normal_init(std, seed, "embedding.position"),
                (cfg.max_position_embeddings, cfg.hidden_size),
                device=device,
                dtype=dtype,
            )

        numbers = (
            list(layer_numbers) if layer_numbers is not None else list(range(1, cfg.num_layers + 1))
        )
        spec = layer_spec(cfg)
        self.layers = nn.ModuleList(
            TransformerLayer(
                cfg,
                n,
                seed,
                sequence_parallel,
                device=device,
                dtype=dtype,
                timers=timers,
                dims=dims,
                spec=spec,
            )
            for n in numbers
        )
        if cfg.fused_layers:
            fuse_layers(self.layers, cfg.fused_layers_backend)

        if post_process:
            self.final_norm = spec.build_norm(cfg, sequence_parallel, device, dtype)
            if not self.share_embeddings:
                self.output_layer = ColumnParallelLinear(
                    cfg.hidden_size,
                    self.padded_vocab_size,
                    normal_init(std, seed, "output_layer"),
                    bias=False,
                    vocab_padded=True,
                    sequence_parallel=sequence_parallel,
                    device=device,
                    dtype=dtype,
                    tp_group=dims.tp_group,
                )

    # ---- pieces ---------------------------------------------------------------------------------
    def _offloader(self, device) -> HostOffloader | None:
        """--activation-checkpoint-cpu-offload: one HostOffloader per model chunk."""
        if not self.cfg.activation_checkpoint_cpu_offload:
            return None
        if getattr(self, "offloader", None) is None:
            self.offloader = HostOffloader(device)
        return self.offloader

    def embed(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """tokens, position_ids [b, s] -> [s, b, h] (÷TP on s under Megatron-SP)."""
        x = self.word_embeddings(tokens.t())
        if hasattr(self, "position_embeddings"):
            x = x + self.position_embeddings(position_ids.t())
        if self.fp32_residual:
            x = x.float()
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)
        return dropout(x, self.cfg.hidden_dropout, self.training, self.sequence_parallel)

    @property
    def tied_output_weight(self) -> nn.Parameter | None:
        """The embedding table the output layer reads (tied embeddings), or None."""
        if not (self.share_embeddings and hasattr(self, "word_embeddings")):
            return None
        return self.word_embeddings.weight

    def register_tied_weight_read_hook(self, hook: Callable[[], None]) -> None:
        """Run `hook` before the output layer reads the tied embedding table. Hooks on the
        embedding module do not cover that read: on the last pipeline stage the embedding's
        forward never runs. (The distributed optimizer waits for the table's all-gather here.)"""
        self._tied_weight_read_hooks.append(hook)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[s, b, h] -> [s, b, padded_vocab/TP]."""
        if not self.share_embeddings:
            return self.output_layer(x)
        for hook in self._tied_weight_read_hooks:
            hook()
        if self.sequence_parallel:  # keeps only the [s/TP, b, h] shard for backward
            return sequence_parallel_linear(x, self.word_embeddings.weight, group=self.tp_group)
        return F.linear(
            copy_to_tensor_model_parallel_region(x, self.tp_group), self.word_embeddings.weight
        )

    def forward(
        self,
        tokens: torch.Tensor | None,
        position_ids: torch.Tensor,
        documents: DocumentMask | None = None,
        labels: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens, position_ids, labels: [b, N/SP] with global position ids.

        First stage: embeds `tokens`; later stages take `hidden_states` from the previous one.
        Returns hidden states [s, b, h] on non-last stages; on the last stage the per-token
        loss [b, N/SP] (fp32) when labels are given, else logits [s, b, padded_vocab/TP].
        """
        x = self._stage_input(tokens, position_ids, hidden_states)
        rotary = None
        if self.cfg.position_embedding_type == "rope":
            # fp32 tables; apply_rotary returns q and k in their own (activation) dtype
            rotary = rotary_cos_sin(position_ids.t(), self.cfg.head_dim, self.cfg.rotary_base)
        plan = layers_to_checkpoint(
            len(self.layers),
            self.cfg.recompute_granularity,
            self.cfg.recompute_method,
            self.cfg.recompute_num_layers,
        )
        x = run_layers(
            self.layers,
            x,
            plan if self.training else [],
            rotary,
            documents,
            offloader=self._offloader(x.device),
        )
        if not self.post_process:
            return x
        x = norm_in_weight_dtype(self.final_norm, x)
        if labels is None:
            return self.logits(x)
        return self.loss(x, labels.t()).t().contiguous()  # fresh: FSDP2 warns about views

    def _stage_input(
        self,
        tokens: torch.Tensor | None,
        position_ids: torch.Tensor,
        hidden_states: torch.Tensor | None,
    ) -> torch.Tensor:
        """The first stage embeds tokens; a later stage continues from the previous one's output."""
        if self.pre_process:
            if tokens is None:
                raise ValueError("the first pipeline stage embeds tokens: tokens is None")
            return self.embed(tokens, position_ids)
        if hidden_states is None:
            raise ValueError("a later pipeline stage needs the previous stage's hidden_states")
        return hidden_states

    def loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token loss [s, b] of final hidden states x [s, b, h] (÷TP under Megatron-SP)."""
        tile = self.cfg.tiled_loss_chunk_size
        if tile is None or tile >= x.shape[0]:
            return vocab_parallel_cross_entropy(
                self.logits(x), labels, self.cfg.vocab_size, self.tp_group
            )
        gathered = self.tp_size if self.sequence_parallel else 1
        return tiled_logits_loss(
            self.logits, x, labels, self.cfg.vocab_size, tile, gathered, self.tp_group
        )


@torch.no_grad()
def use_half_precision(
    model: nn.Module,
    dtype: torch.dtype,
    *,
    fp32_residual: bool = False,
    cast_parameters: bool = True,
) -> nn.Module:
    """Megatron's Float16Module for --bf16/--fp16, in place: parameters in `dtype`, and so every
    activation, the residual stream included (fp32_residual: --fp32-residual-connection keeps
    the residual stream, and the pipeline traffic, in fp32). The initial weights are the fp32
    initialisation rounded to `dtype`, on every layout. cast_parameters=False (ZeRO-3): the fp32
    shards are only rounded; FSDP2's MixedPrecisionPolicy casts what it gathers."""
    for chunk in model_chunks(model):
        assert isinstance(chunk, GPTModel)
        chunk.activation_dtype = torch.float32 if fp32_residual else dtype
        chunk.fp32_residual = fp32_residual
    for p in model.parameters():
        if cast_parameters:
            p.data = p.data.to(dtype)
        else:
            local = p.to_local() if isinstance(p, DTensor) else p
            local.copy_(local.to(dtype))
    return model
