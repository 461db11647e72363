"""A bundle's look-alike pairs (calibration.json `lookalikes`, serving/core/lookalikes.py) through
`slc bundle fold` (each folded class with its look-alikes, a source bundle's pairs kept), the
checks of a loading bundle (malformed pairs refused in one line), `slc calibrate` (the pairs kept) and
its measured figures (serving/calibration/measure.py: the server's exclusion, checked against the rule
written out per image and class on the full logit matrix)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from serving.calibration import measure as measure_mod

D = 12  # classes of the source bundle
IMAGE = {"height": 8, "width": 8, "channels": 1, "layout": "flat", "scale": 16.0 / 255.0, "background": "dark",
         "resample": "lanczos"}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A 12-class synthetic bundle (d = 8) that takes 8x8 images."""
    from serving.bundle.synthetic import build_synthetic_bundle

    return build_synthetic_bundle(classes=D, dim=8, input_dim=64, seed=1,
                                  out=tmp_path_factory.mktemp("lookalikes") / "bundle", image=IMAGE)


def cal_of(bundle: Path) -> dict:
    return json.loads((bundle / "calibration.json").read_text())


def row(seed: int, slot: int, name: str, lookalikes: tuple[int, ...]):
    from serving.bundle.class_row import ClassRow

    w = np.random.default_rng(seed).standard_normal(8).astype(np.float32)
    return ClassRow(row=w, bias=0.5, threshold=1.5, platt_a=1.0, platt_b=-1.0, examples=3, rule="imprint+global",
                    name=name, slot=slot, lookalikes=lookalikes)


def with_pairs(source: Path, out: Path, pairs) -> Path:
    """`source` with calibration.json's `lookalikes` set to `pairs` (and a precision target), verified."""
    from serving.bundle.recalibration import write_recalibrated

    cal = cal_of(source)
    cal["target"] = {"precision": 0.9}
    cal["lookalikes"] = {"pairs": pairs, "note": "test"}
    return write_recalibrated(source, cal, out, {"data": "test"})


# ------------------------------------------------------------------------------ fold
@pytest.fixture(scope="module")
def folded(source, tmp_path_factory) -> Path:
    """Three enrolled classes (slots 0, 2, 5: ids D, D + 1, D + 2 once folded) with their look-alikes: fc
    names fa and fb (enrolled ids D + slot, carried to their folded ids) and itself (no pair); fb names
    slot 7, a class not folded, so that one is not carried."""
    from serving.bundle.fold import fold_bundle

    rows = [row(1, 0, "fa", (3, 1)), row(2, 2, "fb", (5, D + 7)), row(3, 5, "fc", (D + 0, D + 2, D + 5))]
    return fold_bundle(source, rows, tmp_path_factory.mktemp("fold") / "once")


def test_fold_writes_each_folded_class_with_its_lookalikes(folded):
    lk = cal_of(folded)["lookalikes"]
    assert lk["pairs"] == [[1, D], [3, D], [5, D + 1], [D, D + 2], [D + 1, D + 2]]
    assert "passes its threshold by more" in lk["note"]


def test_the_folded_bundle_loads_and_decides_with_the_pairs(folded):
    from serving.bundle import load_bundle
    from serving.bundle.verify import verify_bundle
    from serving.core.calibration import Thresholds

    assert verify_bundle(folded) == []
    bundle = load_bundle(folded)
    assert bundle.calibration["lookalikes"]["pairs"] == [[1, D], [3, D], [5, D + 1], [D, D + 2], [D + 1, D + 2]]
    pairs = Thresholds.of_bundle(bundle).lookalikes
    want = {D: [1, 3, D + 2], D + 1: [5, D + 2], D + 2: [D, D + 1], 1: [D], 3: [D], 5: [D + 1], 0: [], D - 1: []}
    for j, of in want.items():
        assert pairs.of(j).tolist() == of, j


def test_folding_a_folded_bundle_merges_its_pairs(folded, tmp_path):
    from serving.bundle.fold import fold_bundle

    D1 = D + 3  # the folded bundle's classes: fa, fb, fc are trained ones now
    out = fold_bundle(folded, [row(4, 0, "fd", (D, 0, 3)), row(5, 1, "fe", (1,))], tmp_path / "twice")
    want = sorted({(1, D), (3, D), (5, D + 1), (D, D + 2), (D + 1, D + 2), (D, D1), (0, D1), (3, D1), (1, D1 + 1)})
    assert cal_of(out)["lookalikes"]["pairs"] == [list(p) for p in want]


