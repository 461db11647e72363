"""The sampled head (trainer/sampled_head.py): R = 1 is the full loss exactly, for every loss of the
registry; below 1 the columns hold every target, their count is fixed, the targets map to the
right columns, and the negatives are drawn uniformly."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from models import ClassHead
from trainer.losses import build_loss, list_losses
from trainer.sampled_head import ClassSampler, sampled_size

D, d, B = 40, 8, 16


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    head = ClassHead(d, D).double()
    h = torch.randn(B, d, generator=g, dtype=torch.float64)
    y = torch.randint(0, D, (B,), generator=g)
    return head, h, y


@pytest.mark.parametrize("loss_name", list_losses())
def test_rate_one_is_the_full_loss_and_gradient(loss_name):
    head, h, y = _batch()
    sampler = ClassSampler(D, 1.0, B)
    cols = sampler(y)
    assert torch.equal(cols, torch.arange(D))
    params = {"k": 3} if loss_name == "smooth_topk" else {}
    full_loss, sampled_loss = build_loss(loss_name, D, **params), build_loss(loss_name, sampler.size, **params)
    torch.manual_seed(1)
    want = full_loss(head(h), y)
    want.backward()
    want_grad = head.weight.grad.clone()
    head.weight.grad = None
    torch.manual_seed(1)  # nce's sampled mode draws noise: the same draws
    got = sampled_loss(head(h, cols), ClassSampler.positions(cols, y))
    got.backward()
    assert got.item() == want.item()
    assert torch.equal(head.weight.grad, want_grad)


@pytest.mark.parametrize("rate", [0.05, 0.3, 0.75])
def test_columns_hold_every_target_and_keep_their_count(rate):
    sampler = ClassSampler(D, rate, B, seed=3)
    assert sampler.size == min(D, max(round(rate * D), B))
    for seed in range(20):
        _, _, y = _batch(seed)
        cols = sampler(y)
        assert cols.numel() == sampler.size and torch.equal(cols, torch.sort(torch.unique(cols)).values)
        assert torch.equal(cols[ClassSampler.positions(cols, y)], y)


def test_negatives_are_drawn_uniformly():
    """Each class not in the batch is drawn with probability (K - P) / (D - P): counted over 4,000
    draws against a 5-sigma binomial band (a fixed seed: the test is deterministic)."""
    sampler = ClassSampler(D, 0.5, 4, seed=11)
    y = torch.tensor([0, 1, 2, 3])
    counts = np.zeros(D)
    draws = 4000
    for _ in range(draws):
        counts[sampler(y).numpy()] += 1
    assert (counts[:4] == draws).all()  # the positives, always
    p = (sampler.size - 4) / (D - 4)
    sigma = np.sqrt(draws * p * (1 - p))
    assert np.abs(counts[4:] - draws * p).max() < 5 * sigma


def test_sampled_head_logits_are_the_full_logits_of_those_columns():
    head, h, y = _batch(5)
    cols = ClassSampler(D, 0.4, B, seed=2)(y)
    torch.testing.assert_close(head(h, cols), head(h)[:, cols], rtol=0, atol=1e-12)


def test_rate_outside_zero_one_is_refused():
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="in \\(0, 1\\]"):
            sampled_size(D, bad, B)
