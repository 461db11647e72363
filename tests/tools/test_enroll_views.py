"""The geometric views of tools/experiments/enroll_views.py against what a warp must do: none at
scale 1 without rotation, a content mass scaled by s² (s the scale), the same views for the same seed."""
import numpy as np
import pytest

pytest.importorskip("PIL")

from tools.experiments.enroll_views import views


def _square(side: int = 16, size: int = 64) -> np.ndarray:
    x = np.zeros((1, size, size), np.float32)
    lo = (size - side) // 2
    x[0, lo:lo + side, lo:lo + side] = 255.0
    return x


def test_scale_one_without_rotation_is_the_image():
    x = _square()
    np.testing.assert_array_equal(views(x, 3, seed=0, scale_min=1.0, scale_max=1.0, rotate_degrees=0.0)[:, 0], np.repeat(x, 3, 0))


@pytest.mark.parametrize("s", [0.5, 0.8])
def test_content_mass_scales_with_the_square_of_the_scale(s):
    x = _square()
    v = views(x, 4, seed=1, scale_min=s, scale_max=s, rotate_degrees=0.0)  # [4, 1, 64, 64]
    mass = v.sum(axis=(1, 2, 3)) / x.sum()
    np.testing.assert_allclose(mass, s * s, rtol=0.05)


def test_views_are_seeded_and_fill_with_the_border():
    x = _square() + 7.0  # border 7: what lies outside the source must read 7, not 0
    a, b = (views(x, 5, seed=3, scale_min=0.5) for _ in range(2))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, views(x, 5, seed=4, scale_min=0.5))
    assert a.min() >= 7.0 - 1e-4