def test_a_fold_without_lookalikes_writes_no_key(source, tmp_path):
    from serving.bundle.fold import fold_bundle

    out = fold_bundle(source, [row(1, 0, "fa", ()), row(2, 1, "fb", (D + 3,))], tmp_path / "none")
    assert "lookalikes" not in cal_of(out)


# ------------------------------------------------------------------------------ malformed pairs
@pytest.mark.parametrize("value, message", [
    ({"pairs": [[0, 1], [4, 4]]}, "lookalikes pair 1 [4, 4]: a class is not its own look-alike"),
    ({"pairs": [[0, D]]}, f"lookalikes pair 0 [0, {D}]: class ids must be 0..{D - 1}"),
    ({"pairs": [[2, 3], [-1, 3]]}, f"lookalikes pair 1 [-1, 3]: class ids must be 0..{D - 1}"),
    ({"pairs": [[0, 1, 2]]}, "lookalikes pair 0 is [0, 1, 2], not two class ids [a, b]"),
    ({"pairs": [[0, 1.0]]}, "lookalikes pair 0 is [0, 1.0], not two class ids [a, b]"),
    ({"pairs": [[True, 1]]}, "lookalikes pair 0 is [True, 1], not two class ids [a, b]"),
    ({"pairs": ["0,1"]}, "lookalikes pair 0 is '0,1', not two class ids [a, b]"),
    ({"pairs": "0,1"}, "'lookalikes' must be {'pairs': [[a, b], ...]} (class ids), got str"),
    ({"pair": [[0, 1]]}, "'lookalikes' must be {'pairs': [[a, b], ...]} (class ids), got NoneType"),
    ([[0, 1]], "'lookalikes' must be {'pairs': [[a, b], ...]} (class ids), got list"),
    (None, "'lookalikes' must be {'pairs': [[a, b], ...]} (class ids), got NoneType"),
])
def test_malformed_pairs_are_refused_in_one_line(source, value, message):
    from serving.bundle.calibration import parse_calibration

    cal = cal_of(source)
    cal["lookalikes"] = value
    parsed, _, problems = parse_calibration(json.dumps(cal).encode(), D)
    assert parsed is None and problems == [f"calibration.json: {message}"]


def test_a_bundle_with_malformed_pairs_does_not_verify_and_good_ones_do(source, tmp_path):
    from serving.bundle.recalibration import RecalibrationError

    with pytest.raises(RecalibrationError, match=r"calibration.json: lookalikes pair 0 \[7, 7\]: a class is not its"):
        with_pairs(source, tmp_path / "bad", [[7, 7]])
    assert not (tmp_path / "bad").exists()
    good = with_pairs(source, tmp_path / "good", [[0, 1], [1, 2]])
    from serving.bundle import load_bundle
    from serving.core.calibration import Thresholds

    assert Thresholds.of_bundle(load_bundle(good)).lookalikes.of(1).tolist() == [0, 2]


# ------------------------------------------------------------------------------ measuring
def brute_force(h, y, weight, bias, threshold, pairs) -> tuple[np.ndarray, np.ndarray]:
    """(true match, false matches) per image, the rule written out: class c matches image i when
    z_ic >= t_c and no look-alike r of c has z_ir - t_r > z_ic - t_c."""
    z = h.astype(np.float64) @ weight.astype(np.float64).T + bias.astype(np.float64)  # [N, D] in full
    t = threshold.astype(np.float64)
    of = {c: set() for c in range(len(t))}
    for a, b in pairs:
        of[a].add(b)
        of[b].add(a)
    tp, fp = np.zeros(len(y), np.int64), np.zeros(len(y), np.int64)
    for i in range(len(y)):
        for c in range(len(t)):
            if z[i, c] >= t[c] and not any(z[i, r] - t[r] > z[i, c] - t[c] for r in of[c]):
                if c == y[i]:
                    tp[i] += 1
                else:
                    fp[i] += 1
    return tp, fp


