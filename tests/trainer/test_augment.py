"""Training-time augmentation (trainer/augment.py): the `style` shift (stroke weight, blur, contrast)
against scipy's filters driven by the same draws, its determinism per (seed, step), and the
names --augment takes."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import ndimage

from trainer.augment import AUGMENTS, Geometry, Style, _Chain, augment_generator, build_augment

IMAGE = {"background": "dark", "layout": "CHW"}


def _glyphs(n: int = 16) -> torch.Tensor:
    rng = np.random.default_rng(0)
    x = np.zeros((n, 1, 24, 24), np.float32)
    for i in range(n):
        r, c = rng.integers(4, 16, size=2)
        x[i, 0, r:r + 6, c:c + 2] = 255  # a stroke
        x[i, 0, r + 2, c - 2:c + 4] = 200
    return torch.tensor(x)


def _expected(x: np.ndarray, u: np.ndarray, blur_max: float) -> np.ndarray:
    """Style by scipy: 3x3 max / min filter, a 5-tap Gaussian (edges replicated), contrast about the mean."""
    out = np.empty_like(x)
    for i, img in enumerate(x[:, 0].astype(np.float64)):
        pick = int(np.floor(u[i, 0] * 4))
        img = ndimage.maximum_filter(img, 3, mode="nearest") if pick == 2 else \
            ndimage.minimum_filter(img, 3, mode="nearest") if pick == 3 else img
        sigma = blur_max * u[i, 1] * (u[i, 2] < 0.5)
        if sigma > 0:
            taps = np.exp(-0.5 * (np.arange(-2, 3) / max(sigma, 1e-3)) ** 2)
            taps /= taps.sum()
            img = ndimage.convolve1d(ndimage.convolve1d(img, taps, axis=1, mode="nearest"), taps, axis=0, mode="nearest")
        mean = img.mean()
        out[i, 0] = np.clip(mean + (img - mean) * (0.7 + 0.3 * u[i, 3]), 0, 255)
    return out


def test_style_is_stroke_weight_blur_and_contrast_as_scipy_computes_them():
    x = _glyphs()
    style = Style()
    got = style(x, augment_generator(3, 7)).numpy()
    u = torch.rand(len(x), 4, generator=augment_generator(3, 7)).numpy()  # the same draws
    assert len({int(np.floor(v * 4)) for v in u[:, 0]}) >= 3  # several stroke choices among 16 images
    np.testing.assert_allclose(got, _expected(x.numpy(), u, style.blur_max), atol=1e-3)


def test_style_draws_are_a_function_of_seed_and_step():
    x = _glyphs()
    a = Style()(x, augment_generator(1, 5))
    assert torch.equal(a, Style()(x, augment_generator(1, 5)))
    assert not torch.equal(a, Style()(x, augment_generator(1, 6)))


def test_augment_names():
    assert set(AUGMENTS) == {"none", "geometry", "style", "geometry+style"}
    assert build_augment("none", (1, 24, 24), IMAGE) is None
    assert isinstance(build_augment("style", (1, 24, 24), IMAGE), Style)
    both = build_augment("geometry+style", (1, 24, 24), IMAGE)
    assert isinstance(both, _Chain) and [type(p) for p in both.parts] == [Geometry, Style]
    assert build_augment("style", (1, 24, 24), {"background": "light", "layout": "CHW"}).dark_background is False
    with pytest.raises(ValueError, match="image dataset"):
        build_augment("style", (64,), None)
