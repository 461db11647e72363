"""Every registered loss against DESIGN.md §4: value vs a plain float64 reference, gradcheck,
float32 stability at logit magnitude 1e3, nce sampling, ce_el schedule, and the PoLS property.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from trainer.losses import build_loss, list_losses

torch.set_num_threads(1)

NUM_CLASSES = 5
# Small parameters where a loss needs them for C = 5 (smooth_topk's default k=5 would be trivial).
PARAMS = {
    "smooth_topk": {"k": 2, "tau": 1.0, "alpha": 1.0},
    "nce": {"t": 3, "q": [0.1, 0.3, 0.2, 0.25, 0.15]},
    "self_norm": {"alpha": 0.5},
    "max_margin": {"gamma": 1.5},
    "batch_max_margin": {"gamma": 1.5},
    "lgl_inr": {"beta": 2.0},
    "spherical_softmax": {"eps": 1e-3},
}
ALL = list_losses()


def make(name: str, num_classes: int = NUM_CLASSES, **overrides) -> torch.nn.Module:
    params = {**PARAMS.get(name, {}), **overrides}
    if num_classes != NUM_CLASSES:
        params.pop("q", None)  # the test prior has NUM_CLASSES entries; use the uniform default
    return build_loss(name, num_classes, **params)


# ---------------------------------------------------------------- float64 references, plain loops
def _softmax_row(row):
    e = [math.exp(v) for v in row]
    return [v / sum(e) for v in e]


def _sigmoid(v):
    return 1.0 / (1.0 + math.exp(-v))


def ref_ce(z, y, p):
    return np.mean([-math.log(_softmax_row(z[i])[y[i]]) for i in range(len(y))])


def ref_max_margin(z, y, p):
    out = []
    for i in range(len(y)):
        false = max(z[i][j] for j in range(len(z[i])) if j != y[i])
        out.append(max(0.0, p.get("gamma", 1.0) - z[i][y[i]] + false))
    return np.mean(out)


def ref_taylor_softmax(z, y, p):
    f = lambda v: 1 + v + v * v / 2  # noqa: E731
    return np.mean([-math.log(f(z[i][y[i]]) / sum(f(v) for v in z[i])) for i in range(len(y))])


def ref_spherical_softmax(z, y, p):
    eps = p.get("eps", 1e-6)
    return np.mean([-math.log((z[i][y[i]] ** 2 + eps) / sum(v * v + eps for v in z[i])) for i in range(len(y))])


def ref_ce_el(z, y, p, focus=0.0):
    a, b = (0.0, 1.0) if focus == 0.5 else (1.0, 1.0 / (1.0 - 2.0 * focus))
    out = []
    for i in range(len(y)):
        py = _softmax_row(z[i])[y[i]]
        out.append(a * -math.log(py) + b * (1 - py))
    return np.mean(out)


def ref_self_norm(z, y, p):
    alpha = p.get("alpha", 0.1)
    return np.mean([-math.log(_softmax_row(z[i])[y[i]]) + alpha * math.log(sum(math.exp(v) for v in z[i])) ** 2
                    for i in range(len(y))])


def ref_nce(z, y, p):
    t, C = p["t"], len(z[0])
    q = p.get("q") or [1.0 / C] * C
    q = [v / sum(q) for v in q]
    g = lambda v, j: 1.0 / (1.0 + t * q[j] * math.exp(-v))  # noqa: E731  (Eq. 4 of the PoLS paper)
    return np.mean([-math.log(g(z[i][y[i]], y[i])) - t * sum(q[j] * math.log(1 - g(z[i][j], j)) for j in range(C))
                    for i in range(len(y))])


def ref_bce(z, y, p):
    out = []
    for i in range(len(y)):
        s = -math.log(_sigmoid(z[i][y[i]]))
        s -= sum(math.log(1 - _sigmoid(z[i][j])) for j in range(len(z[i])) if j != y[i])
        out.append(s)
    return np.mean(out)


def ref_batch_ce(z, y, p):
    """KL(P_B ‖ Q_B) straight from the definition (not the simplified formula)."""
    m, C = len(y), len(z[0])
    total = sum(math.exp(z[i][j]) for i in range(m) for j in range(C))
    kl = 0.0
    for i in range(m):
        for j in range(C):
            P = 1.0 / m if j == y[i] else 0.0
            if P > 0:
                kl += P * math.log(P / (math.exp(z[i][j]) / total))
    return kl


def ref_batch_max_margin(z, y, p):
    m, gamma = len(y), p.get("gamma", 1.0)
    z_plus = min(z[i][y[i]] for i in range(m))
    z_minus = max(z[i][j] for i in range(m) for j in range(len(z[i])) if j != y[i])
    return max(0.0, gamma - z_plus + z_minus) / m + ref_max_margin(z, y, p)


def ref_lgl_inr(z, y, p):
    beta, C = p.get("beta", 1.0), len(z[0])
    members = {k: [i for i in range(len(y)) if y[i] == k] for k in range(C)}
    present = [k for k in range(C) if members[k]]
    loss = sum(-np.mean([math.log(_sigmoid(z[i][k])) for i in members[k]]) for k in present)
    for j in range(C):  # target class (logit column)
        others = [k for k in present if k != j]
        if not others:
            continue
        hard = {k: beta * np.mean([_sigmoid(z[i][j]) for i in members[k]]) for k in others}
        norm = sum(math.exp(h) for h in hard.values())
        for k in others:
            lam = math.exp(hard[k]) / norm
            loss += lam * -np.mean([math.log(1 - _sigmoid(z[i][j])) for i in members[k]])
    return loss


def ref_smooth_topk(z, y, p):
    """Brute force over all k-subsets (itertools.combinations)."""
    k, tau, alpha = p.get("k", 5), p.get("tau", 1.0), p.get("alpha", 1.0)
    out = []
    for i in range(len(y)):
        subsets = list(itertools.combinations(range(len(z[i])), k))
        score = lambda Y: sum(z[i][j] for j in Y) / k  # noqa: E731
        first = sum(math.exp((alpha * (y[i] not in Y) + score(Y)) / tau) for Y in subsets)
        second = sum(math.exp(score(Y) / tau) for Y in subsets if y[i] in Y)
        out.append(tau * math.log(first) - tau * math.log(second))
    return np.mean(out)


REFERENCES = {name[4:]: fn for name, fn in list(globals().items()) if name.startswith("ref_")}


def reference(name, z, y):
    if name not in REFERENCES:
        pytest.fail(f"loss {name!r} has no float64 reference in this test; add one")
    return REFERENCES[name](z.tolist(), y.tolist(), PARAMS.get(name, {}))


def batch(seed=0, scale=3.0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(7, NUM_CLASSES, generator=gen, dtype=dtype)
    target = torch.tensor([0, 1, 1, 2, 0, 2, 4])  # class 3 absent on purpose
    return logits, target


# ---------------------------------------------------------------- registry and interface
def test_registry_has_every_design_loss():
    design = {"ce", "max_margin", "self_norm", "nce", "bce", "batch_ce", "batch_max_margin", "lgl_inr",
              "taylor_softmax", "spherical_softmax", "ce_el"}
    assert design <= set(ALL)


@pytest.mark.parametrize("name", ALL)
def test_interface(name):
    loss = make(name)
    assert isinstance(loss.pols, bool)
    value = loss(*batch())
    assert value.shape == ()


def test_pols_flags_match_design():
    expected = {"ce": False, "max_margin": False, "self_norm": True, "nce": True, "bce": True, "batch_ce": True,
                "batch_max_margin": True, "lgl_inr": True, "taylor_softmax": False, "spherical_softmax": False,
                "smooth_topk": False, "ce_el": False}
    for name in ALL:
        assert make(name).pols is expected[name], name


# ---------------------------------------------------------------- values
@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("seed,scale", [(0, 1.0), (1, 3.0), (2, 8.0)])
def test_value_matches_float64_reference(name, seed, scale):
    logits, target = batch(seed, scale)
    got = make(name)(logits, target).item()
    assert got == pytest.approx(reference(name, logits, target), rel=1e-9, abs=1e-9)


def test_lgl_inr_single_class_batch_is_bce():
    """One present class k: every other column j has λ_kj = 1 and column k has no negatives."""
    logits, _ = batch(3)
    target = torch.full((7,), 2)
    got = make("lgl_inr")(logits, target).item()
    assert got == pytest.approx(reference("lgl_inr", logits, target), rel=1e-12)
    assert got == pytest.approx(ref_bce(logits.tolist(), target.tolist(), {}), rel=1e-12)


def test_lgl_inr_detached_weights_same_value_different_gradient():
    logits, target = batch(4)
    attached = logits.clone().requires_grad_(True)
    detached = logits.clone().requires_grad_(True)
    va = make("lgl_inr")(attached, target)
    vd = make("lgl_inr", detach_weights=True)(detached, target)
    assert va.item() == pytest.approx(vd.item(), rel=1e-12)
    va.backward()
    vd.backward()
    assert not torch.allclose(attached.grad, detached.grad)


# ---------------------------------------------------------------- gradients and numerics
@pytest.mark.parametrize("name", ALL)
def test_gradcheck_float64(name):
    logits, target = batch(5, 2.0)
    logits.requires_grad_(True)
    loss = make(name)
    assert torch.autograd.gradcheck(lambda z: loss(z, target), (logits,))


def test_gradcheck_nce_sampled_with_fixed_draws():
    logits, target = batch(6, 2.0)
    logits.requires_grad_(True)
    loss = make("nce", mode="sampled")

    def seeded(z):
        torch.manual_seed(0)  # same draws in every evaluation
        return loss(z, target)

    assert torch.autograd.gradcheck(seeded, (logits,))


def _extreme_batches():
    gen = torch.Generator().manual_seed(7)
    target = torch.tensor([0, 1, 1, 2, 0, 2, 4])
    yield 1e3 * torch.randn(7, NUM_CLASSES, generator=gen)
    yield 1e3 * (2 * torch.rand(7, NUM_CLASSES, generator=gen) - 1)
    yield torch.full((7, NUM_CLASSES), 1e3)
    yield torch.full((7, NUM_CLASSES), -1e3)
    signs = torch.where(torch.nn.functional.one_hot(target, NUM_CLASSES).bool(), -1.0, 1.0)
    yield 1e3 * signs  # every true logit -1e3, every false +1e3: the worst case
    yield -1e3 * signs  # perfectly separated at 1e3
    yield torch.zeros(7, NUM_CLASSES)


@pytest.mark.parametrize("name", ALL)
def test_float32_finite_at_magnitude_1e3(name):
    target = torch.tensor([0, 1, 1, 2, 0, 2, 4])
    loss = make(name)
    for logits in _extreme_batches():
        z32 = logits.float().requires_grad_(True)
        value = loss(z32, target)
        value.backward()
        assert torch.isfinite(value), (name, logits[0])
        assert torch.isfinite(z32.grad).all(), (name, logits[0])
        torch.manual_seed(0)
        v32 = make(name)(logits.float(), target).item()
        torch.manual_seed(0)
        v64 = make(name)(logits.double(), target).item()
        assert v32 == pytest.approx(v64, rel=1e-4, abs=1e-2), (name, logits[0])


@pytest.mark.parametrize("name", ALL)
def test_float64_finite_at_magnitude_1e3(name):
    target = torch.tensor([0, 1, 1, 2, 0, 2, 4])
    for logits in _extreme_batches():
        z64 = logits.double().requires_grad_(True)
        value = make(name)(z64, target)
        value.backward()
        assert torch.isfinite(value) and torch.isfinite(z64.grad).all(), name


# ---------------------------------------------------------------- nce sampling
def test_nce_sampled_expectation_equals_exact():
    logits, target = batch(8, 2.0)
    exact = make("nce")(logits, target).item()
    sampled_loss = make("nce", mode="sampled")
    repeats = 200  # 1400 examples × t=3 draws per call
    big_logits, big_target = logits.repeat(repeats, 1), target.repeat(repeats)
    torch.manual_seed(1)
    draws = np.array([sampled_loss(big_logits, big_target).item() for _ in range(40)])
    stderr = draws.std(ddof=1) / math.sqrt(len(draws))
    assert draws.std() > 0, "sampled mode must actually sample"
    assert abs(draws.mean() - exact) < 5 * stderr
    assert abs(draws.mean() - exact) < 0.02 * exact


def test_nce_sampled_uses_the_prior():
    """With q concentrated on class 0, the noise term only ever sees column 0."""
    q = [1.0 - 4e-12, 1e-12, 1e-12, 1e-12, 1e-12]
    logits, target = batch(9, 2.0)
    torch.manual_seed(0)
    got = build_loss("nce", NUM_CLASSES, t=4, q=q, mode="sampled")(logits, target).item()
    qn = [v / sum(q) for v in q]
    g = lambda v, j: 1.0 / (1.0 + 4 * qn[j] * math.exp(-v))  # noqa: E731
    z, y = logits.tolist(), target.tolist()
    want = np.mean([-math.log(g(z[i][y[i]], y[i])) - 4 * math.log(1 - g(z[i][0], 0)) for i in range(7)])
    assert got == pytest.approx(want, rel=1e-9)


# ---------------------------------------------------------------- ce_el schedule
@pytest.mark.parametrize("progress", [0.0, 0.1, 1 / 6 + 1e-9, 0.2, 0.34, 0.5, 0.67, 0.84, 0.99, 1.0])
def test_ce_el_default_schedule_phases(progress):
    schedule = [0, 0.1, 0.2, 0.3, 0.4, 0.5]
    focus = schedule[min(int(progress * 6), 5)]
    logits, target = batch(10)
    loss = make("ce_el")
    loss.set_progress(progress)
    assert loss(logits, target).item() == pytest.approx(
        ref_ce_el(logits.tolist(), target.tolist(), {}, focus), rel=1e-12)


def test_ce_el_starts_at_focus_zero_and_custom_schedule():
    logits, target = batch(11)
    z, y = logits.tolist(), target.tolist()
    assert make("ce_el")(logits, target).item() == pytest.approx(ref_ce_el(z, y, {}, 0.0), rel=1e-12)
    for schedule in ([0, 0.5], "0,0.5"):
        loss = make("ce_el", schedule=schedule)
        loss.set_progress(0.49)
        assert loss(logits, target).item() == pytest.approx(ref_ce_el(z, y, {}, 0.0), rel=1e-12)
        loss.set_progress(0.51)  # F = 0.5: pure expectation loss mean(1 − p_y)
        expected = np.mean([1 - _softmax_row(z[i])[y[i]] for i in range(len(y))])
        assert loss(logits, target).item() == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError):
        make("ce_el", schedule=[0.7])


# ---------------------------------------------------------------- PoLS property
def test_paper_counter_example_ce_and_max_margin_small_but_not_separated():
    logits = torch.tensor([[10.0, 0.0], [20.0, 30.0]], dtype=torch.float64)
    target = torch.tensor([0, 1])
    assert logits[1, 0] > logits[0, 0]  # false logit 20 (example 2) above true logit 10 (example 1)
    assert build_loss("ce", 2)(logits, target).item() < 1e-4
    assert build_loss("max_margin", 2)(logits, target).item() == 0.0
    # The PoLS losses are not small there: each is bounded below by a positive number on this
    # configuration family (scaled by any a > 0), unlike ce / max_margin.
    for name in [n for n in ALL if make(n).pols]:
        values = [make(name, 2)(a * logits, target).item() for a in (0.1, 1.0, 10.0, 100.0)]
        assert min(values) > 1e-3, (name, values)


def separated(logits, target):
    """Every true logit above every false logit of the batch (across examples and classes)."""
    is_true = torch.nn.functional.one_hot(target, logits.shape[1]).bool()
    return logits[is_true].min() > logits[~is_true].max()


POLS_TARGET = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])  # B = 8, C = 4
VIOLATOR, VICTIM, COLUMN = 0, 1, 1  # example 0 (class 0) holds false logit z[0,1] >= true z[1,1]


def minimise(name, constrained, steps=600, seed=0, lr=0.3):
    """Adam on free logits [8, 4]; `constrained` projects onto z[0,1] >= z[1,1] after each step."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(8, 4, generator=gen, dtype=torch.float64)
    logits[VIOLATOR, COLUMN] = logits[VICTIM, COLUMN] + 1.0  # start violating the PoLS
    logits.requires_grad_(True)
    loss = make(name, 4)
    optim = torch.optim.Adam([logits], lr=lr)
    torch.manual_seed(seed)
    for _ in range(steps):
        optim.zero_grad()
        value = loss(logits, POLS_TARGET)
        value.backward()
        optim.step()
        if constrained:
            with torch.no_grad():
                a, b = logits[VIOLATOR, COLUMN].item(), logits[VICTIM, COLUMN].item()
                if a < b:
                    logits[VIOLATOR, COLUMN] = logits[VICTIM, COLUMN] = (a + b) / 2
    with torch.no_grad():
        return loss(logits, POLS_TARGET).item(), logits.detach()


