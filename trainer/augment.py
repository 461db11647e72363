"""Seeded on-the-fly augmentation of image batches, on the training device.

`style` (issue 37: faces the training fonts do not cover, brush strokes, scans): every image gets a
stroke weight (thicker or thinner by a 3x3 max / min filter, or as drawn), a Gaussian blur of a
random width (half of them), and a contrast; `geometry+style` applies both.

`elastic` (issue 37): every image warped by a smooth random displacement field, the distortion of
handwriting (Simard, Steinkraus and Platt 2003): strokes bend and the glyph's proportions shift, as
a brush or a hand draws them and the printed training faces never do; `geometry+elastic` applies both.

`geometry`: every image is scaled by a factor drawn in [scale_min, scale_max] and shifted
anywhere its content can go (a glyph filling a third of the image, or all of it, wherever it
sits: what crops, scans and photos send), with a small rotation. One affine warp per batch
(`affine_grid` + `grid_sample`), so it costs one pass over the pixels on the CPU or the GPU.

Parameters are drawn from a generator seeded by (seed, step): the same run gives the same
augmented batches whatever the number of loader workers, and a resumed run continues them.
Augmentation happens in raw pixel space, before the network's normalisation; what lies outside
the source image is the background (0 for light-on-dark images, the nearest border otherwise).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

AUGMENTS = ("none", "geometry", "style", "elastic", "geometry+style", "geometry+elastic")
PARTS = ("geometry", "style", "elastic")


@dataclass(frozen=True)
class Geometry:
    scale_min: float = 0.4  # content size relative to the training rendering
    scale_max: float = 1.15
    rotate_degrees: float = 5.0
    dark_background: bool = True

    def __call__(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """x [B, C, H, W] raw pixels -> the same shape, each image warped by its own draw."""
        b = x.shape[0]
        u = torch.rand(b, 4, generator=generator)  # [B, 4] in [0, 1)
        scale = self.scale_min + (self.scale_max - self.scale_min) * u[:, 0]  # [B]
        angle = math.radians(self.rotate_degrees) * (2 * u[:, 1] - 1)  # [B]
        room = (1 - scale).clamp(min=0)  # how far the shrunk content can move (in [-1, 1] units)
        shift = torch.stack([room * (2 * u[:, 2] - 1), room * (2 * u[:, 3] - 1)], dim=1)  # [B, 2]
        cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
        # output -> input sampling: inverse of (rotate, scale, then shift)
        theta = torch.stack([torch.stack([cos, -sin], 1), torch.stack([sin, cos], 1)], 1)  # [B, 2, 2]
        offset = -(theta @ shift.unsqueeze(2))  # [B, 2, 1]
        affine = torch.cat([theta, offset], dim=2).to(device=x.device, dtype=x.dtype)  # [B, 2, 3]
        grid = F.affine_grid(affine, list(x.shape), align_corners=False)  # [B, H, W, 2]
        mode = "zeros" if self.dark_background else "border"
        return F.grid_sample(x, grid, mode="bilinear", padding_mode=mode, align_corners=False)


@dataclass(frozen=True)
class Style:
    blur_max: float = 1.2  # sigma in pixels of the widest blur
    dark_background: bool = True

    def __call__(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """x [B, C, H, W] raw pixels -> the same shape: stroke weight, blur and contrast drawn per image."""
        b = x.shape[0]
        u = torch.rand(b, 4, generator=generator).to(x.device)  # [B, 4]
        grow = F.max_pool2d(x, 3, 1, 1)  # light strokes thicker on a dark background
        shrink = -F.max_pool2d(-x, 3, 1, 1)
        thick, thin = (grow, shrink) if self.dark_background else (shrink, grow)
        pick = (u[:, 0] * 4).floor().view(b, 1, 1, 1)  # 0, 1: as drawn; 2: thicker; 3: thinner
        x = torch.where(pick == 2, thick, torch.where(pick == 3, thin, x))
        x = _blur(x, self.blur_max * u[:, 1] * (u[:, 2] < 0.5))  # half the images blurred
        mean = x.mean(dim=(1, 2, 3), keepdim=True)
        return (mean + (x - mean) * (0.7 + 0.3 * u[:, 3]).view(b, 1, 1, 1)).clamp(0, 255)


@dataclass(frozen=True)
class Elastic:
    max_px: float = 2.0  # the largest displacement of an image's field, in pixels (drawn: 0 to this)
    sigma: float = 3.0  # the field's smoothness: a Gaussian of this many pixels over uniform noise
    dark_background: bool = True

    def field(self, b: int, h: int, w: int, generator: torch.Generator) -> torch.Tensor:
        """[B, 2, H, W] displacements in pixels (x, then y): uniform noise smoothed, scaled so that each
        image's largest displacement is its own draw in [0, max_px]."""
        noise = torch.rand(b, 2, h, w, generator=generator) * 2 - 1  # [B, 2, H, W]
        amount = torch.rand(b, generator=generator) * self.max_px  # [B]
        smooth = _gaussian(noise.reshape(b * 2, 1, h, w), self.sigma).reshape(b, 2, h, w)
        peak = smooth.abs().amax(dim=(1, 2, 3), keepdim=True).clamp(min=1e-6)  # [B, 1, 1, 1]
        return smooth / peak * amount.view(b, 1, 1, 1)

    def __call__(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """x [B, C, H, W] raw pixels -> the same shape, each image resampled at (pixel + its displacement)."""
        b, _, h, w = x.shape
        disp = self.field(b, h, w, generator).to(device=x.device, dtype=x.dtype)  # [B, 2, H, W]
        eye = torch.tensor([[1.0, 0, 0], [0, 1.0, 0]], device=x.device, dtype=x.dtype).expand(b, 2, 3)
        base = F.affine_grid(eye, list(x.shape), align_corners=False)  # [B, H, W, 2] pixel centres in [-1, 1]
        grid = base + torch.stack([disp[:, 0] * (2 / w), disp[:, 1] * (2 / h)], dim=-1)
        mode = "zeros" if self.dark_background else "border"
        return F.grid_sample(x, grid, mode="bilinear", padding_mode=mode, align_corners=False)


def _gaussian(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """x [N, 1, H, W] smoothed by a separable Gaussian of sigma pixels (radius 2 sigma, edges reflected)."""
    r = max(1, int(math.ceil(2 * sigma)))
    taps = torch.exp(-0.5 * (torch.arange(-r, r + 1, dtype=x.dtype) / sigma) ** 2)
    taps = taps / taps.sum()
    y = F.conv2d(F.pad(x, (r, r, 0, 0), mode="reflect"), taps.view(1, 1, 1, -1))
    return F.conv2d(F.pad(y, (0, 0, r, r), mode="reflect"), taps.view(1, 1, -1, 1))


def _blur(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """x [B, C, H, W] blurred by a separable 5-tap Gaussian of its own sigma per image (0: unchanged)."""
    b, c = x.shape[:2]
    taps = torch.arange(-2, 3, dtype=x.dtype, device=x.device)  # [5]
    s = sigma.to(x.dtype).clamp(min=1e-3).view(b, 1)
    k = torch.exp(-0.5 * (taps / s) ** 2)  # [B, 5]
    k = k / k.sum(dim=1, keepdim=True)
    k = k.repeat_interleave(c, dim=0)  # [B*C, 5]: one kernel per (image, channel)
    y = x.reshape(1, b * c, *x.shape[2:])
    y = F.conv2d(F.pad(y, (2, 2, 0, 0), mode="replicate"), k.view(b * c, 1, 1, 5), groups=b * c)
    y = F.conv2d(F.pad(y, (0, 0, 2, 2), mode="replicate"), k.view(b * c, 1, 5, 1), groups=b * c)
    return y.reshape(x.shape)


def build_augment(name: str, input_shape: tuple[int, ...], image: dict | None):
    """A callable (x [B, C, H, W], generator) -> x, or None; ValueError where it cannot apply."""
    if name in ("none", "", None):
        return None
    if name not in AUGMENTS:
        raise ValueError(f"unknown augmentation {name!r}; known: {', '.join(AUGMENTS)}")
    if len(input_shape) != 3 or image is None or image.get("layout", "CHW") != "CHW":
        raise ValueError(f"--augment {name} needs an image dataset laid out [C, H, W]; "
                         f"this one's examples are {tuple(input_shape)}")
    dark = image.get("background", "dark") == "dark"
    kinds = {"geometry": Geometry, "style": Style, "elastic": Elastic}
    parts = [kinds[p](dark_background=dark) for p in name.split("+")]
    return parts[0] if len(parts) == 1 else _Chain(tuple(parts))


@dataclass(frozen=True)
class _Chain:
    parts: tuple

    def __call__(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        for part in self.parts:
            x = part(x, generator)
        return x


def augment_generator(seed: int, step: int) -> torch.Generator:
    """The draws of one training step: a function of (seed, step) only."""
    return torch.Generator().manual_seed(int(seed) * 7_368_787 + int(step))
