"""A synthetic dataset with the GPTDataset interface, for runs without data files."""

import numpy as np


class MockGPTDataset:
    """``dataset[i] == {'text': int64 array of seq_length + 1 tokens in [0, vocab_size)}``.

    Each sample depends only on (seed, index), so any rank, worker or restart
    sees the same sample for the same index.
    """

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int = 1234):
        if num_samples < 0 or seq_length < 1 or vocab_size < 1:
            raise ValueError(f"need num_samples >= 0, seq_length >= 1, vocab_size >= 1; "
                             f"got {num_samples}, {seq_length}, {vocab_size}")
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index) -> dict:
        index = int(index)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        rng = np.random.default_rng([self.seed, index])
        return {"text": rng.integers(0, self.vocab_size, size=self.seq_length + 1, dtype=np.int64)}
