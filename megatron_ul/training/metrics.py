"""Console, TensorBoard and Weights & Biases metrics: loss, learning rate, grad norm, tokens/s,
TFLOP/s per rank, MFU, peak memory, the per-iteration time split and an ETA.

TensorBoard and W&B tags follow Megatron-LM ('lm loss', 'learning-rate', 'grad-norm',
'lm loss validation', and TensorBoard's '<tag> vs samples').
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Callable

import torch

from ..config import ModelConfig, ResolvedConfig
from ..model.attention.block_sparse_layouts import computed_blocks
from ..sparsity_config import SparsityPattern
from ..timers import NO_TIMERS, Timers

log = logging.getLogger("megatron_ul")


def flops_per_token(m: ModelConfig, padded_vocab: int, seed: int = 0) -> float:
    """Training FLOPs per token: 3 × forward (forward + backward = 2 × forward), where forward
    counts 2 FLOPs per multiply-add:
      QKV projection   2·h·(heads + 2·kv_groups)·d
      attention scores and values   2·2·N·heads·d   (full N×N as Megatron counts; causal
                                                     kernels do about half)
      output projection   2·heads·d·h
      MLP   2·h·ffn·(2 with SwiGLU: gate and up, else 1) + 2·ffn·h
      per layer; plus the logits 2·h·V once.
    Block-sparse attention counts only the blocks its kernels run (`sparse_attention_flops`).
    An MoE layer counts its active parameters only (`moe_mlp_flops`).
    """
    h, d, n = m.hidden_size, m.head_dim, m.seq_length
    qkv = 2 * h * (m.num_attention_heads + 2 * m.query_groups) * d
    attention: float = 2 * 2 * n * m.num_attention_heads * d
    if m.sparse_attention is not None:
        attention = sparse_attention_flops(m, seed)
    proj = 2 * m.num_attention_heads * d * h
    mlp = _mlp_flops(m, m.ffn_size)
    moe_layers = sum(m.is_moe_layer(i + 1) for i in range(m.num_layers))
    mlps = (m.num_layers - moe_layers) * mlp + (moe_layers and moe_layers * moe_mlp_flops(m))
    forward = m.num_layers * (qkv + attention + proj) + mlps + 2 * h * padded_vocab
    return 3.0 * forward


def _mlp_flops(m: ModelConfig, ffn: int) -> float:
    return 2 * m.hidden_size * ffn * (2 if m.swiglu else 1) + 2 * ffn * m.hidden_size


def moe_mlp_flops(m: ModelConfig) -> float:
    """Forward FLOPs per token of one MoE layer, active parameters only: the router 2·h·E, the
    top-k experts' MLPs and the shared expert's (capacity drops are not subtracted: MFU counts
    the model's work, not the tokens a full expert turned away)."""
    assert m.num_experts is not None
    shared = m.moe_shared_expert_intermediate_size
    return (
        2 * m.hidden_size * m.num_experts
        + m.moe_router_topk * _mlp_flops(m, m.moe_ffn_size)
        + (_mlp_flops(m, shared) if shared else 0.0)
    )


# Heads whose layouts the FLOPs count reads when each head has its own (scaled to all).
COUNTED_HEADS = 8


def sparse_attention_flops(m: ModelConfig, seed: int = 0) -> float:
    """Forward FLOPs per token of one layer's block-sparse scores and values, all heads:
    2·2·d·B² per computed block (the layout's blocks at or below the diagonal, each run whole),
    over N tokens. The blocks are counted on layer 0's layout: layers differ only by where
    their random blocks fall (BigBird, Variable), at most --sparse-num-random-blocks per row.
    Per-head layouts are counted on the first COUNTED_HEADS heads and scaled (Fixed's global
    patterns repeat every --sparse-num-different-global-patterns heads; random draws differ
    by a few blocks per row), so that a long sequence's start-up does not count every head."""
    pattern = SparsityPattern.of(m)
    assert pattern is not None
    n, heads = m.seq_length, m.num_attention_heads
    sample = range(min(heads, COUNTED_HEADS))
    blocks = computed_blocks(pattern, heads, n, seed=seed, heads=sample) * heads / len(sample)
    return 2 * 2 * m.head_dim * blocks * pattern.block**2 / n


# Dense bf16 tensor-core peaks, TFLOP/s per GPU (vendor datasheets; sparsity excluded).
KNOWN_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
PHASES = ("forward", "backward", "all-to-all", "grad-reduce", "optimizer", "grad-clip")


def peak_tflops(cfg: ResolvedConfig) -> float | None:
    """--peak-tflops, else the table entry whose name appears in the CUDA device name."""
    if cfg.logging.peak_tflops:
        return cfg.logging.peak_tflops
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().upper()
    # "H100 PCIe" peaks lower (756) than SXM; only SXM-class names match the table.
    if "PCIE" in name:
        return None
    return next((peak for key, peak in KNOWN_PEAK_TFLOPS.items() if key in name), None)


def peak_memory_gib() -> tuple[float, str]:
    """(peak GiB, what it measures): CUDA allocator peak on a GPU, else the process's max RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30, "allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30, "max RSS"


def format_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class MetricsLogger:
    """Accumulates per-iteration figures and reports every --log-interval iterations, with the
    time split read from the run's timers (--timing-log-level; built in training/pretrain)."""

    def __init__(
        self,
        cfg: ResolvedConfig,
        padded_vocab: int,
        is_reporting_rank: bool,
        timers: Timers = NO_TIMERS,
    ):
        self.cfg, self.reporting = cfg, is_reporting_rank
        self.tokens_per_iter = cfg.train.global_batch_size * cfg.model.seq_length
        per_token = flops_per_token(cfg.model, padded_vocab, cfg.train.seed)
        self.flops_per_iter = per_token * self.tokens_per_iter
        self.peak = peak_tflops(cfg)
        self.samples_per_iter = cfg.train.global_batch_size
        self.writer = None  # TensorBoard
        self.writers: list = []  # TensorBoard and W&B: the same tags at the same steps
        if is_reporting_rank and cfg.logging.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=cfg.logging.tensorboard_dir)
            self.writers.append(self.writer)
        if is_reporting_rank and cfg.logging.wandb_project:
            from .wandb_writer import WandbWriter

            self.writers.append(WandbWriter(cfg))
        self.timers = timers if timers.log_level >= 1 else None
        # More scalars per report (the MoE aux losses); called on every rank (collective).
        self.extra_scalars: Callable[[], dict[str, float]] = dict
        self._start = self._window_start = time.perf_counter()
        self._window_iters = self._iters_done = 0

    def iteration(self, it: int, loss: float, lr: float, grad_norm: float) -> None:
        self._window_iters += 1
        self._iters_done += 1
        if it % self.cfg.logging.log_interval != 0 and it != self.cfg.train.train_iters:
            return
        now = time.perf_counter()
        per_iter = (now - self._window_start) / self._window_iters
        scalars = self._scalars(loss, lr, grad_norm, per_iter)
        scalars.update(self.extra_scalars())
        split = self._time_split(self._window_iters)
        eta = (now - self._start) / self._iters_done * (self.cfg.train.train_iters - it)
        if self.reporting:
            self._log(it, scalars, split, eta)
        self._window_start, self._window_iters = time.perf_counter(), 0

    def _scalars(self, loss, lr, grad_norm, per_iter) -> dict[str, float]:
        tflops = self.flops_per_iter / per_iter / self.cfg.parallel.world_size / 1e12
        memory, _ = peak_memory_gib()
        scalars = {
            "lm loss": loss,
            "learning-rate": lr,
            "grad-norm": grad_norm,
            "tokens-per-sec": self.tokens_per_iter / per_iter,
            "tflops-per-rank": tflops,
            "iteration-time": per_iter,
            "peak-memory-gib": memory,
        }
        if self.peak:
            scalars["mfu"] = tflops / self.peak
        return scalars

    def _time_split(self, iters: int) -> dict[str, float]:
        """Milliseconds per iteration of each timed phase (empty with --timing-log-level 0)."""
        if self.timers is None:
            return {}
        seconds, calls = self.timers.pop()
        split = {name: seconds[name] / iters * 1e3 for name in PHASES if name in seconds}
        if self.timers.log_level >= 2 and "all-to-all" in calls:
            split["all-to-all calls"] = calls["all-to-all"] / iters
        return split

    def _log(self, it: int, scalars: dict, split: dict, eta: float) -> None:
        _, memory_kind = peak_memory_gib()
        mfu = f" | MFU {scalars['mfu']:.1%}" if "mfu" in scalars else ""
        log.info(
            "iteration %6d/%6d | lm loss %.6E | lr %.3E | grad norm %.3f | "
            "%.1f ms/iter | tokens/s %.0f | TFLOP/s per rank %.3f%s | peak mem %.2f GiB "
            "(%s) | ETA %s",
            it,
            self.cfg.train.train_iters,
            scalars["lm loss"],
            scalars["learning-rate"],
            scalars["grad-norm"],
            scalars["iteration-time"] * 1e3,
            scalars["tokens-per-sec"],
            scalars["tflops-per-rank"],
            mfu,
            scalars["peak-memory-gib"],
            memory_kind,
            format_eta(eta),
        )
        moe = {k[4:]: v for k, v in scalars.items() if k.startswith("moe/") and "_layer_" not in k}
        if moe:
            log.info("    moe: %s", " | ".join(f"{k} {v:.4E}" for k, v in moe.items()))
        if split:
            log.info(
                "    time split (ms/iter): %s",
                " | ".join(f"{name} {value:.1f}" for name, value in split.items()),
            )
        for writer in self.writers:
            for tag, value in scalars.items():
                writer.add_scalar(tag, value, it)
            for name, value in split.items():
                writer.add_scalar(f"time/{name}-ms", value, it)
            writer.flush()
        self._by_samples("lm loss", scalars["lm loss"], it)

    def validation(self, it: int, loss: float) -> None:
        """The validation loss under Megatron-LM's tag ('lm loss validation')."""
        if not self.reporting:
            return
        for writer in self.writers:
            writer.add_scalar("lm loss validation", loss, it)
            writer.flush()
        self._by_samples("lm loss validation", loss, it)

    def _by_samples(self, tag: str, value: float, it: int) -> None:
        """Megatron-LM's '<tag> vs samples' (TensorBoard only: W&B's step is the iteration)."""
        if self.writer is not None:
            self.writer.add_scalar(f"{tag} vs samples", value, it * self.samples_per_iter)
            self.writer.flush()

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
