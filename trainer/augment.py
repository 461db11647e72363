"""Seeded on-the-fly augmentation of image batches, on the training device.

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

AUGMENTS = ("none", "geometry")


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


def build_augment(name: str, input_shape: tuple[int, ...], image: dict | None):
    """A callable (x [B, C, H, W], generator) -> x, or None; ValueError where it cannot apply."""
    if name in ("none", "", None):
        return None
    if name not in AUGMENTS:
        raise ValueError(f"unknown augmentation {name!r}; known: {', '.join(AUGMENTS)}")
    if len(input_shape) != 3 or image is None or image.get("layout", "CHW") != "CHW":
        raise ValueError(f"--augment {name} needs an image dataset laid out [C, H, W]; "
                         f"this one's examples are {tuple(input_shape)}")
    return Geometry(dark_background=image.get("background", "dark") == "dark")


def augment_generator(seed: int, step: int) -> torch.Generator:
    """The draws of one training step: a function of (seed, step) only."""
    return torch.Generator().manual_seed(int(seed) * 7_368_787 + int(step))
