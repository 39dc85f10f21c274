"""Command line -> Config. Megatron-LM's flag names (and Megatron-DeepSpeed's
--ds-sequence-parallel-size for the Ulysses degree). The only place flags are parsed."""
from __future__ import annotations

import argparse
import os
from dataclasses import fields

from .config import (CheckpointConfig, Config, DataConfig, LoggingConfig, ModelConfig,
                     ParallelConfig, TrainConfig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Pretrain a GPT with tensor, sequence (Ulysses), pipeline and data "
                    "parallelism.", allow_abbrev=False)
    _add_model_args(p.add_argument_group("model"))
    _add_parallel_args(p.add_argument_group("parallelism"))
    _add_training_args(p.add_argument_group("training"))
    _add_data_args(p.add_argument_group("data"))
    _add_checkpoint_args(p.add_argument_group("checkpointing"))
    _add_logging_args(p.add_argument_group("logging"))
    return p


def _add_model_args(g) -> None:
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--group-query-attention", action="store_true",
                   help="use grouped-query attention with --num-query-groups kv heads")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--vocab-size", type=int, default=None,
                   help="vocabulary size for --mock-data / NullTokenizer")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"],
                   default="learned_absolute")
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--use-flash-attn", action="store_true",
                   help="FlashAttention-2 when importable on a GPU, else torch SDPA")
    g.add_argument("--gelu-approximate", choices=["none", "tanh"], default="none",
                   help="tanh = GPT-2's gelu_new (for Hugging Face GPT-2 weights)")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="full: recompute whole layers in backward; selective: core attention")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="uniform: checkpoint chunks of --recompute-num-layers layers; block: "
                        "checkpoint the first --recompute-num-layers layers of each stage")
    g.add_argument("--recompute-num-layers", type=int, default=1)
    g.add_argument("--fused-layers", action="store_true",
                   help="torch.compile each transformer layer (fuses the elementwise work "
                        "around the matmuls); off by default: on CPU it costs compile time "
                        "and gains no speed")
    g.add_argument("--fused-layers-backend", choices=["inductor", "aot_eager"],
                   default="inductor",
                   help="torch.compile backend for --fused-layers (aot_eager: traced, not fused)")


def _add_parallel_args(g) -> None:
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--ds-sequence-parallel-size", type=int, default=1,
                   help="DeepSpeed-Ulysses sequence-parallel degree")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron-LM sequence parallelism over the TP group (norms, dropout)")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None)
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--zero-stage", type=int, default=0)
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="reduce gradients over DP×SP in buckets while backward runs (plain "
                        "data parallelism and ZeRO-1; ZeRO-3/FSDP2 always overlaps)")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="ZeRO-1: all-gather updated parameters while the next forward runs")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per gradient-reduction bucket (default max(40M, 1M·dp_sp))")


def _add_training_args(g) -> None:
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=10)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 compute (autocast) with fp32 master weights and loss scaling")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="fp16: constant loss scale; default: dynamic scaling")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--eval-interval", type=int, default=0)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--dry-run", action="store_true",
                   help="validate, print the resolved layout and a per-GPU memory estimate, exit "
                        "(with --world-size N for the planned launch)")
    g.add_argument("--world-size", type=int, default=None,
                   help="planned number of processes, for --dry-run outside a launcher")


def _add_data_args(g) -> None:
    g.add_argument("--mock-data", action="store_true", help="random tokens; needs --vocab-size")
    g.add_argument("--data-path", nargs="*", default=[],
                   help="dataset prefixes, or 'weight prefix' pairs to blend")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--tokenizer-type", default=None,
                   choices=["GPT2BPETokenizer", "SentencePieceTokenizer", "NullTokenizer"])
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")


def _add_checkpoint_args(g) -> None:
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-save-optim", action="store_true", help="do not save optimizer state")
    g.add_argument("--no-load-optim", action="store_true",
                   help="do not load optimizer and LR-scheduler state")
    g.add_argument("--no-load-rng", action="store_true", help="do not load RNG states")
    g.add_argument("--finetune", action="store_true",
                   help="load model weights only and start at iteration 0")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="exit (saving first with --save) when the iteration is a multiple of this")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="exit (saving first with --save) after this many minutes of training")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM, save at the end of the current iteration and exit 0")


def _add_logging_args(g) -> None:
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
                   help="0: iteration time; 1: + forward, backward, all-to-all, gradient "
                        "reduction, optimizer; 2: + per-layer-call all-to-all counts")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="per-GPU peak TFLOP/s for MFU (default: known GPU names, e.g. "
                        "A100 312, H100/H200 989 bf16 dense)")


def _take(cls, ns: argparse.Namespace, **overrides):
    values = {f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)}
    values.update(overrides)
    return cls(**values)


def parse_args(argv=None, world_size: int | None = None) -> Config:
    """Parse flags into a Config (not yet validated; see config.validate)."""
    ns = build_parser().parse_args(argv)
    if ns.num_query_groups is not None and not ns.group_query_attention:
        # Megatron only honours --num-query-groups with --group-query-attention; be explicit.
        build_parser().error("--num-query-groups needs --group-query-attention")
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if ns.world_size is not None:
        if not ns.dry_run:
            build_parser().error("--world-size is only for --dry-run (launchers set the world)")
        world = ns.world_size
    model = _take(ModelConfig, ns, add_bias_linear=not ns.disable_bias_linear,
                  num_query_groups=ns.num_query_groups if ns.group_query_attention else None,
                  vocab_size=ns.vocab_size or 0)
    return Config(model=model,
                  parallel=_take(ParallelConfig, ns, world_size=world),
                  train=_take(TrainConfig, ns),
                  data=_take(DataConfig, ns),
                  checkpoint=_take(CheckpointConfig, ns),
                  logging=_take(LoggingConfig, ns))