@pytest.mark.parametrize("name", ALL)
def test_pols_small_loss_implies_separation(name):
    """PoLS losses: gradient descent to (near) the loss's infimum separates all true from all false
    logits, and any configuration that keeps one violation stays a margin above that infimum.
    Non-PoLS losses reach their infimum while keeping the violation.

    "Small" is relative to the infimum (nce's is positive: its noise term includes j = y).
    """
    start = minimise(name, constrained=True, steps=0)[1]
    assert not separated(start, POLS_TARGET)
    best, logits = minimise(name, constrained=False)
    best_violating, violating_logits = minimise(name, constrained=True)
    assert not separated(violating_logits, POLS_TARGET)
    if make(name, 4).pols:
        assert separated(logits, POLS_TARGET), name
        assert best_violating - best > 2e-2, (name, best, best_violating)
    else:
        assert best_violating - best < 1e-3, (name, best, best_violating)


def test_invalid_parameters_are_rejected():
    with pytest.raises(ValueError):
        build_loss("nce", 3, q=[0.5, 0.5])  # wrong length
    with pytest.raises(ValueError):
        build_loss("nce", 2, q=[1.0, 0.0])  # log(t·q_j) needs q_j > 0
    with pytest.raises(ValueError):
        build_loss("nce", 2, mode="approximate")
    with pytest.raises(ValueError):
        build_loss("spherical_softmax", 2, eps=0.0)
    with pytest.raises(KeyError):
        build_loss("no_such_loss", 2)


