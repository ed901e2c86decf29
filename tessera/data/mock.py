"""--mock-data: deterministic synthetic sequences, so that training runs with no dataset.

Sample i is an arithmetic progression modulo the vocabulary, with a start and a stride
drawn from (seed, i). The rule is learnable in context (the stride shows after two
tokens), so the loss falls quickly: a smoke test of the whole training stack.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset


class MockGPTDataset(Dataset):
    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng([self.seed, index])
        start, stride = rng.integers(self.vocab_size), rng.integers(1, 4)
        tokens = torch.from_numpy((start + stride * np.arange(self.seq_length + 1)) % self.vocab_size)
        return {
            "tokens": tokens[:-1].long(),
            "labels": tokens[1:].long(),
            "loss_mask": torch.ones(self.seq_length),
            "position_ids": torch.arange(self.seq_length),
        }
