"""A synthetic dataset with the GPTDataset interface, for runs without data files."""

import numpy as np


class MockGPTDataset:
    """``dataset[i] == {'text': int64 array of seq_length + 1 tokens in [0, vocab_size)}``.

    Each sample depends only on (seed, index), so any rank, worker or restart
    sees the same sample for the same index.

    With ``eod_token``, a sample is a run of documents, each ending with the EOD token, as the
    samples of Megatron's MockGPTDataset are (so --eod-mask-loss, --reset-position-ids and
    --reset-attention-mask have document boundaries to act on): document lengths (EOD
    included) are uniform in [1, seq_length], the other tokens uniform over the vocabulary
    without EOD, and the last document may be cut off by the end of the sample.
    """

    def __init__(
        self,
        num_samples: int,
        seq_length: int,
        vocab_size: int,
        seed: int = 1234,
        eod_token: int | None = None,
    ):
        if num_samples < 0 or seq_length < 1 or vocab_size < 1:
            raise ValueError(
                f"need num_samples >= 0, seq_length >= 1, vocab_size >= 1; "
                f"got {num_samples}, {seq_length}, {vocab_size}"
            )
        if eod_token is not None and (vocab_size < 2 or not 0 <= eod_token < vocab_size):
            raise ValueError(
                f"eod_token {eod_token} must be one of vocab_size {vocab_size} (>= 2) ids"
            )
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.eod_token = eod_token

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index) -> dict:
        index = int(index)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        rng = np.random.default_rng([self.seed, index])
        length = self.seq_length + 1
        if self.eod_token is None:
            return {"text": rng.integers(0, self.vocab_size, size=length, dtype=np.int64)}
        text = rng.integers(0, self.vocab_size - 1, size=length, dtype=np.int64)
        text[text >= self.eod_token] += 1  # every id but EOD
        ends = np.cumsum(rng.integers(1, self.seq_length + 1, size=length)) - 1
        text[ends[ends < length]] = self.eod_token
        return {"text": text}
