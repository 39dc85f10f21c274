"""--dry-run: print the resolved layout and a per-GPU memory estimate, without starting
torch.distributed or building the model."""
from __future__ import annotations

from ..config import Config
from .memory_estimator import (GiB, estimate_config, init_peak_bytes, layout_from_config,
                               recompute_of)


def describe(cfg: Config) -> str:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tp, sp, pp, dp = (p.tensor_model_parallel_size, p.ds_sequence_parallel_size,
                      p.pipeline_model_parallel_size, p.data_parallel_size)
    est = estimate_config(cfg)
    zero = getattr(p, "zero_stage", 0)
    lines = [
        f"world {p.world_size} = TP {tp} × SP {sp} × PP {pp} × DP {dp}"
        f"{' (Megatron-SP on)' if p.sequence_parallel else ''}",
        f"model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads "
        f"({m.query_groups} kv groups), ffn {m.ffn_size}, seq {m.seq_length} "
        f"({m.seq_length // sp} tokens per Ulysses rank), padded vocab "
        f"{m.padded_vocab_size(tp)}",
        f"batch: micro {t.micro_batch_size} × {cfg.num_micro_batches} micro-batches × DP {dp} "
        f"= global {t.global_batch_size} ({t.global_batch_size * m.seq_length} tokens/iter)",
        f"parameters per rank: {est.params_per_rank / 1e6:.1f} M; precision "
        f"{'bf16 (autocast)' if t.bf16 else 'fp32'}; ZeRO stage {zero}; recompute "
        f"{recompute_of(cfg)}",
        "memory estimate per GPU: " + est.describe(),
        f"initialisation peak per GPU: "
        f"{init_peak_bytes(m, layout_from_config(cfg), zero) / GiB:.2f} GiB (each rank computes "
        f"only the parameters it holds, on its device)",
    ]
    return "\n".join(lines)


def dry_run(cfg: Config) -> int:
    print(describe(cfg), flush=True)
    print(f"dry run: configuration is valid; estimated "
          f"{estimate_config(cfg).total_bytes / GiB:.1f} GiB per GPU (+ CUDA context); "
          f"not training", flush=True)
    return 0
