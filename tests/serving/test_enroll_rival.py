"""An enrolled class's threshold is chosen for the decision the server makes with its look-alikes
(serving/core/enrollment.py `Rival`): an input is the class's match only where its margin logit - t is
at least 0 and no look-alike's margin is larger (docs/api.md "Look-alikes"). Checked against that
decision simulated input by input (a brute force over every threshold where it can change), and over
HTTP against the stored look-alikes' margins computed offline, under each SLC_LOOKALIKES."""
from __future__ import annotations

import numpy as np
import pytest

from tests.serving.helpers import D, INPUT_DIM, make_settings, wait_ready
from tests.serving.test_enroll import imprint
from tests.serving.test_open_set import calibrated

TARGET = 0.99


def decided(z: np.ndarray, t: float, rivals: np.ndarray) -> np.ndarray:
    """[m] bool: the class's matches at threshold t, its logits z [m], its look-alikes' margins rivals [m, r]:
    a match unless a look-alike passes by more (a tie keeps it)."""
    own = z - t
    return (own >= 0) & ~(rivals > np.maximum(own, 0.0)[:, None]).any(axis=1)


def precision(z_pos, z_neg, r_pos, r_neg, t: float, weight: float) -> tuple[float, float]:
    """(weighted true matches, precision) of the decision at t on the examples and the negatives."""
    tp, fp = weight * decided(z_pos, t, r_pos).sum(), decided(z_neg, t, r_neg).sum()
    return tp, (tp / (tp + fp) if tp + fp else 1.0)


def assert_lowest(t_got, z_pos, z_neg, r_pos, r_neg, weight) -> None:
    """t_got reaches the target under the decision, and every lower threshold that matches more misses
    it: the most recall at the target. The decision changes only where t = z or t = z - a rival's margin;
    it is judged between those points (a point itself is a tie, which rounding may split), t_got just
    below itself (where the input that sets it is a match)."""
    at_got = t_got - 1e-9 * max(1.0, abs(t_got))
    tp, p = precision(z_pos, z_neg, r_pos, r_neg, at_got, weight)
    assert tp > 0 and p >= TARGET - 1e-12
    got = np.concatenate([decided(z_pos, at_got, r_pos), decided(z_neg, at_got, r_neg)])
    between = between_flips(z_pos, z_neg, r_pos, r_neg)
    for s in between[between < at_got]:
        at = np.concatenate([decided(z_pos, s, r_pos), decided(z_neg, s, r_neg)])
        if (at != got).any():
            assert precision(z_pos, z_neg, r_pos, r_neg, s, weight)[1] < TARGET, f"{s} < {t_got} reaches it too"


def reaches(z_pos, z_neg, r_pos, r_neg, weight) -> bool:
    """Whether some threshold reaches the target with a true match, under the decision."""
    return any(tp > 0 and p >= TARGET for tp, p in (precision(z_pos, z_neg, r_pos, r_neg, s, weight)
                                                    for s in between_flips(z_pos, z_neg, r_pos, r_neg)))


def between_flips(z_pos, z_neg, r_pos, r_neg) -> np.ndarray:
    """One threshold inside each interval where the decision is constant: it changes only at t = z or
    t = z - a look-alike's margin."""
    flips = np.unique(np.concatenate([z_pos, z_neg, (z_pos[:, None] - r_pos).ravel(), (z_neg[:, None] - r_neg).ravel()]))
    return np.concatenate([[flips[0] - 1.0], 0.5 * (flips[1:] + flips[:-1])])


