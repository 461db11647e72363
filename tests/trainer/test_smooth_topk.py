"""smooth_topk (Berrada et al. 2018) against independent truths: brute-force enumeration of the
k-subsets (itertools.combinations) in float64 for values, autograd through that enumeration for
gradients, gradcheck, the hard top-k SVM in the τ -> 0 limit, float32 at magnitude 1e3."""
from __future__ import annotations

import itertools

import pytest
import torch

from trainer.losses import build_loss
from trainer.losses.smooth_topk import (
    _log_esp_fast, hard_topk_loss, log_esp, smooth_topk_autograd, smooth_topk_loss,
)

torch.set_num_threads(1)


def brute_force(logits: torch.Tensor, target: torch.Tensor, k: int, tau: float, alpha: float) -> torch.Tensor:
    """L_{k,τ} per example [B] straight from the definition: a logsumexp over every k-subset Y of
    the classes, (α·[y ∉ Y] + mean_{j∈Y} z_j)/τ, minus the one over the subsets containing y."""
    C = logits.shape[1]
    subsets = torch.tensor(list(itertools.combinations(range(C), k)))  # [S, k]
    member = torch.zeros(len(subsets), C, dtype=torch.bool).scatter_(1, subsets, True)  # [S, C]
    out = []
    for row, y in zip(logits, target.tolist()):
        score = row[subsets].sum(1) / k  # [S]
        has_y = member[:, y]
        first = torch.logsumexp((alpha * (~has_y).to(row.dtype) + score) / tau, 0)
        second = torch.logsumexp(score[has_y] / tau, 0)
        out.append(tau * (first - second))
    return torch.stack(out)


def brute_log_esp(x: torch.Tensor, K: int) -> torch.Tensor:
    """log σ_j(exp(x)) by enumeration [B, K+1] (−inf where j > n)."""
    n = x.shape[1]
    cols = []
    for j in range(K + 1):
        if j > n:
            cols.append(torch.full((x.shape[0],), float("-inf"), dtype=x.dtype))
            continue
        terms = [x[:, list(c)].sum(1) for c in itertools.combinations(range(n), j)]
        cols.append(torch.logsumexp(torch.stack(terms, 1), 1))
    return torch.stack(cols, 1)


