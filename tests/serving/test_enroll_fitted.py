"""The fitted enrollment rule (issue 50): a class's row fitted to its examples against the bundle's
calibration negatives, with a cross-fitted threshold of its own (serving/core/enrollment.py `fitted`,
docs/api.md "Enroll a class"), checked against scikit-learn's LogisticRegression on the same data and a
brute-force precision count over the negatives; and the fallback to imprinting without negatives."""
from __future__ import annotations

import numpy as np
import pytest

from tests.serving.helpers import INPUT_DIM, D, make_settings, wait_ready

sklearn = pytest.importorskip("sklearn.linear_model")


def _sk_fit(x: np.ndarray, y: np.ndarray, c: float) -> tuple[np.ndarray, float]:
    """scikit-learn's balanced L2 logistic regression, solved tightly: (coef [d], intercept)."""
    lr = sklearn.LogisticRegression(C=c, class_weight="balanced", tol=1e-12, max_iter=100_000).fit(x, y)
    return lr.coef_[0].astype(np.float64), float(lr.intercept_[0])


@pytest.mark.parametrize("seed", [0, 1])
def test_logistic_fit_is_scikit_learns_objective(seed):
    from serving.core.enrollment import logistic_fit

    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.standard_normal((5, 8)) + 1.5, rng.standard_normal((60, 8))])
    y = np.r_[np.ones(5), np.zeros(60)]
    sw = np.where(y > 0, len(y) / (2 * 5), len(y) / (2 * 60))  # what class_weight="balanced" gives
    for c in (0.1, 1.0, 10.0):
        theta = logistic_fit(x, y, c, sw)
        coef, intercept = _sk_fit(x, y, c)
        np.testing.assert_allclose(theta[:-1], coef, rtol=1e-4, atol=1e-5)
        assert theta[-1] == pytest.approx(intercept, rel=1e-4, abs=1e-5)


def _cluster(rng, n: int, centre: np.ndarray) -> np.ndarray:
    return (centre + 0.15 * rng.standard_normal((n, INPUT_DIM))).astype(np.float32)


def test_a_class_of_five_examples_is_fitted_against_the_negatives_and_matches_its_held_out_images(tmp_path):
    """Over HTTP: the answer's rule is fitted+cv; detect's logits are scikit-learn's regression of the 5
    examples against every calibration negative (balanced, C = FIT_C, the embeddings over the negatives'
    RMS norm), mapped so its logits on the negatives have the trained classes' median mean and spread;
    the threshold is the documented cross-fit, redone with scikit-learn, and by brute force it lets no
    more negatives through than the target precision allows; held-out inputs of the class match."""
    from fastapi.testclient import TestClient

    from serving.bundle import load_bundle
    from serving.bundle.synthetic import build_synthetic_bundle
    from serving.core.enrollment import FIT_C
    from serving.main import build
    from tests.serving.helpers import Offline

    path = build_synthetic_bundle(classes=D, dim=16, input_dim=INPUT_DIM, seed=0, out=tmp_path / "neg", negatives=400)
    b = load_bundle(path)
    offline = Offline(b)
    h_neg = np.load(path / "calibration_embeddings.npy").astype(np.float64)
    y_neg = np.load(path / "calibration_labels.npy")
    rng = np.random.default_rng(3)
    centre = 2.0 * rng.standard_normal(INPUT_DIM)
    x, held_out = _cluster(rng, 5, centre), _cluster(rng, 40, centre)
    probe = rng.standard_normal((30, INPUT_DIM)).astype(np.float32)  # other inputs (the negatives' kind)
    with TestClient(build(make_settings(path, tmp_path, enroll_rule="fitted"))[0]) as client:
        wait_ready(client.get)
        assert client.get("/v1/model").json()["classes"]["enroll_rule"] == "fitted"
        got = client.put("/v1/classes/new", json={"inputs": x.tolist()})
        assert got.status_code == 201, got.text
        got = got.json()
        both = np.concatenate([held_out, probe])
        res = client.post("/v1/classes/new/detect", json={"inputs": both.tolist()}).json()["results"]
    assert got["rule"] == "fitted+cv" and got["examples"] == 5
    z = np.array([r["logit"] for r in res])

    # the direction and scale, independently
    h = offline.embed(x).astype(np.float64)
    scale = np.sqrt(np.mean(np.sum(h_neg ** 2, axis=1)))
    coef, intercept = _sk_fit(np.concatenate([h, h_neg]) / scale, np.r_[np.ones(5), np.zeros(len(h_neg))], FIT_C)

    def score(e: np.ndarray) -> np.ndarray:
        return e / scale @ coef + intercept

    w, bias = np.asarray(b.weight, np.float64), np.asarray(b.bias, np.float64)
    z_all = h_neg @ w.T + bias  # [N, D]
    mean = np.median([z_all[y_neg != j, j].mean() for j in range(D)])
    std = np.median([z_all[y_neg != j, j].std() for j in range(D)])
    p = score(h_neg)
    a = std / p.std()
    want = a * (score(offline.embed(both).astype(np.float64)) - p.mean()) + mean
    np.testing.assert_allclose(z, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())

    # the threshold: each fold's examples and negatives scored by the regression of the other folds
    order = np.random.default_rng(0)  # the documented folds: the sample's draw, then the negatives' folds
    order.permutation(len(h_neg))
    neg_fold = order.permutation(len(h_neg)) % 5
    z_pos, z_neg = np.empty(5), np.empty(len(h_neg))
    for k in range(5):
        keep_p, keep_n = np.arange(5) != k, neg_fold != k
        c_k, i_k = _sk_fit(np.concatenate([h[keep_p], h_neg[keep_n]]) / scale,
                           np.r_[np.ones(4), np.zeros(keep_n.sum())], FIT_C)
        z_pos[k] = h[k] / scale @ c_k + i_k
        z_neg[~keep_n] = h_neg[~keep_n] / scale @ c_k + i_k
    weight = max(len(h_neg) / D, 1.0) / 5  # the examples as an average class's share of the negatives
    target = float(b.calibration.get("target", {}).get("precision", 0.99))
    values = np.unique(np.concatenate([z_pos, z_neg]))
    ok = [i for i, t in enumerate(values) if (z_pos >= t).any()
          and weight * (z_pos >= t).sum() / (weight * (z_pos >= t).sum() + (z_neg >= t).sum()) >= target]
    assert ok, "the cross-fit reaches the target on these examples"
    t_score = values[ok[0]] if ok[0] == 0 else 0.5 * (values[ok[0]] + values[ok[0] - 1])
    t_want = a * (t_score - p.mean()) + mean  # mapped as the logits are
    assert got["threshold"] == pytest.approx(t_want, rel=1e-3, abs=1e-3)

    # brute force: on the negatives, the served threshold keeps the examples' (cross-fitted) precision
    fp = int((z_neg >= t_score).sum())
    tp = weight * int((z_pos >= t_score).sum())
    assert tp / (tp + fp) >= target
    matched = z >= got["threshold"]
    assert matched[:40].mean() >= 0.8  # the class's held-out inputs
    assert matched[40:].mean() <= 0.1  # other inputs


