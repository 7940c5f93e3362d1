"""A seeded toy language: a sparse Markov chain in which every token has a few successors with fixed
probabilities. A tiny model trained on it becomes predictable the way real text is (low-entropy continuations,
occasional branches), which random weights are not."""

from __future__ import annotations

import torch


class ToyLanguage:
    """Tokens 0 and 1 are reserved (BOS / EOS); every other token has ``len(branch_probs)`` successors."""

    def __init__(self, vocab_size: int, seed: int = 123, branch_probs: tuple[float, ...] = (0.6, 0.25, 0.1, 0.05)):
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)
        self.branch_probs = torch.tensor(branch_probs)
        self.successors = torch.stack(
            [torch.randperm(vocab_size - 2, generator=self.generator)[: len(branch_probs)] + 2
             for _ in range(vocab_size)]
        )

    def sample(self, count: int, length: int) -> torch.Tensor:
        """[count, length] int64 sequences from random start tokens."""
        result = torch.empty(count, length, dtype=torch.int64)
        result[:, 0] = torch.randint(2, self.vocab_size, (count,), generator=self.generator)
        probs = self.branch_probs.expand(count, -1)
        for step in range(1, length):
            choice = torch.multinomial(probs, 1, generator=self.generator)[:, 0]
            result[:, step] = self.successors[result[:, step - 1], choice]
        return result