def sample(B: int, C: int, scale: float, seed: int, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(B, C, generator=gen, dtype=dtype)
    target = torch.randint(0, C, (B,), generator=gen)
    return logits, target


CASES = [  # (C, k, tau, alpha)
    (7, 1, 1.0, 1.0),
    (7, 2, 1.0, 1.0),
    (7, 5, 1.0, 1.0),
    (8, 3, 0.3, 2.0),
    (9, 4, 2.0, 0.5),
    (10, 5, 0.5, 1.0),
    (6, 5, 1.0, 1.0),  # k = C − 1
    (12, 2, 0.1, 1.0),
]


# ------------------------------------------------------------------------ forward: ESPs and value
@pytest.mark.parametrize("n,K", [(1, 3), (2, 2), (5, 3), (7, 7), (9, 6), (13, 5), (16, 4)])
@pytest.mark.parametrize("scale", [0.5, 5.0, 80.0])
def test_log_esp_matches_enumeration(n, K, scale):
    x = scale * torch.randn(4, n, generator=torch.Generator().manual_seed(n * 31 + K), dtype=torch.float64)
    x = x - x.amax(1, keepdim=True)  # the loss passes rows with max 0
    expected = brute_log_esp(x, K)
    real = slice(0, min(n, K) + 1)
    for fn in (log_esp, _log_esp_fast):
        got = fn(x, K)
        assert got.shape == (4, K + 1)
        torch.testing.assert_close(got[:, real], expected[:, real], rtol=1e-12, atol=1e-12)
        # σ_j = 0 for j > n: −inf, or (exact path) far below every real coefficient
        assert (got[:, n + 1:] < expected[:, n:n + 1] - 100).all()


@pytest.mark.parametrize("C,k,tau,alpha", CASES)
@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_value_matches_brute_force(C, k, tau, alpha, scale):
    logits, target = sample(6, C, scale, seed=C + k)
    expected = brute_force(logits, target, k, tau, alpha)
    torch.testing.assert_close(smooth_topk_loss(logits, target, k, tau, alpha), expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(smooth_topk_autograd(logits, target, k, tau, alpha), expected, rtol=1e-10, atol=1e-10)


def test_registered_module_is_batch_mean():
    logits, target = sample(5, 9, 2.0, seed=3)
    loss = build_loss("smooth_topk", 9, k=3, tau=0.5, alpha=1.5)
    assert loss.pols is False
    value = loss(logits, target)
    assert value.shape == ()
    torch.testing.assert_close(value, brute_force(logits, target, 3, 0.5, 1.5).mean(), rtol=1e-10, atol=1e-10)


def test_rejects_k_not_below_num_classes():
    with pytest.raises(ValueError):
        build_loss("smooth_topk", 5, k=5)


# ------------------------------------------------------------------------ backward
@pytest.mark.parametrize("C,k,tau,alpha", CASES)
@pytest.mark.parametrize("scale", [1.0, 6.0])
def test_gradient_matches_autograd_of_brute_force(C, k, tau, alpha, scale):
    logits, target = sample(6, C, scale, seed=7 * C + k)
    weights = torch.linspace(0.5, 1.5, 6, dtype=torch.float64)  # a non-uniform upstream gradient
    z_ref = logits.clone().requires_grad_(True)
    (weights * brute_force(z_ref, target, k, tau, alpha)).sum().backward()
    z = logits.clone().requires_grad_(True)
    (weights * smooth_topk_loss(z, target, k, tau, alpha)).sum().backward()
    torch.testing.assert_close(z.grad, z_ref.grad, rtol=1e-7, atol=1e-9)


def test_gradient_with_dominant_classes_uses_stable_path():
    """A few classes far above the rest make the plain recursion unstable (Observation 1)."""
    logits, target = sample(8, 9, 1.0, seed=11)
    logits[:, :3] += torch.tensor([40.0, 25.0, 12.0], dtype=torch.float64)
    target[:4] = 8
    for k, tau in [(2, 1.0), (4, 1.0), (5, 0.5), (3, 0.2)]:
        z_ref = logits.clone().requires_grad_(True)
        brute_force(z_ref, target, k, tau, 1.0).sum().backward()
        z = logits.clone().requires_grad_(True)
        smooth_topk_loss(z, target, k, tau, 1.0).sum().backward()
        torch.testing.assert_close(z.grad, z_ref.grad, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("C", [7, 50])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("tau", [1.0, 0.3])
def test_gradcheck_float64(C, k, tau):
    logits, target = sample(3, C, 2.0, seed=C * k)
    z = logits.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda q: smooth_topk_loss(q, target, k, tau, 1.0), (z,))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_custom_backward_equals_autograd_at_scale(k):
    """C = 300: the fast forward and the custom backward against autograd through the exact path."""
    logits, target = sample(16, 300, 3.0, seed=k)
    logits[::4, :k] += 30.0  # some rows with clearly separated top classes
    z_ref = logits.clone().requires_grad_(True)
    ref = smooth_topk_autograd(z_ref, target, k)
    ref.sum().backward()
    z = logits.clone().requires_grad_(True)
    got = smooth_topk_loss(z, target, k)
    got.sum().backward()
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(z.grad, z_ref.grad, rtol=1e-7, atol=1e-9)


# ------------------------------------------------------------------------ limits and numerics
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_small_temperature_gives_hard_topk_svm(k):
    logits, target = sample(8, 10, 3.0, seed=k)
    hard = hard_topk_loss(logits, target, k, alpha=1.0)
    # by hand: max(0, 1 + (k-th largest false logit − true logit)/k)
    for i in range(8):
        false = sorted((v for j, v in enumerate(logits[i].tolist()) if j != target[i]), reverse=True)
        assert hard[i].item() == pytest.approx(max(0.0, 1.0 + (false[k - 1] - logits[i, target[i]].item()) / k))
    smooth = smooth_topk_loss(logits, target, k, tau=1e-4, alpha=1.0)
    torch.testing.assert_close(smooth, hard, rtol=0, atol=1e-3)
    # the τ-dependence: the smooth loss decreases toward the hard one
    coarse = smooth_topk_loss(logits, target, k, tau=1.0, alpha=1.0)
    assert (coarse >= smooth - 1e-9).all()


def test_hard_rows_have_hard_gradient():
    """Separated rows take the hard loss: gradient −1/k on y and +1/k on the k-th false class."""
    k = 3
    logits = torch.tensor([[300.0, 200.0, 100.0, 0.0, -100.0, -200.0]], dtype=torch.float64)
    target = torch.tensor([5])
    z = logits.clone().requires_grad_(True)
    loss = smooth_topk_loss(z, target, k, tau=1.0, alpha=1.0)
    loss.backward()
    assert loss.item() == pytest.approx(hard_topk_loss(logits, target, k).item())
    expected = torch.zeros_like(logits)
    expected[0, 2], expected[0, 5] = 1.0 / k, -1.0 / k
    torch.testing.assert_close(z.grad, expected, rtol=0, atol=1e-12)


def _extreme_batches(C: int, dtype):
    gen = torch.Generator().manual_seed(0)
    yield 1e3 * torch.randn(8, C, generator=gen, dtype=dtype)
    yield 1e3 * (2 * torch.rand(8, C, generator=gen, dtype=dtype) - 1)
    yield torch.full((8, C), 1e3, dtype=dtype)
    yield torch.full((8, C), -1e3, dtype=dtype)
    z = torch.full((8, C), -1e3, dtype=dtype)
    z[:, :3] = 1e3  # three huge classes, the rest tiny
    yield z


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("C,k", [(7, 5), (50, 2), (1000, 5)])
@pytest.mark.parametrize("tau", [1.0, 0.05])
def test_finite_at_magnitude_1e3(dtype, C, k, tau):
    target = torch.arange(8) % C
    for logits in _extreme_batches(C, dtype):
        for tgt in (target, torch.full((8,), C - 1), torch.zeros(8, dtype=torch.long)):
            z = logits.clone().requires_grad_(True)
            loss = build_loss("smooth_topk", C, k=k, tau=tau)(z, tgt)
            loss.backward()
            assert torch.isfinite(loss), (logits[0, :3], tgt[:3])
            assert torch.isfinite(z.grad).all()
            assert loss.item() >= 0.0


@pytest.mark.parametrize("k", [2, 5])
def test_float32_close_to_float64(k):
    logits, target = sample(32, 200, 5.0, seed=k)
    z64 = logits.clone().requires_grad_(True)
    l64 = smooth_topk_loss(z64, target, k)
    l64.sum().backward()
    z32 = logits.float().requires_grad_(True)
    l32 = smooth_topk_loss(z32, target, k)
    l32.sum().backward()
    torch.testing.assert_close(l32.double(), l64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(z32.grad.double(), z64.grad, rtol=1e-3, atol=2e-6)