def test_without_calibration_negatives_enrollment_imprints(tmp_path):
    """A bundle without calibration_embeddings.npy: `auto` is imprint with the global threshold, and
    SLC_ENROLL_RULE=fitted is refused (422 no_negatives); on a bundle with negatives `auto` is standardised
    (fitted is asked for by name), and fitted refuses one example (nothing left to judge its threshold on)."""
    from fastapi.testclient import TestClient

    from serving.bundle.synthetic import build_synthetic_bundle
    from serving.main import build

    x = np.random.default_rng(1).standard_normal((5, INPUT_DIM)).astype(np.float32)
    bare = build_synthetic_bundle(classes=D, dim=16, input_dim=INPUT_DIM, seed=0, out=tmp_path / "bare")
    with TestClient(build(make_settings(bare, tmp_path / "a"))[0]) as client:
        wait_ready(client.get)
        assert client.get("/v1/model").json()["classes"]["enroll_rule"] == "imprint"
        assert client.put("/v1/classes/k", json={"inputs": x.tolist()}).json()["rule"] == "imprint+global"
    with TestClient(build(make_settings(bare, tmp_path / "b", enroll_rule="fitted"))[0]) as client:
        wait_ready(client.get)
        r = client.put("/v1/classes/k", json={"inputs": x.tolist()})
        assert r.status_code == 422 and r.json()["error"]["code"] == "no_negatives"
    neg = build_synthetic_bundle(classes=D, dim=16, input_dim=INPUT_DIM, seed=0, out=tmp_path / "neg", negatives=200)
    with TestClient(build(make_settings(neg, tmp_path / "c"))[0]) as client:
        wait_ready(client.get)
        assert client.put("/v1/classes/one", json={"inputs": x[:1].tolist()}).json()["rule"].startswith("standardised+")
        assert client.put("/v1/classes/two", json={"inputs": x[:2].tolist()}).json()["rule"].startswith("standardised+")
    with TestClient(build(make_settings(neg, tmp_path / "d", enroll_rule="fitted"))[0]) as client:
        wait_ready(client.get)
        r = client.put("/v1/classes/one", json={"inputs": x[:1].tolist()})
        assert r.status_code == 422 and r.json()["error"]["code"] == "too_few_examples"