@pytest.mark.parametrize("seed", range(6))
def test_the_negatives_threshold_holds_for_the_decision_with_look_alikes(seed):
    from serving.bundle.class_row import ClassRow
    from serving.core.enrollment import negatives_threshold

    rng = np.random.default_rng(seed)
    d, n, big_n, r = 6, 5, 400, 3
    u, v = np.linalg.qr(rng.standard_normal((d, 2)))[0].T  # two orthonormal directions
    w = 3.0 * u  # the class's row
    h_pos = 4.0 * u + 0.3 * rng.standard_normal((n, d))  # its examples
    h_neg = rng.standard_normal((big_n, d))
    h_neg[:60] = 3.0 * u + 1.5 * v + 0.6 * rng.standard_normal((60, d))  # the look-alikes' inputs, close to the class
    w_r = 0.5 * u + 2.0 * v + 0.2 * rng.standard_normal((r, d))  # look-alike rows, and their thresholds
    t_r = rng.uniform(1.5, 2.5, r)

    def rival(h):
        return np.maximum(h @ w_r.T - t_r, 0.0).max(axis=1)

    row = ClassRow(row=w.astype(np.float32), bias=0.0, threshold=0.0, platt_a=1.0, platt_b=0.0, examples=n, rule="x")
    weight = (big_n / D) / n
    w32 = row.row.astype(np.float64)
    z_pos, z_neg = h_pos @ w32, h_neg @ w32
    r_pos, r_neg = h_pos @ w_r.T - t_r, h_neg @ w_r.T - t_r
    t = negatives_threshold(row, h_pos, h_neg, D, TARGET, rival)
    t_alone = negatives_threshold(row, h_pos, h_neg, D, TARGET)
    assert t is not None
    assert_lowest(t, z_pos, z_neg, r_pos, r_neg, weight)
    if t_alone is not None:  # the rule without look-alikes: logit >= t alone, and stricter here
        assert_lowest(t_alone, z_pos, z_neg, np.zeros((n, 0)), np.zeros((big_n, 0)), weight)
        assert t_alone > t


def test_a_constant_rival_moves_the_fitted_threshold_by_itself():
    """The fitted rule's row does not depend on the look-alikes, and a rival of c on every input lowers
    its threshold by exactly c: a match needs a margin of c, so the class matches what it matched alone."""
    from serving.core.enrollment import HeadStats, NegativeStats, fitted

    rng = np.random.default_rng(0)
    d = 8
    centre = 2.0 * rng.standard_normal(d)
    h = centre + 0.3 * rng.standard_normal((5, d))
    h_neg = rng.standard_normal((300, d))
    stats = HeadStats(row_norm=2.0, bias=0.0, platt_a=1.0, platt_b=0.0, threshold=0.5, target_precision=TARGET)
    neg = NegativeStats(mean=h_neg.mean(axis=0), logit_mean=-3.0, logit_std=1.5)
    alone = fitted(h, stats, neg, h_neg, 30)
    for c in (0.25, 2.0):
        moved = fitted(h, stats, neg, h_neg, 30, rival=lambda x, c=c: np.full(len(x), c))
        np.testing.assert_array_equal(moved.row, alone.row)
        assert moved.bias == alone.bias
        assert moved.threshold == pytest.approx(alone.threshold - c, rel=1e-9, abs=1e-9)


