"""slc_metrics and pooled_separation against scikit-learn and brute force."""
import numpy as np
import pytest
from sklearn.metrics import average_precision_score, precision_recall_curve

from trainer.metrics import per_class_average_precision, pooled_separation, slc_metrics


def _sklearn_reference(scores: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """The §5 metrics computed class by class with scikit-learn's own curves."""
    aps, p90s, p99s = [], [], []
    for j in range(scores.shape[1]):
        positive = labels == j
        if not positive.any():
            continue
        aps.append(average_precision_score(positive, scores[:, j]))
        precision, recall, _ = precision_recall_curve(positive, scores[:, j])
        p90s.append(precision[recall >= 0.9].max())
        p99s.append(precision[recall >= 0.99].max())
    order = np.argsort(-scores, axis=1, kind="stable")
    return {
        "auprc": float(np.mean(aps)),
        "p_at_r90": float(np.mean(p90s)),
        "p_at_r99": float(np.mean(p99s)),
        "accuracy": float((scores.argmax(axis=1) == labels).mean()),
        "top5_accuracy": float((order[:, :5] == labels[:, None]).any(axis=1).mean()),
    }


def _data(seed: int, n: int, c: int, tie_levels: int | None):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, c, size=n)
    labels[:c] = np.arange(c)  # every class has a positive
    scores = rng.normal(size=(n, c)) + 1.5 * np.eye(c)[labels]
    if tie_levels is not None:  # few distinct values: many ties within and across classes
        scores = np.round(scores * tie_levels / 3) / tie_levels
    return scores, labels


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tie_levels", [None, 1, 3])
@pytest.mark.parametrize("n, c", [(300, 7), (400, 120)])  # ~43 positives a class (sorted), ~3 (counted)
def test_slc_metrics_match_sklearn(seed, tie_levels, n, c):
    scores, labels = _data(seed, n=n, c=c, tie_levels=tie_levels)
    ours = slc_metrics(scores, labels)
    ref = _sklearn_reference(scores, labels)
    assert ours.keys() == ref.keys()
    for key in ref:
        assert ours[key] == pytest.approx(ref[key], abs=1e-12), key


def test_per_class_ap_matches_sklearn_with_constant_column():
    scores, labels = _data(0, n=120, c=5, tie_levels=None)
    scores[:, 2] = 0.5  # one threshold only: AP = share of positives
    ours = per_class_average_precision(scores, labels)
    for j in range(5):
        assert ours[j] == pytest.approx(average_precision_score(labels == j, scores[:, j]), abs=1e-12)


def test_perfect_separation_scores_one():
    labels = np.arange(50) % 5
    scores = np.eye(5)[labels] * 3.0
    m = slc_metrics(scores, labels)
    assert m == {"auprc": 1.0, "p_at_r90": 1.0, "p_at_r99": 1.0, "accuracy": 1.0, "top5_accuracy": 1.0}
    assert pooled_separation(scores, labels) == 1.0


def test_class_without_positive_is_left_out():
    scores, labels = _data(1, n=200, c=6, tie_levels=None)
    keep = labels != 4
    ours = slc_metrics(scores[keep], labels[keep])
    ref = _sklearn_reference(scores[keep], labels[keep])
    assert ours["auprc"] == pytest.approx(ref["auprc"], abs=1e-12)


def test_rejects_nan_and_bad_shapes():
    with pytest.raises(ValueError):
        slc_metrics(np.array([[np.nan, 0.0]]), np.array([0]))
    with pytest.raises(ValueError):
        slc_metrics(np.zeros((3, 2)), np.zeros(4, dtype=int))


def _separation_brute_force(scores, labels) -> float:
    n, c = scores.shape
    good = total = 0
    for i in range(n):
        t = scores[i, labels[i]]
        for i2 in range(n):
            if i2 == i:
                continue
            for j in range(c):
                if j == labels[i2]:
                    continue
                total += 1
                good += t > scores[i2, j]
    return good / total


@pytest.mark.parametrize("tie_levels", [None, 1, 4])
@pytest.mark.parametrize("seed", range(3))
def test_pooled_separation_matches_brute_force(seed, tie_levels):
    scores, labels = _data(seed, n=40, c=4, tie_levels=tie_levels)
    assert pooled_separation(scores, labels) == pytest.approx(_separation_brute_force(scores, labels), abs=1e-12)


def test_separation_ignores_within_example_pairs():
    """Every example ranks its own class first (accuracy 1) but true logits of one example sit
    below false logits of another: accuracy is perfect, separation is not."""
    labels = np.array([0, 1])
    scores = np.array([[1.0, 0.0], [10.0, 11.0]])
    assert slc_metrics(scores, labels)["accuracy"] == 1.0
    assert pooled_separation(scores, labels) == pytest.approx(_separation_brute_force(scores, labels))
    assert pooled_separation(scores, labels) == 0.5


# --- streaming over class chunks equals the dense computation


@pytest.mark.parametrize("chunk", [1, 3, 7, 50])
@pytest.mark.parametrize("ties", [False, True])
def test_streaming_metrics_equal_dense(chunk, ties):
    from serving.calibration.chunks import head_chunks
    from trainer.metrics import pooled_separation, streaming_slc_metrics

    rng = np.random.default_rng(chunk)
    n, d, num_classes = 120, 6, 23
    h = rng.standard_normal((n, d))
    w, b = rng.standard_normal((num_classes, d)), rng.standard_normal(num_classes)
    if ties:  # rounding makes many equal scores: tie handling must match the dense path exactly
        h, w, b = np.round(h, 0), np.round(w, 0), np.round(b, 0)
    labels = rng.integers(0, num_classes - 2, n)  # the last two classes have no positive
    dense = h @ w.T + b
    want = {**slc_metrics(dense, labels), "separation": pooled_separation(dense, labels)}
    got = streaming_slc_metrics(head_chunks(h, w, b, chunk), labels, num_classes)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-12, abs=1e-12), key