def random_head(seed: int, n: int = 200, classes: int = 30, d: int = 6, integers: bool = False):
    """Images near their class's row, thresholds low enough that most match several classes. `integers`:
    small integer rows, embeddings and thresholds, so every logit and margin is exact and ties are many."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((classes, d)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(classes)).astype(np.float32)
    y = rng.integers(0, classes, n)
    h = (weight[y] + 0.8 * rng.standard_normal((n, d))).astype(np.float32)
    if integers:
        weight, bias, h = np.round(2 * weight), np.zeros_like(bias), np.round(2 * h)
    z = h.astype(np.float64) @ weight.T.astype(np.float64) + bias
    threshold = np.quantile(z, 0.7, axis=0).astype(np.float32)
    if integers:
        threshold = np.round(threshold)
    pairs = [[0, 1], [0, 2], [3, 4], [5, 29], [6, 7], [7, 8], [10, 20], [11, 12], [11, 13], [12, 13]]
    return h, y, weight, bias, threshold, pairs


@pytest.mark.parametrize("chunk", [None, 4])  # one chunk; chunks of 4 classes, margins in blocks of images
@pytest.mark.parametrize("seed, integers", [(0, False), (1, False), (2, False), (3, True), (4, True)])
def test_measured_counts_are_the_servers_rule_with_lookalikes(seed, integers, chunk, monkeypatch):
    from serving.core.lookalikes import Lookalikes

    if chunk:
        monkeypatch.setattr(measure_mod, "chunk_classes", lambda n, num_classes: chunk)
        monkeypatch.setattr(measure_mod, "CHUNK_VALUES", 64)
    h, y, weight, bias, threshold, pairs = random_head(seed, integers=integers)
    if integers:  # a tie matches both: some matching image has equal margins on two look-alikes
        m = h.astype(np.float64) @ weight.T + bias - threshold
        assert any(((m[:, a] == m[:, b]) & (m[:, a] >= 0)).any() for a, b in pairs)
    threshold[9] = np.nan  # a class without a threshold never matches, nor outmatches
    pairs.append([9, 14])
    got = measure_mod.per_image_counts(h, y, weight, bias, threshold, Lookalikes(map(tuple, pairs)))
    want = brute_force(h, y, weight, bias, np.where(np.isnan(threshold), np.inf, threshold), pairs)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    plain = measure_mod.per_image_counts(h, y, weight, bias, threshold)
    assert plain[1].sum() > got[1].sum()  # the pairs take false matches away (so this test can fail)
    assert plain[0].sum() >= got[0].sum()

    pooled = measure_mod.measure(h, y, h[:50], y[:50], weight, bias, threshold, lookalikes=Lookalikes(pairs))
    t, f = want[0].sum(), want[1].sum()
    assert pooled["fit"]["matches"] == t + f and pooled["fit"]["true_matches"] == t
    assert pooled["fit"]["precision"] == pytest.approx(t / (t + f))
    assert pooled["fit"]["recall"] == pytest.approx(t / len(y))
    t50, f50 = want[0][:50].sum(), want[1][:50].sum()
    assert pooled["test"]["matches"] == t50 + f50 and pooled["test"]["true_matches"] == t50


# ------------------------------------------------------------------------------ slc calibrate
def test_slc_calibrate_keeps_the_pairs_and_measures_with_them(source, tmp_path, monkeypatch):
    from PIL import Image

    from serving.calibration import recalibrate
    from tests.serving.helpers import slc

    pairs = [[a, b] for a in range(6) for b in range(a + 1, 6)] + [[2, 9]]  # the classes with images, all pairs
    bundle = with_pairs(source, tmp_path / "paired", pairs)
    rng = np.random.default_rng(0)
    for c in range(6):
        (tmp_path / "data" / str(c)).mkdir(parents=True)
        for i in range(4):
            Image.fromarray((rng.random((8, 8)) * 255).astype(np.uint8)).save(tmp_path / "data" / str(c) / f"{i}.png")
    calls = []

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return measure_mod.measure(*args, **kwargs)

    monkeypatch.setattr(recalibrate, "measure", spy)
    out = tmp_path / "out"
    assert slc("calibrate", bundle, "--data", f"imagefolder:{tmp_path / 'data'}", "--out", out,
               "--threshold-method", "per_class") == 0
    cal = cal_of(out)
    assert cal["lookalikes"] == {"pairs": pairs, "note": "test"}  # unchanged, as the thresholds changed
    assert cal["split"] == "recalibration"
    assert [e["threshold"] for e in cal["per_class"]] != [e["threshold"] for e in cal_of(bundle)["per_class"]]

    # the written figures are the rule with the pairs, counted apart on the images' own embeddings
    (h, y, _, _, weight, bias, threshold), kwargs = calls[0]
    assert kwargs["lookalikes"].pairs() == sorted(pairs)
    tp, fp = brute_force(h, y, np.asarray(weight), np.asarray(bias), threshold, pairs)
    fit = cal["recalibration"]["pooled"]["fit"]
    assert (fit["true_matches"], fit["matches"]) == (tp.sum(), tp.sum() + fp.sum())
    tp0, fp0 = brute_force(h, y, np.asarray(weight), np.asarray(bias), threshold, [])
    assert (tp0.sum(), fp0.sum()) != (tp.sum(), fp.sum())  # the pairs changed the figures
    assert calls[1][1]["lookalikes"].pairs() == sorted(pairs)  # the previous thresholds' too
