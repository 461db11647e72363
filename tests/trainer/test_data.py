"""Datasets: fixed, seeded, stratified, disjoint splits; normalisation from train only."""
import numpy as np
import pytest

from trainer.data import load_dataset


def _rows(x: np.ndarray) -> set[bytes]:
    return {r.tobytes() for r in x}


@pytest.mark.parametrize("name", ["digits", "mnist5k", "synthetic", "synthetic:C=20,d=32,n=50,sep=2.0"])
def test_splits_are_stratified_disjoint_and_complete(name):
    s = load_dataset(name)
    sizes = [len(part[1]) for part in (s.train, s.calibration, s.test)]
    total = sum(sizes)
    assert abs(sizes[0] / total - 0.6) < 0.01 and abs(sizes[1] / total - 0.2) < 0.01
    overall = np.bincount(np.concatenate([s.train[1], s.calibration[1], s.test[1]]), minlength=s.num_classes) / total
    for x, y in (s.train, s.calibration, s.test):
        assert x.dtype == np.float32 and y.dtype == np.int64
        assert x.shape == (len(y), *s.input_shape)
        share = np.bincount(y, minlength=s.num_classes) / len(y)
        assert np.abs(share - overall).max() < 0.02  # stratified
    # Disjoint: no example index appears twice. Identical duplicate images may exist in raw
    # data, so compare unique rows against the total count of unique rows.
    all_rows = _rows(np.concatenate([s.train[0], s.calibration[0], s.test[0]]))
    assert len(_rows(s.train[0])) + len(_rows(s.calibration[0])) + len(_rows(s.test[0])) == len(all_rows)


def test_same_seed_same_split_other_seed_other_split():
    a, b = load_dataset("digits", seed=0), load_dataset("digits", seed=0)
    np.testing.assert_array_equal(a.test[0], b.test[0])
    c = load_dataset("digits", seed=1)
    assert not np.array_equal(a.test[0], c.test[0])


def test_raw_values_and_train_statistics():
    s = load_dataset("digits")
    assert s.train[0].min() == 0 and s.train[0].max() == 16  # raw pixel values, not normalised
    assert s.mean.shape == () and s.mean == pytest.approx(s.train[0].mean(), rel=1e-5)
    assert s.std == pytest.approx(s.train[0].std(), rel=1e-5)
    m = load_dataset("mnist5k")
    assert m.input_shape == (784,) and len(m.classes) == 10 and m.train[0].max() == 255
    assert sum(len(p[1]) for p in (m.train, m.calibration, m.test)) == 5000


def test_synthetic_parameters_and_separation_control():
    s = load_dataset("synthetic:C=7,d=5,n=30,sep=2.0")
    assert s.num_classes == 7 and s.input_shape == (5,)
    assert s.mean.shape == (5,) and s.std.shape == (5,)
    np.testing.assert_allclose(s.mean, s.train[0].mean(axis=0), rtol=1e-5, atol=1e-5)

    def nearest_mean_accuracy(sep):
        d = load_dataset(f"synthetic:C=10,d=16,n=100,sep={sep}")
        x, y = d.train
        centres = np.stack([x[y == c].mean(axis=0) for c in range(10)])
        xt, yt = d.test
        return (np.linalg.norm(xt[:, None] - centres[None], axis=2).argmin(axis=1) == yt).mean()

    assert nearest_mean_accuracy(8.0) > nearest_mean_accuracy(1.0)
    with pytest.raises(ValueError):
        load_dataset("synthetic:C=1")
    with pytest.raises(ValueError):
        load_dataset("synthetic:k=3")


def test_npz_dataset(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 2, 3)).astype(np.float64)
    y = np.repeat([3, 5, 9, 11], 25)  # non-contiguous labels are renumbered 0..C-1
    np.savez(tmp_path / "d.npz", x=x, y=y)
    s = load_dataset(f"npz:{tmp_path / 'd.npz'}")
    assert s.input_shape == (2, 3) and s.classes == ["3", "5", "9", "11"]
    assert set(np.unique(s.test[1])) == {0, 1, 2, 3}
    with pytest.raises(FileNotFoundError):
        load_dataset(f"npz:{tmp_path / 'missing.npz'}")


def test_unknown_dataset():
    with pytest.raises(KeyError):
        load_dataset("cifar10")