@pytest.fixture(scope="module")
def neg_bundle(tmp_path_factory):
    """(path, bundle, claimer, examples): a bundle with calibration negatives and the examples of a new
    class; one trained class among the examples' closest (the claimer) gets the threshold just above its
    logits on the examples, so that it says no to them and yes to as many as it can of the negatives
    that score highest on the new class: those the new class matches only where it passes it by more."""
    import json

    from serving.bundle import load_bundle
    from serving.bundle.recalibration import write_recalibrated
    from serving.bundle.synthetic import build_synthetic_bundle
    from tests.serving.helpers import Offline

    where = tmp_path_factory.mktemp("rival")
    path = build_synthetic_bundle(classes=D, dim=16, input_dim=INPUT_DIM, seed=0, out=where / "neg", negatives=400)
    offline = Offline(load_bundle(path))
    pool = np.random.default_rng(11).standard_normal((4000, INPUT_DIM)).astype(np.float32)
    z = offline.logits(pool)  # [P, D]
    claimer = int(np.bincount(z.argmax(axis=1), minlength=D).argmax())
    mine = np.flatnonzero(z.argmax(axis=1) == claimer)
    mine = mine[np.argsort(z[mine, claimer])]  # the claimer's inputs, weakest first
    x = pool[mine[len(mine) // 3:len(mine) // 3 + 6]]  # middling ones: its stronger inputs score above them
    above = np.nextafter(np.float32(z[mine[len(mine) // 3:len(mine) // 3 + 6], claimer].max()), np.float32(np.inf))
    cal = json.loads((path / "calibration.json").read_text())
    cal["per_class"][claimer]["threshold"] = float(above)
    path = write_recalibrated(path, cal, where / "claiming", {"data": "test"})
    return path, load_bundle(path), claimer, x


@pytest.mark.parametrize("mode", ["exclusive", "trained", "off"])
def test_the_served_threshold_is_chosen_against_the_stored_look_alikes(neg_bundle, tmp_path, mode):
    """Over HTTP (SLC_ENROLL_THRESHOLD=negatives): the second class's threshold (made by a PUT and an add
    of examples) is the lowest that
    reaches the target on the negatives under the decision with the look-alikes the server decides it
    against: all of its stored ones (exclusive), the trained ones (trained), none (off); their margins
    offline at the served thresholds, the first class's row by the documented imprint."""
    from fastapi.testclient import TestClient

    from serving.http.app import create_app
    from tests.serving.helpers import Offline

    path, bundle, claimer, x = neg_bundle
    offline = Offline(bundle)
    thr = calibrated(bundle)
    y = x + 0.01 * np.random.default_rng(4).standard_normal(x.shape).astype(np.float32)
    settings = make_settings(path, tmp_path, enroll_threshold="negatives", enroll_rule="imprint", lookalikes=mode)
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        first = client.put("/v1/classes/first", json={"inputs": x.tolist()}).json()
        client.put("/v1/classes/second", json={"inputs": y[:3].tolist()})
        got = client.post("/v1/classes/second/examples", json={"inputs": y[3:].tolist()}).json()  # the add path
        asked = client.app.state.slc.engine.classes.rival(got["lookalikes"])  # what a third class would face
        probe = np.random.default_rng(7).standard_normal((50, offline.W.shape[1]))
        asked = asked(probe)
    assert {first["class_id"], claimer} <= set(got["lookalikes"])  # stored under every mode
    rows = {first["class_id"]: (*imprint(offline, x), first["threshold"])}
    rows.update({j: (offline.W[j].astype(np.float64), float(offline.b[j]), thr[j]) for j in range(D)})
    used = [] if mode == "off" else [j for j in got["lookalikes"] if mode == "exclusive" or j < D]
    h_pos = offline.embed(y).astype(np.float64)
    h_neg = np.load(path / "calibration_embeddings.npy").astype(np.float64)

    def margins(h):  # [m, r] the look-alikes' logit - threshold
        return np.stack([h @ rows[j][0] + rows[j][1] - rows[j][2] for j in used], axis=1) if used else \
            np.zeros((len(h), 0))

    np.testing.assert_allclose(asked, np.maximum(margins(probe), 0.0).max(axis=1, initial=0.0), rtol=1e-6, atol=1e-6)
    row, b = imprint(offline, y)
    z_pos, z_neg = h_pos @ row.astype(np.float32).astype(np.float64) + b, h_neg @ row.astype(np.float32) + b
    weight = (len(h_neg) / D) / len(y)
    if got["rule"] == "imprint+negatives":
        assert_lowest(got["threshold"], z_pos, z_neg, margins(h_pos), margins(h_neg), weight)
    else:  # no threshold reaches the target under the decision: the bundle's global one is kept
        assert got["rule"] == "imprint+global" and not reaches(z_pos, z_neg, margins(h_pos), margins(h_neg), weight)
    if mode != "off":  # here the look-alikes make the target reachable: without them no threshold reaches it
        assert got["rule"] == "imprint+negatives"
        assert not reaches(z_pos, z_neg, np.zeros((len(h_pos), 0)), np.zeros((len(h_neg), 0)), weight)
