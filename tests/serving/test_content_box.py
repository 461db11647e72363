"""The content-box crop (serving/bundle/image.py): the square around what is drawn, the same
wherever and however large it sits, for the server's image bodies and the trainer's glyphs alike."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image, ImageDraw

from serving.bundle.image import CONTENT_PROBE, REDUCE_GAP, content_box, crop_to_content, preprocess

SPEC = {"height": 32, "width": 32, "channels": 1, "layout": "CHW", "scale": 1.0, "background": "dark",
        "content_box": 0.1}


def _bbox(a: np.ndarray, bg: int) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of the pixels that differ from bg, by enumeration."""
    ys, xs = np.nonzero(a != bg)
    return xs.min(), ys.min(), xs.max() + 1, ys.max() + 1


def _shape(size: tuple[int, int], box: tuple[int, int, int, int], fg: int = 255, bg: int = 0) -> Image.Image:
    """An L image of `size` with a cross and a ring drawn inside `box`."""
    img = Image.new("L", size, bg)
    d = ImageDraw.Draw(img)
    l, t, r, b = box
    w = max((r - l) // 10, 1)
    d.ellipse(box, outline=fg, width=w)
    d.line((l, (t + b) // 2, r, (t + b) // 2), fill=fg, width=w)
    d.line(((l + r) // 2, t, (l + r) // 2, b), fill=fg, width=w)
    return img


def test_box_is_the_square_around_the_drawing_plus_the_margin():
    a = np.zeros((60, 100), np.uint8)
    a[20:25, 10:30] = 200  # 20 wide, 5 high
    left, top, right, bottom, bg = content_box(a, 0.1)
    assert bg == 0
    assert (right - left, bottom - top) == pytest.approx((24.0, 24.0))  # 20 · (1 + 2 · 0.1)
    assert ((left + right) / 2, (top + bottom) / 2) == pytest.approx((20.0, 22.5))


def test_crop_centres_the_drawing_and_pads_with_the_background():
    img = Image.new("L", (100, 60), 30)
    ImageDraw.Draw(img).rectangle((2, 40, 21, 59), fill=220)  # 20 x 20 at the bottom-left corner
    out = crop_to_content(img, 0.25)
    a = np.asarray(out)
    assert out.size == (30, 30)  # 20 · 1.5
    assert _bbox(a, 30) == (5, 5, 25, 25)  # centred; the square leaves the image: padded with 30
    assert set(np.unique(a)) == {30, 220}


def test_dark_on_light_gives_the_same_box_as_light_on_dark():
    light = _shape((80, 50), (40, 5, 70, 35), fg=0, bg=255)
    dark = _shape((80, 50), (40, 5, 70, 35), fg=255, bg=0)
    assert content_box(np.asarray(light), 0.1)[:4] == content_box(np.asarray(dark), 0.1)[:4]
    assert content_box(np.asarray(light), 0.1)[4] == 255


def test_blank_or_faint_image_is_left_as_it_is():
    img = Image.new("L", (40, 30), 100)
    ImageDraw.Draw(img).point((5, 5), fill=110)  # below CONTENT_MIN_CONTRAST
    assert content_box(np.asarray(img), 0.1) is None
    assert crop_to_content(img, 0.1) is img


def test_a_large_image_is_boxed_on_a_reduced_copy_within_one_reduced_pixel():
    side = 4 * CONTENT_PROBE
    img = _shape((side, side), (300, 500, 700, 700))
    out = crop_to_content(img, 0.0)
    factor = side // CONTENT_PROBE
    assert abs(out.width - 401) <= 2 * factor


def test_small_off_centre_and_large_centred_drawings_preprocess_alike():
    """The same drawing a tenth of a 400-pixel image in its corner, or filling a 64-pixel one:
    after the content box, the two examples correlate almost perfectly (without it they do not)."""
    small = _shape((400, 400), (20, 300, 60, 340))
    large = _shape((64, 64), (6, 6, 58, 58))
    a, b = (preprocess(img, SPEC).ravel() for img in (small, large))
    assert np.corrcoef(a, b)[0, 1] > 0.9
    plain = {k: v for k, v in SPEC.items() if k != "content_box"}
    a, b = (preprocess(img, plain).ravel() for img in (small, large))
    assert np.corrcoef(a, b)[0, 1] < 0.5


def test_a_spec_without_content_box_leaves_images_uncropped():
    img = _shape((32, 32), (2, 2, 12, 12))
    plain = {k: v for k, v in SPEC.items() if k != "content_box"}
    assert np.array_equal(preprocess(img, plain)[0], np.asarray(img, dtype=np.float32))


def _framed(side: int, fg: int = 255, bg: int = 0) -> Image.Image:
    """A drawing framed as the content box frames it: its square plus 10% on each side fills the image."""
    inner = round(side / 1.2)
    off = (side - inner) // 2
    return _shape((side, side), (off, off, off + inner - 1, off + inner - 1), fg=fg, bg=bg)


def test_a_training_rendering_sent_as_an_image_comes_back_unchanged():
    """Idempotence on the trainer's own glyphs (content view, augmented, a matplotlib face): each
    32x32 training image sent back as an image body is the same example. Before the framed rule,
    about half were boxed a pixel off again and resampled."""
    from trainer.data import glyphs
    font = glyphs.Face("DejaVuSans.ttf").load(glyphs.font_size("content"))
    rng = np.random.default_rng(0)
    for c in "ABGKQRWagkmsw2358#&@%":
        for _ in range(4):
            a = glyphs.render(font, c, rng, view="content")  # [32, 32] uint8
            assert np.array_equal(preprocess(Image.fromarray(a), SPEC)[0], a.astype(np.float32)), c


def test_framed_within_two_pixels_at_the_spec_size_is_kept_beyond_that_cropped():
    """The rule by enumeration: a framed 32x32 drawing shifted by s pixels is kept while every box
    edge (fainter strokes counted) stays within FRAMED_PIXELS of the frame, cropped (so recentred)
    once one does not."""
    from serving.bundle.image import FRAMED_LEVEL, FRAMED_PIXELS
    base = np.asarray(_framed(32))
    for s in range(0, 5):
        img = Image.fromarray(np.roll(base, s, axis=1))
        left, top, right, bottom, _ = content_box(np.asarray(img), SPEC["content_box"], FRAMED_LEVEL)
        kept = max(abs(left), abs(top), abs(right - 32), abs(bottom - 32)) <= FRAMED_PIXELS
        out = preprocess(img, SPEC)[0]
        assert np.array_equal(out, np.asarray(img, dtype=np.float32)) == kept, s
        if not kept:
            l2, _, r2, _ = _bbox(np.rint(out).astype(np.uint8) > 127, False)
            assert abs((l2 + r2) / 2 - 16) <= 1  # recentred


def test_faint_strokes_that_reach_the_frame_count_for_the_framed_rule():
    """A framed drawing whose outer ring is faint (0.4 of the peak): the crop's own box (half the peak)
    sees only the bright cross, a smaller square, but the image is framed and kept."""
    a = np.asarray(_framed(32), dtype=np.float32) * 0.4  # [32, 32] the ring and the cross, faint
    a[14:18, 8:24] = a[8:24, 14:18] = 255  # a bright cross inside
    img = Image.fromarray(a.astype(np.uint8))
    inner = content_box(np.asarray(img), SPEC["content_box"])
    assert inner[2] - inner[0] < 24  # the half-peak box would crop it and enlarge the cross
    assert np.array_equal(preprocess(img, SPEC)[0], np.asarray(img, dtype=np.float32))


def test_only_an_image_at_the_spec_size_is_kept_and_a_tight_or_small_drawing_is_still_cropped():
    """A larger image is resized anyway, so it is cropped exactly as before (the trainer's renderings too)."""
    from serving.bundle.image import crop_to_content as crop
    big = Image.fromarray(np.roll(np.asarray(_framed(320)), 10, axis=1))  # within 2 px at 32 x 32, not at 320
    resized = crop(big, SPEC["content_box"]).resize((32, 32), Image.LANCZOS, reducing_gap=REDUCE_GAP)
    assert np.array_equal(preprocess(big, SPEC)[0], np.asarray(resized, dtype=np.float32))
    assert not np.array_equal(preprocess(big, SPEC), preprocess(big, {**SPEC, "content_box": None}))
    tight = _shape((32, 32), (0, 0, 31, 31))  # touches every edge: the margin must be added
    small = _shape((32, 32), (2, 2, 12, 12))  # a corner of the image
    for img in (tight, small):
        assert not np.array_equal(preprocess(img, SPEC)[0], np.asarray(img, dtype=np.float32))
