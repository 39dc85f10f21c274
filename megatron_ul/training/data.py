"""Wire the data pipeline into training: tokenizer, datasets, sampler, and per-rank
micro-batches (each DP rank its samples, each SP×CP rank its slice of every sequence)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..config import DataConfig, ResolvedConfig
from ..data.batches import PretrainingSampler, build_micro_batch, micro_batch_iterator
from ..data.gpt_dataset import build_train_valid_test_datasets
from ..data.mock import MockGPTDataset
from ..data.tokenizers import build_tokenizer
from ..mpu.parallel_state import ParallelDims


def build_tokenizer_for(d: DataConfig, given_vocab_size: int):
    """The tokenizer named by --tokenizer-type (None for --mock-data without one).

    given_vocab_size: --vocab-size as given (NullTokenizer's N; the resolved config's
    data.given_vocab_size, not the model's N + 1).
    """
    if d.tokenizer_type is None:
        return None
    return build_tokenizer(
        d.tokenizer_type,
        vocab_file=d.vocab_file,
        merge_file=d.merge_file,
        tokenizer_model=d.tokenizer_model,
        vocab_size=given_vocab_size or None,
    )


def eod_token_for(cfg: ResolvedConfig):
    """The end-of-document id: the tokenizer's; for --mock-data the last id of the model's
    vocabulary, vocab_size - 1 (mock samples carry documents; the model's vocabulary is
    --vocab-size there, which a tokenizer's EOD may lie outside of, e.g. NullTokenizer's N)."""
    if cfg.data.mock_data:
        return cfg.model.vocab_size - 1
    tokenizer = build_tokenizer_for(cfg.data, cfg.data.given_vocab_size)
    return tokenizer.eod if tokenizer is not None else None


def build_datasets(cfg: ResolvedConfig):
    """(train, valid, test) datasets sized for the whole run."""
    t, m, d = cfg.train, cfg.model, cfg.data
    train_samples = t.train_iters * t.global_batch_size
    # --eval-interval 0 never evaluates; --eval-iters 0 skips evaluation (Megatron-LM)
    eval_runs = (t.train_iters // t.eval_interval + 1) if t.eval_interval else 0
    valid_samples = eval_runs * t.eval_iters * t.global_batch_size
    if d.mock_data:
        eod = eod_token_for(cfg)
        train = MockGPTDataset(train_samples, m.seq_length, m.vocab_size, t.seed, eod)
        valid = (
            MockGPTDataset(valid_samples, m.seq_length, m.vocab_size, t.seed + 1, eod)
            if valid_samples
            else None
        )
        return train, valid, None
    # Without --data-cache-path the indices are cached beside the data (see docs/data.md).
    # The token ids were checked against the vocabulary by configure(), before the model.
    return build_train_valid_test_datasets(
        d.data_path,
        d.split,
        m.seq_length,
        (train_samples, valid_samples, 0),
        t.seed,
        d.data_cache_path or "default",
    )


def global_batches(
    cfg: ResolvedConfig, dims: ParallelDims, dataset, device, eod_token, consumed_samples: int = 0
) -> Iterator[list[dict]]:
    """Yield, per iteration, this rank's list of micro-batch dicts on `device` (its data
    shard and sequence chunk from its place in `dims`)."""
    t = cfg.train
    sampler = PretrainingSampler(
        len(dataset), consumed_samples, t.micro_batch_size, dims.dp_rank, dims.dp
    )
    texts = micro_batch_iterator(dataset, sampler)
    sp_rank, sp = dims.sp_rank, dims.sp
    cp_rank, cp = dims.cp_rank, dims.cp
    d = cfg.data
    while True:
        batch: list[dict] = []
        for _ in range(cfg.num_micro_batches):
            try:
                text = next(texts)
            except StopIteration:
                return
            mb = build_micro_batch(
                text,
                sp_rank,
                sp,
                eod_token=eod_token,
                reset_position_ids=d.reset_position_ids,
                reset_attention_mask=d.reset_attention_mask,
                eod_mask_loss=d.eod_mask_loss,
                cp_rank=cp_rank,
                cp_size=cp,
            )
            batch.append(mb)
        yield to_device(batch, device)


# a tensor's bytes start at a multiple of this in the packed buffer, so every dtype's view of
# them is aligned
_ALIGN = 8


def to_device(micro_batches: list[dict], device) -> list[dict]:
    """The tensors of one step's micro-batches on `device`, in one host->device copy.

    Their bytes are packed into one host buffer (pinned when the device is CUDA), copied with
    non_blocking=True, and unpacked on the device as views of the copy: one transfer per step
    that the host does not wait for. A blocking copy ends in a stream synchronisation (torch
    2.11 aten/src/ATen/native/cuda/Copy.cu, copy_kernel_cuda: memcpy_and_sync), and
    cudaMemcpyAsync from pageable memory returns only once the driver has staged it (CUDA's
    API synchronisation rules). The pinned buffer is fresh per step and never written after
    the copy is queued: the copy records an event on it (CachingHostAllocator_recordEvent), so
    the allocator reuses the block only once the copy is done. Non-tensor values (the host
    document offsets) are kept as they are."""
    tensors = [v for mb in micro_batches for v in mb.values() if isinstance(v, torch.Tensor)]
    spans, total = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        spans.append((total, total + nbytes))
        total += -(-nbytes // _ALIGN) * _ALIGN
    host = torch.empty(total, dtype=torch.uint8, pin_memory=torch.device(device).type == "cuda")
    for t, (lo, hi) in zip(tensors, spans):
        host[lo:hi].copy_(t.contiguous().view(-1).view(torch.uint8))
    copied = host.to(device, non_blocking=True)
    on_device = iter(
        copied[lo:hi].view(t.dtype).view(t.shape) for t, (lo, hi) in zip(tensors, spans)
    )
    return [
        {k: next(on_device) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}
        for mb in micro_batches
    ]
