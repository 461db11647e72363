"""Smooth top-k SVM loss L_{k,τ} of Berrada, Zisserman & Kumar (ICLR 2018), docs/losses.md.

Per example, with x = z / (kτ) and e = exp(x), the paper's decomposition (its eq. 10) over the
"other" classes o = {j ≠ y} gives

    L = τ·log(e_y·σ_{k−1}(e_o) + exp(α/τ)·σ_k(e_o)) − τ·log(e_y·σ_{k−1}(e_o))
      = τ·softplus(α/τ + log σ_k(e_o) − log σ_{k−1}(e_o) − x_y),

σ_j the elementary symmetric polynomials (the subsets of all classes are split into those with
and without y: Σ_{Y∋y} = e_y·σ_{k−1}(e_o), Σ_{Y∌y} = σ_k(e_o), and σ_k(e) is their sum).
Written this way no subtraction is ever needed.

Forward (no enumeration, O(kC) work): log σ_0..σ_K of every row by the divide-and-conquer
product of the polynomials Π_i (1 + e_i X) truncated at degree K, in log space (base 2, so the
exponentials are exp2, which torch runs ~3x faster than exp). Classes are paired i <-> i + N/2
so that each level is a batched product on contiguous halves; there are log2(C) levels.
`log_esp` shifts every logsumexp by its max term (autograd-friendly, the reference);
`_log_esp_fast`, used by the loss, shifts per coefficient vector so that it exponentiates once
per coefficient instead of once per term, checks every sum for underflow and sends the rows
that fail (extreme logit spreads) to `log_esp`.

Backward (custom, the paper's Algorithm 2): with π_{j,i} = e_i·δ_{j,i}/σ_j = ∂log σ_j/∂x_i and the
recursion δ_{j,i} = σ_{j−1} − e_i·δ_{j−1,i}, i.e. π_{j,i} = e_i·(σ_{j−1}/σ_j)·(1 − π_{j−1,i}),
the gradient is ∂L/∂z_i = s·(π_{k,i} − π_{k−1,i} − [i = y])/k with s = sigmoid(u).
The recursion loses precision where 1 − π_{j−1,i} cancels (e_i dominates, Observation 1 of
Appendix B.2.2); those entries get the p-th order approximation
π_{j,i} ≈ Σ_{m=0..p} (−1)^m σ_{j+m}/(σ_j·e_i^m) (Definition 1), which needs σ up to K = k + p.
Rows whose top-k gaps make the smooth loss equal to the hard top-k loss in the working precision
use the hard loss and its (sparse) gradient, as the paper's implementation does.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from trainer.losses import Loss, register_loss

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)
# exp2 below 2^-126 would give subnormals (slow on CPU); such terms are negligible anyway.
MIN_EXP2 = -126.0
# Padding and the masked true class sit this many bits below the row minimum: their
# exponentials vanish against every real term (2^-256 relative) yet stay finite, so no
# inf - inf and no NaN gradient can appear.
PAD_BITS = 256.0


# ----------------------------------------------------------------------------- log-space ESPs
_GRID_INDEX: dict[tuple, torch.Tensor] = {}


def _grid_index(d1: int, d2: int, out: int, device) -> torch.Tensor:
    """Flat index into B's coefficients (d2 + 1 rows, then one −inf row) for the grid
    T[a, m−1] = A_a + B_{m−a}, a = 0..d1, m = 1..out; out-of-range b points at the −inf row."""
    key = (d1, d2, out, str(device))
    idx = _GRID_INDEX.get(key)
    if idx is None:
        a = torch.arange(d1 + 1)[:, None]
        b = torch.arange(1, out + 1)[None, :] - a
        idx = torch.where((b >= 0) & (b <= d2), b, torch.full_like(b, d2 + 1)).reshape(-1).to(device)
        _GRID_INDEX[key] = idx
    return idx


def _log2_poly_mul(A: torch.Tensor, Bq: torch.Tensor, K: int) -> torch.Tensor:
    """Product of polynomial pairs in base-2 log space, truncated at degree K.

    A [d1+1, h, B], Bq [d2+1, h, B]: log2 coefficients (row 0 is log2 1 = 0) of h·B polynomials
    each -> [min(d1+d2, K)+1, h, B]. Out-of-place ops only, so autograd can run through it.
    """
    d1, d2 = A.shape[0] - 1, Bq.shape[0] - 1
    out = min(d1 + d2, K)
    neg = Bq.new_full((1,) + Bq.shape[1:], float("-inf"))
    b_rows = torch.cat([Bq, neg], 0).index_select(0, _grid_index(d1, d2, out, A.device))
    T = b_rows.view(d1 + 1, out, *A.shape[1:]) + A[:, None]  # [d1+1, out, h, B]
    shift = T.detach().amax(0)  # [out, h, B], finite: every m has a term with b in range
    terms = torch.exp2((T - shift).clamp(min=MIN_EXP2))
    coef = torch.log2(terms.sum(0)) + shift  # [out, h, B]
    return torch.cat([torch.zeros_like(coef[:1]), coef], 0)


def log_esp(x: torch.Tensor, K: int) -> torch.Tensor:
    """log σ_j(exp(x)) for j = 0..K of each row: x [B, n] (natural log) -> [B, K+1].

    Divide and conquer over Π_i (1 + e_i X) in base-2 log space, max-shifted per term. For rows
    with max x = 0 (as the loss passes them) σ_j = 0 for j > n shows up as a value at least
    PAD_BITS below σ_n, not as −inf.
    """
    B, n = x.shape
    x2 = x.t() * LOG2E  # [n, B], base-2 log
    N = 1 << max(1, (n - 1).bit_length())
    if N > n:
        pad = x2.detach().amin(0, keepdim=True) - PAD_BITS  # [1, B]
        x2 = torch.cat([x2, pad.expand(N - n, B)], 0)
    # level 1 in closed form: (1 + aX)(1 + bX) = 1 + (a + b)X + abX^2, pairs i <-> i + N/2
    h = N // 2
    a, b = x2[:h], x2[h:]
    hi, lo = torch.maximum(a, b), torch.minimum(a, b)
    c1 = hi + torch.log2(1.0 + torch.exp2((lo - hi).clamp(min=MIN_EXP2)))
    P = torch.stack([torch.zeros_like(a), c1, a + b], 0)  # [3, N/2, B]
    while P.shape[1] > 1:
        h = P.shape[1] // 2
        P = _log2_poly_mul(P[:, :h], P[:, h:], K)
    P = P[:, 0]  # [deg+1, B]
    if P.shape[0] < K + 1:  # fewer than K classes: σ_j = 0 beyond, written as very small
        steps = torch.arange(1, K + 2 - P.shape[0], dtype=P.dtype, device=P.device)[:, None]
        P = torch.cat([P, P[-1:].detach() - PAD_BITS * steps], 0)
    return P.t() * LN2


# ----------------------------------------------------------------------------- fast forward
# A linear-space sum that comes out below this (relative to its shift) may have lost terms
# to underflow; its row is recomputed by the exact log_esp. Derivation: a lost term is below
# the smallest normal (2^-126 in float32, 2^-1022 in float64) and is multiplied by at most
# C(16, 8) < 2^14 co-factors in a group of 16 (the tilted merges are bounded likewise), over
# < 2^7 (node, coefficient) pairs; a sum >= 2^-80 (2^-940) keeps the relative error ~eps.
_MIN_LINEAR = {torch.float32: 2.0 ** -80, torch.float64: 2.0 ** -940}
GROUP = 16  # leaves multiplied out in linear space under one shift (the group max)


def _lin_poly_mul(A: torch.Tensor, Bq: torch.Tensor, K: int) -> torch.Tensor:
    """Linear-space product of polynomial batches, truncated at degree K:
    A [d1+1, ...], Bq [d2+1, ...] -> [min(d1+d2, K)+1, ...]; one fused multiply-add per a."""
    d1, d2 = A.shape[0] - 1, Bq.shape[0] - 1
    out = min(d1 + d2, K)
    C = A.new_zeros((out + 1,) + A.shape[1:])
    for a in range(min(d1, out) + 1):
        hi = min(d2, out - a)
        C[a:a + hi + 1].addcmul_(A[a:a + 1], Bq[:hi + 1])
    return C


def _underflow_rows(C: torch.Tensor, count: torch.Tensor, floor: float) -> torch.Tensor:
    """[B] bool: some linear coefficient C[m, node, b] (m >= 1) fell below `floor` although it is
    not an exact zero (m <= count[node], the number of classes in the node)."""
    out = C.shape[0] - 1
    C = C[1:]
    if int(count.min()) < out:  # nodes with fewer classes than the degree: skip their exact zeros
        js = torch.arange(1, out + 1, device=C.device)
        C = C + torch.where(js[:, None] <= count[None, :], 0.0, float("inf")).to(C.dtype)[:, :, None]
    return C.reshape(-1, C.shape[-1]).amin(0) < floor


def _group_polynomials(x: torch.Tensor, N: int, G: int, M: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step (1) of _log_esp_fast: (P [d+1, M, B], σ_j(e') of each group in linear space, and
    gmax [M, B], the group's shift). The classes, padded to N with e = 0, form M groups of G."""
    B, n = x.shape
    x2 = x.new_full((N, B), float("-inf"))
    torch.mul(x.t(), LOG2E, out=x2[:n])  # padding rows: e = 0 exactly
    leaves = x2.view(G, M, B)  # leaf t of group ν is class ν + t·M
    gmax = leaves.amax(0)  # [M, B]; finite: the first half of every group is real
    e = torch.exp2(leaves - gmax)  # [G, M, B] in [0, 1]
    h = G // 2
    P = x.new_empty((3, h, M, B))  # first level in closed form: (1 + aX)(1 + bX)
    P[0] = 1.0
    torch.add(e[:h], e[h:], out=P[1])
    torch.mul(e[:h], e[h:], out=P[2])
    while P.shape[1] > 1:
        h = P.shape[1] // 2
        P = _lin_poly_mul(P[:, :h], P[:, h:], K)
    return P[:, 0], gmax  # [d+1, M, B], σ_j(e') of each group


