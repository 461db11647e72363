"""The sampled head of Partial FC (An et al., "Partial FC: Training 10 Million Identities on a
Single Machine"): each step computes logits only for the classes present in the batch plus a
uniform sample of the others, K = max(round(R·D), batch size) columns in all (at most D), so the
head's cost per step is K rows instead of D.

The loss sees the K sampled columns as its whole class set (docs/losses.md says what that means
for each loss: for softmax-type losses the softmax over the sampled columns, as in Partial FC).
K is the same at every step (losses built for K classes, e.g. nce's uniform prior 1/K, stay
valid), and with R = 1 the columns are exactly 0..D-1: the full loss, bit for bit.
"""
from __future__ import annotations

import torch


def sampled_size(num_classes: int, rate: float, batch_size: int) -> int:
    """K: round(R·D), at least the batch size (every positive fits), at most D."""
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"head sample rate must be in (0, 1], got {rate}")
    return int(min(num_classes, max(round(rate * num_classes), batch_size)))


class ClassSampler:
    """cols = sampler(targets): K sorted class ids holding every target of the (global) batch;
    `positions(cols, targets)` gives the targets as columns of the sampled logits. Every rank of a
    data-parallel run draws the same columns (same seed, same global batch), so batch losses can
    gather logits across ranks."""

    def __init__(self, num_classes: int, rate: float, batch_size: int, seed: int = 0):
        self.num_classes = int(num_classes)
        self.size = sampled_size(num_classes, rate, batch_size)
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, targets: torch.Tensor) -> torch.Tensor:
        positives = torch.unique(targets)  # [P] sorted
        need = self.size - positives.numel()
        if self.size == self.num_classes:
            cols = torch.arange(self.num_classes)
        else:
            others = torch.ones(self.num_classes, dtype=torch.bool)
            others[positives] = False
            pool = torch.nonzero(others).squeeze(1)  # [D - P] classes not in the batch
            picked = pool[torch.randperm(pool.numel(), generator=self.generator)[:need]]  # uniform, no repeats
            cols, _ = torch.sort(torch.cat([positives, picked]))  # [K]
        return cols

    @staticmethod
    def positions(cols: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """[B] position of each target in the sorted cols [K]."""
        return torch.searchsorted(cols, targets)
