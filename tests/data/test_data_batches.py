"""DP sampler (including resume), micro-batch iteration, and SP-sliced micro-batches."""

import itertools

import numpy as np
import pytest
import torch

from megatron_ul.data.batches import PretrainingSampler, build_micro_batch, micro_batch_iterator
from megatron_ul.data.mock import MockGPTDataset
from megatron_ul.model.attention.documents import DocumentMask
from tests.dense_masks import dense_document_mask

EOD = 0


def test_sampler_splits_each_step_over_dp_ranks():
    samplers = [
        PretrainingSampler(
            100, 0, micro_batch_size=3, data_parallel_rank=rank, data_parallel_size=4
        )
        for rank in range(4)
    ]
    per_rank = [list(sampler) for sampler in samplers]
    assert all(
        len(batches) == 100 // 12 == len(sampler) for batches, sampler in zip(per_rank, samplers)
    )
    for step in range(len(per_rank[0])):
        step_indices = [index for rank in range(4) for index in per_rank[rank][step]]
        assert step_indices == list(range(step * 12, step * 12 + 12))


@pytest.mark.parametrize("stop_after", [1, 4, 7])
def test_resumed_sampler_continues_exactly(stop_after):
    for rank in range(2):
        full = list(PretrainingSampler(200, 10, 4, rank, 2))
        first_run = list(itertools.islice(PretrainingSampler(200, 10, 4, rank, 2), stop_after))
        consumed = 10 + stop_after * 4 * 2  # what the trainer records: global samples consumed
        resumed = list(PretrainingSampler(200, consumed, 4, rank, 2))
        assert first_run + resumed == full


def test_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError):
        PretrainingSampler(10, 11, 1, 0, 1)
    with pytest.raises(ValueError):
        PretrainingSampler(10, 0, 1, 2, 2)


def test_micro_batch_iterator_reads_sampler_indices():
    dataset = MockGPTDataset(num_samples=64, seq_length=8, vocab_size=50, seed=1)
    sampler = PretrainingSampler(
        64, 16, micro_batch_size=4, data_parallel_rank=1, data_parallel_size=2
    )
    batches = list(micro_batch_iterator(dataset, sampler))
    assert len(batches) == 6
    for batch, indices in zip(batches, sampler):
        assert batch.dtype == torch.int64 and batch.shape == (4, 9)
        expected = np.stack([dataset[i]["text"] for i in indices])
        np.testing.assert_array_equal(batch.numpy(), expected)


def megatron_ltor_masks_and_position_ids(
    data, eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss
):
    """Megatron-LM's get_ltor_masks_and_position_ids, ported loop for loop as the reference."""
    micro_batch_size, seq_length = data.size()
    att_mask_batch = micro_batch_size if reset_attention_mask else 1
    attention_mask = torch.tril(torch.ones((att_mask_batch, seq_length, seq_length))).view(
        att_mask_batch, 1, seq_length, seq_length
    )
    loss_mask = torch.ones(data.size(), dtype=torch.float)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long).unsqueeze(0).expand_as(data)
    if reset_position_ids:
        position_ids = position_ids.clone()
    if reset_position_ids or reset_attention_mask:
        for b in range(micro_batch_size):
            eod_index = position_ids[b, data[b] == eod_token]
            if reset_position_ids:
                eod_index = eod_index.clone()
            prev_index = 0
            for j in range(eod_index.size()[0]):
                i = eod_index[j]
                if reset_attention_mask:
                    attention_mask[b, 0, (i + 1) :, : (i + 1)] = 0
                if reset_position_ids:
                    position_ids[b, (i + 1) :] -= i + 1 - prev_index
                    prev_index = i + 1
    return attention_mask < 0.5, loss_mask, position_ids


def texts_with_documents(batch=3, seq_length=24, seed=0):
    generator = torch.Generator().manual_seed(seed)
    texts = torch.randint(1, 20, (batch, seq_length + 1), generator=generator)
    texts[0, [3, 4, 11, 24]] = EOD  # adjacent EODs, and one in the last (label-only) slot
    texts[1, [0, 23]] = EOD
    return texts  # row 2 has no EOD at all


