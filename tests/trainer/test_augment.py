"""Training-time augmentation (trainer/augment.py): the `style` shift (stroke weight, blur, contrast)
against scipy's filters driven by the same draws, the `elastic` warp against scipy's bilinear
resampling at the displaced coordinates, its determinism per (seed, step), and the
names --augment takes."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import ndimage

from trainer.augment import AUGMENTS, Elastic, Geometry, Style, _Chain, augment_generator, build_augment

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
    assert set(AUGMENTS) == {"none", "geometry", "style", "elastic", "geometry+style", "geometry+elastic"}
    chain = build_augment("geometry+elastic", (1, 24, 24), IMAGE)
    assert [type(p) for p in chain.parts] == [Geometry, Elastic]
    assert build_augment("none", (1, 24, 24), IMAGE) is None
    assert isinstance(build_augment("style", (1, 24, 24), IMAGE), Style)
    both = build_augment("geometry+style", (1, 24, 24), IMAGE)
    assert isinstance(both, _Chain) and [type(p) for p in both.parts] == [Geometry, Style]
    assert build_augment("style", (1, 24, 24), {"background": "light", "layout": "CHW"}).dark_background is False
    with pytest.raises(ValueError, match="image dataset"):
        build_augment("style", (64,), None)


def test_elastic_resamples_each_pixel_at_its_displacement_as_scipy_does():
    """The warp equals scipy's bilinear map_coordinates at (row + dy, col + dx), zeros outside (the dark
    background); the field is smooth and no displacement exceeds max_px."""
    x = _glyphs(6)
    elastic = Elastic(max_px=2.0, sigma=3.0)
    got = elastic(x, augment_generator(2, 9)).numpy()
    disp = elastic.field(6, 24, 24, augment_generator(2, 9)).numpy().astype(np.float64)  # the same draws
    assert np.abs(disp).max() <= 2.0 + 1e-6 and np.abs(disp).max() > 0.5
    assert np.abs(np.diff(disp, axis=3)).max() < 0.5 * np.abs(disp).max()  # neighbours move alike
    rows, cols = np.mgrid[0:24, 0:24].astype(np.float64)
    for i in range(6):
        want = ndimage.map_coordinates(x[i, 0].numpy().astype(np.float64), [rows + disp[i, 1], cols + disp[i, 0]],
                                       order=1, mode="grid-constant", cval=0.0)
        np.testing.assert_allclose(got[i, 0], want, atol=1e-2)


def test_elastic_with_no_displacement_is_the_identity():
    x = _glyphs(4)
    assert torch.allclose(Elastic(max_px=0.0)(x, augment_generator(0, 0)), x, atol=1e-3)  # of 255
