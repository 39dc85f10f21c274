"""Wire the data pipeline into training: tokenizer, datasets, sampler, and per-rank
micro-batches (each DP rank its samples, each SP×CP rank its slice of every sequence)."""
from __future__ import annotations

from typing import Iterator

import torch

from ..config import Config
from ..data.batches import PretrainingSampler, build_micro_batch, micro_batch_iterator
from ..data.gpt_dataset import build_train_valid_test_datasets
from ..data.mock import MockGPTDataset
from ..data.tokenizers import build_tokenizer
from ..mpu import parallel_state as ps


def build_tokenizer_for(cfg: Config):
    """The tokenizer named by --tokenizer-type (None for --mock-data without one)."""
    d = cfg.data
    if d.tokenizer_type is None:
        return None
    return build_tokenizer(d.tokenizer_type, vocab_file=d.vocab_file, merge_file=d.merge_file,
                           tokenizer_model=d.tokenizer_model,
                           vocab_size=cfg.model.vocab_size or None)


def eod_token_for(cfg: Config):
    """The end-of-document id: the tokenizer's; for --mock-data without a tokenizer
    vocab_size - 1, Megatron's NullTokenizer convention (mock samples carry documents)."""
    tokenizer = build_tokenizer_for(cfg)
    if tokenizer is not None:
        return tokenizer.eod
    return cfg.model.vocab_size - 1 if cfg.data.mock_data else None


def build_datasets(cfg: Config):
    """(train, valid, test) datasets sized for the whole run."""
    t, m, d = cfg.train, cfg.model, cfg.data
    train_samples = t.train_iters * t.global_batch_size
    eval_runs = (t.train_iters // t.eval_interval + 1) if t.eval_interval else 0
    valid_samples = eval_runs * t.eval_iters * t.global_batch_size
    if d.mock_data:
        eod = eod_token_for(cfg)
        train = MockGPTDataset(train_samples, m.seq_length, m.vocab_size, t.seed, eod)
        valid = MockGPTDataset(max(valid_samples, 1), m.seq_length, m.vocab_size, t.seed + 1,
                               eod)
        return train, valid, None
    return build_train_valid_test_datasets(d.data_path, d.split, m.seq_length,
                                           (train_samples, valid_samples, 0), t.seed,
                                           d.data_cache_path)


def global_batches(cfg: Config, dataset, device, eod_token, consumed_samples: int = 0
                   ) -> Iterator[list[dict]]:
    """Yield, per iteration, this rank's list of micro-batch dicts on `device`."""
    t = cfg.train
    sampler = PretrainingSampler(len(dataset), consumed_samples, t.micro_batch_size,
                                 ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    texts = micro_batch_iterator(dataset, sampler)
    sp_rank, sp = ps.get_sequence_parallel_rank(), ps.get_sequence_parallel_world_size()
    cp_rank, cp = ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()
    d = cfg.data
    while True:
        batch = []
        for _ in range(cfg.num_micro_batches):
            try:
                text = next(texts)
            except StopIteration:
                return
            mb = build_micro_batch(text, sp_rank, sp, eod_token=eod_token,
                                   reset_position_ids=d.reset_position_ids,
                                   reset_attention_mask=d.reset_attention_mask,
                                   eod_mask_loss=d.eod_mask_loss, cp_rank=cp_rank, cp_size=cp)
            batch.append({k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                          for k, v in mb.items()})
        yield batch