@pytest.mark.parametrize(
    "reset_position_ids, reset_attention_mask, eod_mask_loss",
    list(itertools.product([False, True], repeat=3)),
)
def test_full_batch_matches_megatron(reset_position_ids, reset_attention_mask, eod_mask_loss):
    texts = texts_with_documents()
    batch = build_micro_batch(
        texts, 0, 1, EOD, reset_position_ids, reset_attention_mask, eod_mask_loss
    )
    mask, loss_mask, position_ids = megatron_ltor_masks_and_position_ids(
        texts[:, :-1], EOD, reset_position_ids, reset_attention_mask, eod_mask_loss
    )
    assert torch.equal(batch["tokens"], texts[:, :-1])
    assert torch.equal(batch["labels"], texts[:, 1:])
    assert torch.equal(batch["loss_mask"], loss_mask) and batch["loss_mask"].dtype == torch.float
    assert torch.equal(batch["position_ids"], position_ids)
    assert "attention_mask" not in batch  # never a dense [b, 1, N, N] mask
    if reset_attention_mask:  # O(N) document offsets that mean exactly Megatron's mask
        assert batch["cu_seqlens"].dtype == torch.int32
        assert torch.equal(dense_document_mask(DocumentMask(batch["cu_seqlens"], 3)), mask)
    else:
        assert "cu_seqlens" not in batch


@pytest.mark.parametrize("sp_size", [2, 3, 4])
def test_sp_slices_concatenate_to_full_batch(sp_size):
    texts = texts_with_documents()
    options = dict(
        eod_token=EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True
    )
    full = build_micro_batch(texts, 0, 1, **options)
    slices = [build_micro_batch(texts, rank, sp_size, **options) for rank in range(sp_size)]
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert all(s[key].shape == (3, 24 // sp_size) for s in slices)
        assert torch.equal(torch.cat([s[key] for s in slices], dim=1), full[key])
    for s in slices:
        assert torch.equal(s["cu_seqlens"], full["cu_seqlens"])  # the full sequence's
    # Without resets, rank r's positions are global: r * N/sp onward.
    plain = build_micro_batch(texts, sp_size - 1, sp_size)
    shard = 24 // sp_size
    assert torch.equal(plain["position_ids"][0], torch.arange(24 - shard, 24))
    # The last label of one rank is the next rank's first token (shift happened before slicing).
    assert torch.equal(slices[0]["labels"][:, -1], slices[1]["tokens"][:, 0])


def test_bad_sp_arguments():
    texts = texts_with_documents()
    with pytest.raises(ValueError, match="divisible"):
        build_micro_batch(texts, 0, 5)
    with pytest.raises(ValueError, match="sp_rank"):
        build_micro_batch(texts, 2, 2)
    with pytest.raises(ValueError, match="eod_token"):
        build_micro_batch(texts, 0, 1, eod_mask_loss=True)


def test_end_to_end_from_jsonl_with_loader_workers(tmp_path):
    """preprocess_data -> GPTDataset -> sampler -> loader worker process -> SP micro-batch."""
    import json

    from megatron_ul.data.gpt_dataset import build_train_valid_test_datasets
    from tools import preprocess_data

    source = tmp_path / "in.jsonl"
    source.write_text(
        "".join(
            json.dumps({"text": " ".join(str(1 + (i + j) % 90) for j in range(5 + i % 7))}) + "\n"
            for i in range(200)
        )
    )
    assert (
        preprocess_data.main(
            [
                "--input",
                str(source),
                "--output-prefix",
                str(tmp_path / "c"),
                "--tokenizer-type",
                "NullTokenizer",
                "--vocab-size",
                "100",
                "--append-eod",
            ]
        )
        == 0
    )
    train, valid, _ = build_train_valid_test_datasets(
        [str(tmp_path / "c_text_document")],
        "90,10,0",
        16,
        (64, 8, 0),
        seed=1,
        cache_path=str(tmp_path / "cache"),
    )
    sampler = PretrainingSampler(
        len(train), 0, micro_batch_size=4, data_parallel_rank=1, data_parallel_size=2
    )
    batches = list(micro_batch_iterator(train, sampler, num_workers=1))
    assert len(batches) == len(train) // 8
    for batch, indices in zip(batches, sampler):
        np.testing.assert_array_equal(batch.numpy(), np.stack([train[i]["text"] for i in indices]))
    micro_batch = build_micro_batch(
        batches[0], 1, 2, eod_token=99, reset_position_ids=True, eod_mask_loss=True
    )
    assert micro_batch["tokens"].shape == (4, 8)
    assert torch.equal(micro_batch["loss_mask"] == 0, micro_batch["tokens"] == 99)
    assert valid is not None and len(valid) >= 8
