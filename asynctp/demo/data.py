"""Synthetic, learnable token streams generated locally: a fixed random Markov chain.

Hidden state y_t = (y_{t-1} + d_t) mod V with d_t drawn uniformly from `num_steps` fixed offsets,
token x_t = perm[y_t] for a fixed random permutation. Given x_{t-1} the next token is one of
`num_steps` tokens, equally likely: the best achievable loss is ln(num_steps), against ln(V) for
a model that has learnt nothing. Generation is a cumulative sum (no Python loop per token).
"""

from __future__ import annotations

import math

import torch

__all__ = ["MarkovTokens"]


class MarkovTokens:
    """Batches [B, S + 1] of a random Markov chain over V tokens, identical for identical seeds."""

    def __init__(self, vocab_size: int, seed: int = 0, num_steps: int = 4) -> None:
        if vocab_size < 2 * num_steps:
            raise ValueError(f"vocab_size requires at least {2 * num_steps} tokens, got {vocab_size}")
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.perm = torch.randperm(vocab_size, generator=g)
        self.offsets = torch.randperm(vocab_size - 1, generator=g)[:num_steps] + 1
        self.generator = torch.Generator().manual_seed(seed + 1)

    @property
    def best_loss(self) -> float:
        """The entropy of the next token: what a perfect model reaches."""
        return math.log(len(self.offsets))

    def batch(self, batch_size: int, seq_len: int) -> torch.Tensor:
        """[B, S + 1] int64 tokens: inputs are [:, :-1], targets [:, 1:]."""
        g = self.generator
        start = torch.randint(self.vocab_size, (batch_size, 1), generator=g)
        steps = self.offsets[torch.randint(len(self.offsets), (batch_size, seq_len), generator=g)]
        hidden = torch.cat([start, steps], dim=1).cumsum(1) % self.vocab_size
        return self.perm[hidden]
