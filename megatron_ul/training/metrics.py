"""Console and TensorBoard metrics: loss, learning rate, grad norm, tokens/s, TFLOP/s.

TensorBoard tags follow Megatron-LM ('lm loss', 'learning-rate', 'grad-norm').
"""
from __future__ import annotations

import logging
import time

from ..config import Config, ModelConfig

log = logging.getLogger("megatron_ul")


def flops_per_token(m: ModelConfig, padded_vocab: int) -> float:
    """Training FLOPs per token: 3 × forward (forward + backward = 2 × forward), where forward
    counts 2 FLOPs per multiply-add:
      QKV projection   2·h·(heads + 2·kv_groups)·d
      attention scores and values   2·2·N·heads·d   (full N×N as Megatron counts; causal
                                                     kernels do about half)
      output projection   2·heads·d·h
      MLP   2·h·ffn·(2 with SwiGLU: gate and up, else 1) + 2·ffn·h
      per layer; plus the logits 2·h·V once.
    """
    h, d, n = m.hidden_size, m.head_dim, m.seq_length
    qkv = 2 * h * (m.num_attention_heads + 2 * m.query_groups) * d
    attention = 2 * 2 * n * m.num_attention_heads * d
    proj = 2 * m.num_attention_heads * d * h
    mlp = 2 * h * m.ffn_size * (2 if m.swiglu else 1) + 2 * m.ffn_size * h
    forward = m.num_layers * (qkv + attention + proj + mlp) + 2 * h * padded_vocab
    return 3.0 * forward


class MetricsLogger:
    """Accumulates per-iteration figures and reports every --log-interval iterations."""

    def __init__(self, cfg: Config, padded_vocab: int, is_reporting_rank: bool):
        self.cfg, self.reporting = cfg, is_reporting_rank
        self.tokens_per_iter = cfg.train.global_batch_size * cfg.model.seq_length
        self.flops_per_iter = flops_per_token(cfg.model, padded_vocab) * self.tokens_per_iter
        self.writer = None
        if is_reporting_rank and cfg.logging.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=cfg.logging.tensorboard_dir)
        self._window_start, self._window_iters = time.perf_counter(), 0

    def iteration(self, it: int, loss: float, lr: float, grad_norm: float) -> None:
        self._window_iters += 1
        if it % self.cfg.logging.log_interval != 0 and it != self.cfg.train.train_iters:
            return
        elapsed = time.perf_counter() - self._window_start
        per_iter = elapsed / self._window_iters
        tokens_per_s = self.tokens_per_iter / per_iter
        tflops_per_rank = self.flops_per_iter / per_iter / self.cfg.parallel.world_size / 1e12
        if self.reporting:
            log.info("iteration %6d/%6d | lm loss %.6E | lr %.3E | grad norm %.3f | "
                     "%.1f ms/iter | tokens/s %.0f | TFLOP/s per rank %.3f",
                     it, self.cfg.train.train_iters, loss, lr, grad_norm, per_iter * 1e3,
                     tokens_per_s, tflops_per_rank)
            if self.writer is not None:
                for tag, value in [("lm loss", loss), ("learning-rate", lr),
                                   ("grad-norm", grad_norm), ("tokens-per-sec", tokens_per_s),
                                   ("tflops-per-rank", tflops_per_rank),
                                   ("iteration-time", per_iter)]:
                    self.writer.add_scalar(tag, value, it)
                self.writer.flush()
        self._window_start, self._window_iters = time.perf_counter(), 0

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
