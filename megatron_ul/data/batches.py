"""From samples to micro-batches: DP sampling, and per-SP-rank inputs with Megatron's masks."""

import numpy as np
import torch

from .sequence_layout import rank_positions


class PretrainingSampler:
    """Megatron's MegatronPretrainingSampler: sequential, resumable, split over DP ranks.

    Each step consumes ``micro_batch_size * data_parallel_size`` consecutive
    sample indices starting at ``consumed_samples`` and yields this rank's
    ``micro_batch_size`` of them. A trailing partial step is dropped, so every
    rank yields the same number of micro-batches.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
    ):
        if total_samples <= 0:
            raise ValueError(f"total_samples must be > 0, got {total_samples}")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(
                f"consumed_samples {consumed_samples} outside [0, total_samples={total_samples}]"
            )
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be > 0, got {micro_batch_size}")
        if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(
                f"data_parallel_rank {data_parallel_rank} outside [0, {data_parallel_size})"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.samples_per_step = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // self.samples_per_step

    def __iter__(self):
        rank_start = self.data_parallel_rank * self.micro_batch_size
        step_start = self.consumed_samples
        while step_start + self.samples_per_step <= self.total_samples:
            first = step_start + rank_start
            yield list(range(first, first + self.micro_batch_size))
            step_start += self.samples_per_step


def _collate_texts(samples) -> torch.Tensor:
    return torch.from_numpy(np.stack([sample["text"] for sample in samples]).astype(np.int64))


def micro_batch_iterator(dataset, sampler, num_workers: int = 0):
    """Iterates LongTensor micro-batches [micro_batch_size, seq_length + 1] of ``texts``.

    ``num_workers > 0`` reads samples in background processes (torch DataLoader).
    """
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=_collate_texts,
        # samples are cut into micro-batches on the host first; training/data.py pins the
        # packed result, the one buffer that is copied to the device
        pin_memory=False,
        # a private generator: starting the iterator must not
        # draw from the global RNG (dropout), or a resumed run
        # would diverge from an uninterrupted one
        generator=torch.Generator(),
        persistent_workers=num_workers > 0,
    )
    return iter(loader)


def _position_ids(tokens, eod_token, reset_position_ids):
    batch, length = tokens.shape
    positions = torch.arange(length, device=tokens.device).unsqueeze(0).expand(batch, length)
    if not reset_position_ids:
        return positions.clone()
    # Each position counts from the token after the latest EOD before it.
    after_eod = torch.where(tokens == eod_token, positions + 1, torch.zeros_like(positions))
    document_start = torch.cummax(after_eod, dim=1).values
    document_start = torch.cat(
        [torch.zeros_like(document_start[:, :1]), document_start[:, :-1]], dim=1
    )
    return positions - document_start


def _document_offsets(tokens, eod_token):
    """cu_seqlens int32 [documents + 1]: where each document starts in the flattened [b·N]
    batch, then b·N. Megatron's rule: an EOD ends its own document, the next token starts one;
    every sample starts one. O(N): no [N, N] mask (model/attention/documents.py attends by it)."""
    batch, length = tokens.shape
    starts = torch.zeros(tokens.shape, dtype=torch.bool, device=tokens.device)
    starts[:, 0] = True
    starts[:, 1:] = tokens[:, :-1] == eod_token
    flat = torch.nonzero(starts.reshape(-1)).squeeze(1)
    end = torch.tensor([batch * length], device=tokens.device)
    return torch.cat([flat, end]).to(torch.int32)


def build_micro_batch(
    texts: torch.Tensor,
    sp_rank: int = 0,
    sp_size: int = 1,
    eod_token=None,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    cp_rank: int = 0,
    cp_size: int = 1,
) -> dict:
    """Turns ``texts`` [b, N + 1] into this SP rank's slice of a training micro-batch.

    Labels are shifted before slicing, so rank r gets tokens and labels for
    positions [r * N / sp, (r + 1) * N / sp) with GLOBAL position ids. With a ring
    (``cp_size`` > 1) the rank holds the load-balanced tokens of data/sequence_layout.py
    instead (its Ulysses slice of chunks cp_rank and 2·cp_size-1-cp_rank).
    Loss mask, position resets and the document boundaries follow
    Megatron's get_ltor_masks_and_position_ids, computed on the full sequence.
    With ``reset_attention_mask`` the batch has ``cu_seqlens``: the document offsets of the
    FULL sequence over the flattened [b·N] batch (identical on every SP rank, since Ulysses
    attends over the full sequence), instead of Megatron's dense [b, 1, N, N] mask, and
    ``document_offsets``, the same offsets as a list of ints: read here, where ``texts`` is
    still host memory, so that the model never reads them back from the device.
    """
    if texts.dim() != 2 or texts.shape[1] < 2:
        raise ValueError(
            f"texts must be [batch, seq_length + 1] with seq_length >= 1, got {tuple(texts.shape)}"
        )
    seq_length = texts.shape[1] - 1
    if sp_size < 1 or not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank {sp_rank} outside [0, sp_size={sp_size})")
    if seq_length % sp_size:
        raise ValueError(
            f"seq_length {seq_length} is not divisible by the Ulysses degree SP = {sp_size}"
        )
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} outside [0, cp_size={cp_size})")
    if eod_token is None and (reset_position_ids or reset_attention_mask or eod_mask_loss):
        raise ValueError(
            "reset_position_ids, reset_attention_mask and eod_mask_loss need eod_token"
        )
    texts = texts.long()
    tokens, labels = texts[:, :-1], texts[:, 1:]
    loss_mask = torch.ones(tokens.shape, dtype=torch.float, device=texts.device)
    if eod_mask_loss:
        loss_mask[tokens == eod_token] = 0.0
    position_ids = _position_ids(tokens, eod_token, reset_position_ids)
    window: slice | torch.Tensor
    if cp_size == 1:
        shard = seq_length // sp_size
        window = slice(sp_rank * shard, (sp_rank + 1) * shard)
    else:
        window = rank_positions(seq_length, sp_rank, sp_size, cp_rank, cp_size).to(texts.device)
    batch = {
        "tokens": tokens[:, window].contiguous(),
        "labels": labels[:, window].contiguous(),
        "loss_mask": loss_mask[:, window].contiguous(),
        "position_ids": position_ids[:, window].contiguous(),
    }
    if reset_attention_mask:
        batch["cu_seqlens"] = _document_offsets(tokens, eod_token)
        batch["document_offsets"] = batch["cu_seqlens"].tolist()
    return batch