def test_lgl_inr_many_absent_classes():
    """Work is over the present classes only; absent columns still count as negatives."""
    gen = torch.Generator().manual_seed(12)
    logits = 2 * torch.randn(6, 40, generator=gen, dtype=torch.float64)
    target = torch.tensor([3, 17, 17, 39, 3, 0])
    got = build_loss("lgl_inr", 40, beta=2.0)(logits, target).item()
    assert got == pytest.approx(ref_lgl_inr(logits.tolist(), target.tolist(), {"beta": 2.0}), rel=1e-10)


# ---------------------------------------------------------------- closed forms worked out by hand
# Independent of the float64 references above: configurations where DESIGN.md §4 reduces to a
# formula by hand. Each one separates a plausible misreading (named in the comment) from the spec.
def _closed_form_cases():
    C, m, t, c = 4, 3, 3, 0.7
    target = torch.tensor([0, 0, 2])  # classes 1 and 3 absent
    y = target.tolist()
    full = lambda v: torch.full((m, C), float(v), dtype=torch.float64)  # noqa: E731
    log_tq = math.log(t / C)
    # nce at z_j = log(t q_j): every g_j = 1/2. The noise sum runs over ALL j (incl. y): log 2 + t·log 2,
    # not log 2 + t·(1 − q_y)·log 2.
    yield "nce", {"t": t}, full(log_tq), target, math.log(2) * (1 + t)
    # batch_ce with equal logits: Q_B uniform over m·C cells, KL = log C for any m.
    yield "batch_ce", {}, full(c), target, math.log(C)
    # batch_max_margin: every per-example margin inactive, the batch term (1/m)(γ − z⁺ + z⁻) alone.
    z = torch.tensor([[5.0, -9, -9, -9], [20, -9, 12, -9], [-9, -9, 7, -9]], dtype=torch.float64)
    yield "batch_max_margin", {"gamma": 1.0}, z, target, (1.0 - 5.0 + 12.0) / m
    # lgl_inr with all logits 0 (σ = 1/2, λ uniform): P positive terms + one unit-weight negative
    # term per column j that has a present k ≠ j (here all C columns, P = 2): a sum, not a mean.
    present = len(set(y))
    yield "lgl_inr", {"beta": 1.7}, full(0.0), target, math.log(2) * (present + C)
    # self_norm at z ≡ −log C: normaliser 1, only −log p_y = log C remains.
    yield "self_norm", {"alpha": 0.9}, full(-math.log(C)), target, math.log(C)
    yield "self_norm", {"alpha": 0.9}, full(c), target, math.log(C) + 0.9 * (c + math.log(C)) ** 2
    yield "bce", {}, full(0.0), target, C * math.log(2)
    # spherical: ε on every term, z_y = 0 -> −log(ε / Σ_j (z_j² + ε)) = log((9 + 16 + 0 + 0 + 4ε)/ε).
    eps = 0.5
    z = torch.tensor([[0.0, 3, 4, 0]] * m, dtype=torch.float64)
    yield "spherical_softmax", {"eps": eps}, z, torch.tensor([0, 0, 3]), math.log((25 + C * eps) / eps)
    # taylor at z_y = −1 (f = 1/2), others 0 (f = 1): −log(0.5 / (0.5 + C − 1)).
    z = torch.zeros(m, C, dtype=torch.float64)
    z[torch.arange(m), target] = -1.0
    yield "taylor_softmax", {}, z, target, -math.log(0.5 / (C - 0.5))
    # smooth_topk, only the true logit a ≠ 0: subsets with y score a/k, C(C−1,k)/C(C−1,k−1) = (C−k)/k,
    # L = τ·log(1 + (C−k)/k · exp((α − a/k)/τ)) — pins both α·[y∉Y] and the 1/k.
    for k, tau, alpha, a in [(1, 1.0, 1.0, 0.0), (2, 0.5, 1.5, 3.0), (3, 2.0, 0.7, -2.0)]:
        z = torch.zeros(m, C, dtype=torch.float64)
        z[torch.arange(m), target] = a
        want = tau * math.log(1 + (C - k) / k * math.exp((alpha - a / k) / tau))
        yield "smooth_topk", {"k": k, "tau": tau, "alpha": alpha}, z, target, want


