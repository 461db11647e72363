"""Platt scaling: probability = sigmoid(a * logit + b), (a, b) per class fitted by Newton's method on
the class's column against y == j, with a tiny ridge so that separable classes (common with PoLS
losses) still give finite (a, b). numpy only."""
from __future__ import annotations

import numpy as np

PLATT_RIDGE = 1e-3  # on the standardised slope; a tiny prior, only matters when separable


def _platt_objective(z: np.ndarray, t: np.ndarray, a: np.ndarray, b: np.ndarray, lam_a: float,
                     lam_b: float) -> np.ndarray:
    """Negative penalised log-likelihood per column: what each Newton step must decrease."""
    u = a * z + b
    # -[t log σ(u) + (1-t) log(1-σ(u))] = softplus(u) - t u
    return (np.logaddexp(0.0, u) - t * u).sum(axis=0) + 0.5 * (lam_a * a * a + lam_b * b * b)


def _platt_newton_step(z: np.ndarray, t: np.ndarray, a_act: np.ndarray, b_act: np.ndarray, lam_a: float,
                       lam_b: float) -> tuple[np.ndarray, np.ndarray]:
    """(step_a, step_b) [A]: the full Newton step of each active column, by the closed-form 2x2
    solve (no per-column linear algebra call)."""
    u = a_act * z + b_act
    p = 0.5 * (1.0 + np.tanh(0.5 * u))  # stable sigmoid
    r = p - t  # [N, A]
    g_a = (r * z).sum(axis=0) + lam_a * a_act
    g_b = r.sum(axis=0) + lam_b * b_act
    w = p * (1 - p)
    h_aa = (w * z * z).sum(axis=0) + lam_a
    h_ab = (w * z).sum(axis=0)
    h_bb = w.sum(axis=0) + lam_b
    det = np.maximum(h_aa * h_bb - h_ab * h_ab, 1e-300)
    step_a = (h_bb * g_a - h_ab * g_b) / det
    step_b = (h_aa * g_b - h_ab * g_a) / det
    return step_a, step_b


def _platt_line_search(z: np.ndarray, t: np.ndarray, a_act: np.ndarray, b_act: np.ndarray, f_act: np.ndarray,
                       step_a: np.ndarray, step_b: np.ndarray, lam_a: float, lam_b: float):
    """(new_a, new_b, new_f) [A]: the Newton step, halved (up to 30 times) only in the columns
    where it did not decrease the objective, so every column's objective is monotone."""
    new_a, new_b = a_act - step_a, b_act - step_b
    new_f = _platt_objective(z, t, new_a, new_b, lam_a, lam_b)
    scale = np.ones(a_act.size)
    for _ in range(30):  # halve the step only where the objective did not decrease
        worse = np.flatnonzero(~(new_f <= f_act))
        if worse.size == 0:
            break
        scale[worse] *= 0.5
        new_a[worse] = a_act[worse] - scale[worse] * step_a[worse]
        new_b[worse] = b_act[worse] - scale[worse] * step_b[worse]
        new_f[worse] = _platt_objective(z[:, worse], t[:, worse], new_a[worse], new_b[worse], lam_a, lam_b)
    return new_a, new_b, new_f


def _platt_newton(z_all: np.ndarray, t_fit: np.ndarray, a: np.ndarray, b: np.ndarray, lam_a: float,
                  lam_b: float, iters: int) -> None:
    """Newton iterations on all columns at once, updating a and b [F] in place; a column leaves
    the active set once a step no longer improves it (or improves it by < 1e-10 relative)."""
    active = np.arange(a.size)
    f = _platt_objective(z_all, t_fit, a, b, lam_a, lam_b)
    for _ in range(iters):
        z, t = z_all[:, active], t_fit[:, active]
        a_act, b_act, f_act = a[active], b[active], f[active]
        step_a, step_b = _platt_newton_step(z, t, a_act, b_act, lam_a, lam_b)
        new_a, new_b, new_f = _platt_line_search(z, t, a_act, b_act, f_act, step_a, step_b, lam_a, lam_b)
        improved = new_f <= f_act
        a[active] = np.where(improved, new_a, a_act)
        b[active] = np.where(improved, new_b, b_act)
        f[active] = np.where(improved, new_f, f_act)
        done = ~improved | (f_act - new_f <= 1e-10 * (1 + np.abs(f_act)))
        active = active[~done]
        if active.size == 0:
            break


def fit_platt(scores: np.ndarray, positive: np.ndarray, ridge: float = PLATT_RIDGE, iters: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """Per column: (a, b) maximising sum log-likelihood of sigmoid(a * s + b) for `positive`.

    Newton on standardised scores (so the ridge and the start do not depend on the logit
    scale), all columns at once with closed-form 2x2 solves and step halving; converged
    columns leave the active set. The ridge penalises 0.5 * ridge * (a'^2 + 1e-3 * b'^2) on
    the standardised parameters. A column with no positive (or no negative) has no slope to
    fit: a = 0 and b = the smoothed log-odds of its base rate.
    """
    s = np.asarray(scores, dtype=np.float64)
    t_all = np.asarray(positive, dtype=np.float64)
    n, c = s.shape
    n_pos = t_all.sum(axis=0)
    a_out = np.zeros(c)
    b_out = np.log((n_pos + 0.5) / (n - n_pos + 0.5))  # the answer for degenerate columns
    fit = np.flatnonzero((n_pos > 0) & (n_pos < n))
    if fit.size == 0:
        return a_out, b_out
    mu = s[:, fit].mean(axis=0)
    sd = s[:, fit].std(axis=0)
    sd = np.where(sd > 0, sd, 1.0)
    z_all = (s[:, fit] - mu) / sd  # [N, F]
    t_fit = t_all[:, fit]
    a = np.zeros(fit.size)
    b = b_out[fit].copy()  # start at the base rate
    _platt_newton(z_all, t_fit, a, b, ridge, ridge * 1e-3, iters)
    # back to raw logits: a' (s - mu) / sd + b'
    a_out[fit] = a / sd
    b_out[fit] = b - a * mu / sd
    return a_out, b_out