def _tilted_merge(L: torch.Tensor, count: torch.Tensor, K: int, floor: float,
                  bad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step (2) of _log_esp_fast, one level: merge node pairs i <-> i + h of the base-2 log
    coefficients L [d+1, 2h, B] (count [2h] classes per node) by a chord tilt and linear-space
    product -> (L [out+1, h, B], count [h]); ORs the rows that underflowed into `bad` in place."""
    B = L.shape[2]
    h = L.shape[1] // 2
    A, Bq, cA, cB = L[:, :h], L[:, h:], count[:h], count[h:]
    d = L.shape[0] - 1
    tA, tB = cA.clamp(max=d), cB.clamp(max=d)  # [h] highest non-zero coefficient
    top = A.gather(0, tA.view(1, h, 1).expand(1, h, B)) + Bq.gather(0, tB.view(1, h, 1).expand(1, h, B))
    lam = top[0] / (tA + tB).to(L.dtype)[:, None]  # [h, B] chord slope of the product
    js = torch.arange(d + 1, device=L.device, dtype=L.dtype)[:, None, None]
    At = torch.addcmul(A, js, lam, value=-1.0)  # A_a − λ·a
    Bt = torch.addcmul(Bq, js, lam, value=-1.0)
    uA, uB = At.amax(0), Bt.amax(0)
    C = _lin_poly_mul(torch.exp2(At - uA), torch.exp2(Bt - uB), K)  # [out+1, h, B]
    count = cA + cB
    bad |= _underflow_rows(C, count, floor)
    js = torch.arange(C.shape[0], device=L.device, dtype=L.dtype)[:, None, None]
    L = torch.log2(C).add_(uA + uB).addcmul_(js, lam)
    L[0] = 0.0
    return L, count


def _log_esp_fast(x: torch.Tensor, K: int) -> torch.Tensor:
    """log_esp without autograd, several times faster, same values to working precision.

    The log-sum-exp trick is exact for any shift; the max is only needed to stay in range.
    Here the shift is chosen per polynomial *coefficient vector* rather than per term:
    (1) groups of GROUP leaves share their max as shift, so e' = exp2(x − max) <= 1 and the
        group's polynomial is multiplied out in plain linear arithmetic;
    (2) above that, each merge tilts both log2 coefficient vectors by a common slope λ (the
        chord of the pair) and their own max, A_a − λ·a − u_A, exponentiates once per
        coefficient, multiplies in linear space and takes log2 once per output coefficient.
    Every linear result is checked (_MIN_LINEAR, ignoring coefficients that are exact zeros
    because a node has fewer classes than the degree); rows failing anywhere (extreme logit
    spreads) are recomputed by the exact per-term-max log_esp. σ_j for j > n is −inf here.
    """
    B, n = x.shape
    N = 1 << max(1, (n - 1).bit_length())
    G = min(GROUP, N)
    M = N // G
    floor = _MIN_LINEAR.get(x.dtype, 2.0 ** -80)
    P, gmax = _group_polynomials(x, N, G, M, K)  # [d+1, M, B], [M, B]
    count = (torch.arange(N, device=x.device).view(G, M) < n).sum(0)  # [M] classes per group
    bad = _underflow_rows(P, count, floor)
    js = torch.arange(P.shape[0], device=x.device, dtype=x.dtype)[:, None, None]
    L = torch.log2(P).addcmul_(js, gmax)  # [d+1, M, B] base-2 log σ_j of each group
    while L.shape[1] > 1:
        L, count = _tilted_merge(L, count, K, floor, bad)
    res = L[:, 0]  # [d+1, B]
    if res.shape[0] < K + 1:
        res = torch.cat([res, res.new_full((K + 1 - res.shape[0], B), float("-inf"))], 0)
    res = res.t() * LN2  # [B, K+1]
    if bool(bad.any()):
        rows = bad.nonzero().squeeze(1)
        res[rows] = log_esp(x[rows], K)
    return res


# ----------------------------------------------------------------------------- the loss pieces
def _scaled_others(logits: torch.Tensor, target: torch.Tensor, k: int, tau: float):
    """x = (z − max z)/(kτ) [B, C] with the true class pushed PAD_BITS below the row minimum
    (it leaves σ_j(e_o)), x_y [B], and the spread max − min of x [B]."""
    x = (logits - logits.detach().amax(1, keepdim=True)) / (k * tau)
    x_true = x.gather(1, target[:, None]).squeeze(1)
    low = x.detach().amin(1, keepdim=True)
    x_others = x.scatter(1, target[:, None], low - PAD_BITS * LN2)
    return x_others, x_true, -low[:, 0]


def hard_topk_loss(logits: torch.Tensor, target: torch.Tensor, k: int, alpha: float = 1.0) -> torch.Tensor:
    """The non-smooth top-k SVM l_k = max(0, α + (z_[k] − z_y)/k) per example [B],
    z_[k] the k-th largest logit among the classes j ≠ y (the τ -> 0 limit of L_{k,τ})."""
    others = logits.scatter(1, target[:, None], float("-inf"))
    kth = others.topk(k, dim=1).values[:, -1]
    return torch.clamp(alpha + (kth - logits.gather(1, target[:, None]).squeeze(1)) / k, min=0.0)


def smooth_topk_autograd(logits: torch.Tensor, target: torch.Tensor, k: int = 5, tau: float = 1.0,
                         alpha: float = 1.0) -> torch.Tensor:
    """Per-example L_{k,τ} [B] by plain autograd through the log-space forward: the
    straightforward implementation the custom backward is measured against."""
    x_others, x_true, _ = _scaled_others(logits, target, k, tau)
    lsig = log_esp(x_others, k)  # [B, k+1]
    return tau * F.softplus(alpha / tau + lsig[:, k] - lsig[:, k - 1] - x_true)


def _hard_margin(dtype: torch.dtype) -> float:
    """log(1/eps) + 1: beyond this natural-log margin smooth and hard agree to working precision."""
    return math.log(1.0 / torch.finfo(dtype).eps) + 1.0


class _SmoothTopk(torch.autograd.Function):
    """Per-example L_{k,τ} [B] with the paper's backward (Algorithm 2 + Appendix B.2.2)."""

    @staticmethod
    def forward(ctx, logits, target, k: int, tau: float, alpha: float, order: int):
        B, C = logits.shape
        n = C - 1
        K = k + order
        x_others, x_true, spread = _scaled_others(logits, target, k, tau)
        lsig = _log_esp_fast(x_others, K)  # [B, K+1], natural log
        u = alpha / tau + lsig[:, k] - lsig[:, k - 1] - x_true  # [B]
        loss = tau * F.softplus(u)

        # rows where smooth == hard in this precision (Appendix A.2 limit reached numerically);
        # a row can only qualify if its logits spread over more than the required gaps
        margin = _hard_margin(logits.dtype)
        need = margin + math.log(k * n)
        hard = torch.zeros_like(u, dtype=torch.bool)
        u_hard = kth_index = None
        if n > k and bool((spread > need).any()):  # no gap can exceed the row's spread
            m = min(k + 1, n)
            top = x_others.topk(m, dim=1)  # values [B, m]; the masked true class is below all
            kth = top.values[:, k - 1]
            gap_k = kth - top.values[:, k]
            gap_km1 = top.values[:, k - 2] - kth if k >= 2 else torch.full_like(kth, float("inf"))
            u_hard = alpha / tau + kth - x_true
            hard = (gap_k > need) & (gap_km1 > need) & (u_hard.abs() > margin)
            loss = torch.where(hard, tau * u_hard.clamp(min=0.0), loss)
            kth_index = top.indices[:, k - 1]
        ctx.save_for_backward(x_others, target, lsig, u, hard, u_hard, kth_index)
        ctx.k, ctx.order = k, order
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        x_others, target, lsig, u, hard, u_hard, kth_index = ctx.saved_tensors
        k, p = ctx.k, ctx.order
        pi_km1, pi_k = _inclusion_probabilities(x_others, lsig, k, p)  # [B, C] each
        weight = torch.sigmoid(u)  # [B]
        grad = pi_k - pi_km1
        grad.scatter_(1, target[:, None], -1.0)
        # hard rows: sub-gradient of max(0, α + (z_[k] − z_y)/k)
        if bool(hard.any()):
            hard_grad = torch.zeros_like(grad)
            hard_grad.scatter_(1, kth_index[:, None], 1.0)
            hard_grad.scatter_(1, target[:, None], -1.0)
            grad = torch.where(hard[:, None], hard_grad, grad)
            weight = torch.where(hard, (u_hard > 0).to(weight.dtype), weight)
        grad.mul_((grad_loss * weight / k)[:, None])
        return grad, None, None, None, None, None


def _recursion_terms(x: torch.Tensor, lsig: torch.Tensor, k: int) -> dict:
    """{j: (π_j [B, C], g_j [B, C])} for j = k−1, k by the plain recursion of Algorithm 2; g_j is
    the error growth the caller uses to find the entries the recursion got wrong."""
    ratio = lsig[:, :k] - lsig[:, 1:k + 1]  # [B, k]: log σ_{j−1} − log σ_j, j = 1..k
    # a_j = e_i·σ_{j−1}/σ_j as a product when no row's ratio can overflow, else per entry in log
    product_form = bool(ratio.max() < 0.5 * math.log(torch.finfo(x.dtype).max))
    if product_form:
        e = torch.exp(x)  # x <= 0 (row max subtracted): no overflow; underflow only where a_j ~ 0
        ratio = ratio.exp()
    one_minus = torch.ones_like(x)  # 1 − π_0
    growth = torch.ones_like(x)  # g_0
    keep = {}
    for j in range(1, k + 1):
        if product_form:
            a = e * ratio[:, j - 1:j]
        else:
            a = torch.exp(x + ratio[:, j - 1:j])  # finite or +inf, never NaN
        growth = (growth * a).add_(1.0)
        if j >= k - 1:
            keep[j] = (a * one_minus, growth)
        if j < k:
            one_minus = (a * one_minus).neg_().add_(1.0)
    return keep


def _approximate_unstable(x: torch.Tensor, lsig: torch.Tensor, keep: dict, k: int, p: int, eps: float,
                          tol: float) -> tuple[list, list, list]:
    """Replace, in keep's π in place, the unstable entries (eps·g > tol) by the p-th order
    approximation where its error bound is below tol; returns (rows, cols, j) lists of the
    entries it could not fix, left for the exact leave-one-out pass."""
    exact_rows, exact_cols, exact_j = [], [], []
    for j in (k - 1, k):
        if j == 0:
            continue
        pi, growth = keep[j]
        if not bool(growth.amax() * eps > tol):
            continue
        rows, cols = (growth * eps > tol).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        xi = x[rows, cols]  # [U]
        ls = lsig[rows]  # [U, K+1]
        approx = torch.ones_like(xi)
        bound = torch.ones_like(xi)
        for m in range(1, p + 1):
            bound = torch.exp((ls[:, j + m] - ls[:, j] - m * xi).clamp(max=60.0))
            approx = approx - bound if m % 2 else approx + bound
        good = bound <= tol
        pi[rows[good], cols[good]] = approx[good]
        exact_rows.append(rows[~good]), exact_cols.append(cols[~good])
        exact_j.append(torch.full_like(rows[~good], j))
    return exact_rows, exact_cols, exact_j


def _exact_leave_one_out(x: torch.Tensor, lsig: torch.Tensor, keep: dict, k: int, exact_rows: list,
                         exact_cols: list, exact_j: list) -> None:
    """Write, in keep's π in place, the exact π_{j,i} = e_i·σ_{j−1}(e_minus_i)/σ_j of eq. (16) for
    the listed entries, from one batched log_esp over their rows with x_i removed."""
    rows, cols, js = torch.cat(exact_rows), torch.cat(exact_cols), torch.cat(exact_j)
    without = x[rows].scatter(1, cols[:, None], float(x[rows].amin()) - PAD_BITS * LN2)  # [V, C]
    loo = log_esp(without, k - 1)  # log σ_{0..k−1}(e_minus_i), [V, k]
    value = torch.exp(x[rows, cols] + loo.gather(1, (js - 1)[:, None]).squeeze(1)
                      - lsig[rows].gather(1, js[:, None]).squeeze(1))
    for j in (k - 1, k):
        sel = js == j
        keep[j][0][rows[sel], cols[sel]] = value[sel]


def _inclusion_probabilities(x: torch.Tensor, lsig: torch.Tensor, k: int, p: int):
    """π_{k−1,i}, π_{k,i} = ∂log σ_j/∂x_i [B, C] by the recursion of Algorithm 2,
    π_{j,i} = a_{j,i}·(1 − π_{j−1,i}), a_{j,i} = exp(x_i + log σ_{j−1} − log σ_j), with the
    numerically unstable entries replaced (Appendix B.2.2).

    Detection: the recursion multiplies the error of 1 − π_{j−1,i} by a_{j,i}, so the absolute
    error of π_{j,i} is about eps·g_{j,i}, g_j = a_j·g_{j−1} + 1. Entries with eps·g > tol
    (tol = eps^(2/3)) take the p-th order approximation when its error bound, the last term
    exp(log σ_{j+p} − log σ_j − p·x_i) (Proposition 6 with σ_{j+p}(e_minus_i) <= σ_{j+p}(e)),
    is below tol; the rare rest get the exact δ_{j,i} = σ_{j−1}(e_minus_i) of eq. (16) from one
    batched forward pass over their rows with x_i removed.
    """
    eps = torch.finfo(x.dtype).eps
    tol = eps ** (2.0 / 3.0)
    keep = _recursion_terms(x, lsig, k)
    exact_rows, exact_cols, exact_j = _approximate_unstable(x, lsig, keep, k, p, eps, tol)
    if exact_rows and sum(r.numel() for r in exact_rows):
        _exact_leave_one_out(x, lsig, keep, k, exact_rows, exact_cols, exact_j)
    pi_km1 = keep[k - 1][0] if k >= 2 else torch.zeros_like(x)
    return pi_km1, keep[k][0]


def smooth_topk_loss(logits: torch.Tensor, target: torch.Tensor, k: int = 5, tau: float = 1.0,
                     alpha: float = 1.0, order: int = 2) -> torch.Tensor:
    """Per-example L_{k,τ} [B] (custom backward)."""
    return _SmoothTopk.apply(logits, target, k, tau, alpha, order)


@register_loss("smooth_topk")
class SmoothTopkSVM(Loss):
    """Smooth top-k SVM L_{k,τ} (Berrada et al. 2018); mean over the batch.

    Not PoLS: like softmax CE it only compares logits within one example.
    `order` is p of the backward's p-th order approximation (Appendix B.2.2).
    """

    pols = False
    # initial bias None (Loss): only differences of logits enter the loss

    def __init__(self, num_classes: int, k: int = 5, tau: float = 1.0, alpha: float = 1.0, order: int = 2):
        super().__init__(num_classes)
        if not 1 <= k < num_classes:
            raise ValueError(f"smooth_topk needs 1 <= k < num_classes, got k={k}, num_classes={num_classes}")
        if tau <= 0:
            raise ValueError(f"tau must be > 0, got {tau}")
        if order < 0:
            raise ValueError(f"order must be >= 0, got {order}")
        self.k, self.tau, self.alpha, self.order = k, float(tau), float(alpha), order

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return smooth_topk_loss(logits, target, self.k, self.tau, self.alpha, self.order).mean()

    def extra_repr(self) -> str:
        return f"k={self.k}, tau={self.tau}, alpha={self.alpha}, order={self.order}"