@pytest.mark.parametrize("name,params,logits,target,want", list(_closed_form_cases()))
def test_closed_form_by_hand(name, params, logits, target, want):
    assert build_loss(name, logits.shape[1], **params)(logits, target).item() == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("progress,focus", [(0.0, 0.0), (0.34, 0.2), (0.6, 0.3), (1.0, 0.5)])
def test_ce_el_closed_form_by_hand(progress, focus):
    """Equal logits: p_y = 1/C, so a·log C + b·(1 − 1/C) with (a, b) of the phase's focus F."""
    C = 4
    loss = build_loss("ce_el", C)
    loss.set_progress(progress)
    a, b = (0.0, 1.0) if focus == 0.5 else (1.0, 1.0 / (1.0 - 2.0 * focus))
    got = loss(torch.zeros(3, C, dtype=torch.float64), torch.tensor([0, 1, 3])).item()
    assert got == pytest.approx(a * math.log(C) + b * (1 - 1 / C), rel=1e-12)


def test_nce_sampled_from_the_needed_columns_equals_the_full_logits():
    """Sampled nce from the logits of the targets' and the drawn classes only (what training
    computes) = sampled nce on all logits with the same draws: value and head gradient, float64."""
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(6, 3, generator=gen, dtype=torch.float64)
    weight = torch.randn(40, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([0, 5, 5, 39, 12, 7])
    q = torch.rand(40, generator=gen, dtype=torch.float64) + 0.1
    loss = build_loss("nce", 40, t=3, q=q.tolist(), mode="sampled")

    torch.manual_seed(9)
    full = loss(h @ weight.T, target)
    (g_full,) = torch.autograd.grad(full, weight)

    torch.manual_seed(9)
    draws = loss.draw_noise(6)  # [6, 3]
    cols = torch.unique(torch.cat([target, draws.flatten()]))
    assert len(cols) < 40  # fewer logits than the full head
    few = loss.on_columns(h @ weight[cols].T, cols, torch.searchsorted(cols, target), torch.searchsorted(cols, draws))
    (g_few,) = torch.autograd.grad(few, weight)
    torch.testing.assert_close(few, full, rtol=0, atol=1e-12)
    torch.testing.assert_close(g_few, g_full, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- initial head (trainer/losses/init.py)
# At the loss's initial bias, with a zero head (every logit = its bias), the loss's prediction is
# the class prior and the expected loss over the classes' frequencies is stationary in the bias:
# checked on the plain float64 references above, by central differences.
SHIFT_INVARIANT = ("ce", "ce_el", "batch_ce", "max_margin", "batch_max_margin", "smooth_topk")


def _expected_reference(name, bias, C, weights, params):
    """Σ_y weights[y] · reference loss of one example of class y at logits = bias (list of C)."""
    return sum(w * REFERENCES[name]([list(bias)], [y], params) for y, w in enumerate(weights))


def _stationary(name, bias, C, weights, params, h=1e-5):
    """Central-difference gradient of the expected reference loss w.r.t. each class's bias -> [C]."""
    grad = []
    for j in range(C):
        up, down = list(bias), list(bias)
        up[j] += h
        down[j] -= h
        grad.append((_expected_reference(name, up, C, weights, params)
                     - _expected_reference(name, down, C, weights, params)) / (2 * h))
    return np.array(grad)


@pytest.mark.parametrize("name", ALL)
def test_every_loss_declares_its_initial_head(name):
    loss = build_loss(name, 50)
    assert loss.initial_weight_scale == 0.0
    value = loss.initial_bias(50)
    assert value is None or isinstance(value, float) or (torch.is_tensor(value) and value.shape == (50,))
    if name in SHIFT_INVARIANT:
        assert value is None


@pytest.mark.parametrize("name", SHIFT_INVARIANT)
def test_shift_invariant_losses_need_no_bias(name):
    """Why their initial_bias is None: adding one constant to every logit changes nothing."""
    logits, target = batch(13, 2.0)
    loss = make(name)
    assert loss(logits + 4.2, target).item() == pytest.approx(loss(logits, target).item(), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("C", [5, 40])
def test_bce_initial_bias_predicts_the_prior_and_is_stationary(C):
    b = build_loss("bce", C).initial_bias(C)
    assert _sigmoid(b) == pytest.approx(1.0 / C, rel=1e-12)
    grad = _stationary("bce", [b] * C, C, [1.0 / C] * C, {})
    assert np.abs(grad).max() < 1e-6


@pytest.mark.parametrize("q", [None, [0.1, 0.3, 0.2, 0.25, 0.15]])
def test_nce_initial_bias_gives_the_posterior_one_over_one_plus_t(q):
    C, t = 5, 3
    loss = build_loss("nce", C, t=t, q=q)
    b = loss.initial_bias(C)
    bias = [float(b)] * C if isinstance(b, float) else torch.as_tensor(b, dtype=torch.float64).tolist()
    prior = [v / sum(q) for v in q] if q else [1.0 / C] * C
    for j in range(C):  # g_j = σ(z_j − log(t q_j)) = 1/(1 + t), the posterior of "data"
        assert _sigmoid(bias[j] - math.log(t * prior[j])) == pytest.approx(1.0 / (1 + t), rel=1e-6)
    grad = _stationary("nce", bias, C, prior, {"t": t, "q": q})
    assert np.abs(grad).max() < 1e-5


def test_nce_prior_of_another_size_is_refused():
    with pytest.raises(ValueError):
        build_loss("nce", 5, q=[0.1, 0.3, 0.2, 0.25, 0.15]).initial_bias(7)


@pytest.mark.parametrize("C", [5, 40])
def test_self_norm_initial_bias_normalises_and_is_stationary(C):
    b = build_loss("self_norm", C).initial_bias(C)
    assert math.log(C * math.exp(b)) == pytest.approx(0.0, abs=1e-12)  # logsumexp = 0: the penalty's minimum
    grad = _stationary("self_norm", [b] * C, C, [1.0 / C] * C, {"alpha": 0.5})
    assert np.abs(grad).max() < 1e-6


def test_lgl_inr_initial_bias_minimises_the_loss_at_equal_logits():
    """At equal logits b the loss is P·softplus(−b) + C·softplus(b) (P present classes): the reference
    is flat in b at log(P/C); the rule uses the expected P of a uniform batch, checked by sampling."""
    C, target = 9, [0, 0, 2, 5, 5, 5]  # P = 3 present
    P = len(set(target))
    b = math.log(P / C)
    value = lambda v: ref_lgl_inr([[v] * C] * len(target), target, {"beta": 1.3})  # noqa: E731
    assert (value(b + 1e-5) - value(b - 1e-5)) / 2e-5 == pytest.approx(0.0, abs=1e-6)
    assert value(b) < min(value(b - 0.3), value(b + 0.3))

    D, m = 300, 64
    draws = np.random.default_rng(0).integers(0, D, size=(4000, m))
    present = np.mean([len(np.unique(row)) for row in draws])
    got = build_loss("lgl_inr", D).initial_bias(D, batch_size=m)
    assert math.exp(got) * D == pytest.approx(present, rel=5e-3)
    assert build_loss("lgl_inr", D).initial_bias(D) is None  # no batch size: 0, not bce's −log(D − 1)


def test_sampled_head_bias_follows_the_columns_the_loss_sees():
    """Under --head-sample the loss sees K columns; its prior is 1/K whatever the full D."""
    D, K = 1000, 100
    assert build_loss("bce", K).initial_bias(D) == pytest.approx(-math.log(K - 1))
    assert build_loss("nce", K).initial_bias(D) == pytest.approx(-math.log(K))
    assert build_loss("self_norm", K).initial_bias(D) == pytest.approx(-math.log(K))


@pytest.mark.parametrize("name,saddle,start", [("spherical_softmax", 0.0, None), ("taylor_softmax", -1.0, None)])
def test_zero_head_saddle_and_the_chosen_start(name, saddle, start):
    """spherical (f = z² + ε) and taylor (f = 1 + z + z²/2) are symmetric about a point where every
    gradient of equal logits vanishes: a zero head must not start there. At the loss's initial bias
    (0 for taylor, 1 for spherical) the true logit is pushed up and every false one down."""
    C = 6
    target = torch.arange(C)
    loss = make(name, C)
    at_saddle = torch.full((C, C), saddle, dtype=torch.float64, requires_grad=True)
    loss(at_saddle, target).backward()
    assert at_saddle.grad.abs().max().item() < 1e-12
    b = loss.initial_bias(C)
    z = torch.full((C, C), 0.0 if b is None else b, dtype=torch.float64, requires_grad=True)
    loss(z, target).backward()
    is_true = torch.eye(C, dtype=torch.bool)
    assert (z.grad[is_true] < 0).all() and (z.grad[~is_true] > 0).all()


# ---------------------------------------------------------------- the hinge losses' smooth option
def ref_smooth_max_margin(z, y, tau, gamma):
    out = []
    for i in range(len(y)):
        lse = tau * math.log(sum(math.exp(z[i][j] / tau) for j in range(len(z[i])) if j != y[i]))
        out.append(max(0.0, gamma - z[i][y[i]] + lse))
    return out


def ref_smooth_batch_max_margin(z, y, tau, gamma):
    m = len(y)
    z_plus = -tau * math.log(sum(math.exp(-z[i][y[i]] / tau) for i in range(m)))
    z_minus = tau * math.log(sum(math.exp(z[i][j] / tau) for i in range(m) for j in range(len(z[i])) if j != y[i]))
    return max(0.0, gamma - z_plus + z_minus) / m + np.mean(ref_smooth_max_margin(z, y, tau, gamma))


@pytest.mark.parametrize("tau", [0.3, 1.0, 4.0])
def test_smooth_hinge_option_matches_float64_reference(tau):
    logits, target = batch(14, 2.0)
    z, y = logits.tolist(), target.tolist()
    got = make("max_margin", tau=tau)(logits, target).item()
    assert got == pytest.approx(np.mean(ref_smooth_max_margin(z, y, tau, 1.5)), rel=1e-10)
    got = make("batch_max_margin", tau=tau)(logits, target).item()
    assert got == pytest.approx(ref_smooth_batch_max_margin(z, y, tau, 1.5), rel=1e-10)


@pytest.mark.parametrize("name", ["max_margin", "batch_max_margin"])
def test_smooth_hinge_anneals_to_the_exact_hinge(name):
    logits, target = batch(15, 2.0)
    exact = make(name)(logits, target).item()
    loss = make(name, tau=2.0, anneal=0.5)
    assert loss(logits, target).item() > exact  # τ·logsumexp exceeds the max
    loss.set_progress(0.25)
    assert loss.current_tau == pytest.approx(1.0)
    loss.set_progress(0.5)
    assert loss(logits, target).item() == exact  # τ = 0 from then on: the hinge as defined, bit for bit
    with pytest.raises(ValueError):
        make(name, tau=-1.0)


@pytest.mark.parametrize("name", ["max_margin", "batch_max_margin"])
def test_smooth_hinge_sharded_form_equals_the_full_one(name):
    """The option's sharded form (one rank holding every class) gives the full loss and gradient."""
    from trainer.sharded_head import Shard

    logits, target = batch(16, 2.0)
    full_z, shard_z = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    loss = make(name, tau=0.7)
    full, sharded = loss(full_z, target), loss.sharded(shard_z, Shard.full(NUM_CLASSES, target))
    full.backward()
    sharded.backward()
    assert sharded.item() == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(shard_z.grad, full_z.grad, rtol=1e-10, atol=1e-12)
