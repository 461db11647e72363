"""Backbone registry: an open catalogue, so a registry with `list_backbones()`.

Every backbone maps raw-normalised inputs [B, *input_shape] to embeddings [B, d] and
exposes `embed_dim`. Besides the built-ins, `timm:NAME` is an open family: any timm model
(models/timm_backbone.py, docs/backbones.md).
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
from torch import nn

from models import timm_backbone
from models.keywords import check_keywords

_REGISTRY: dict[str, Callable[..., nn.Module]] = {}


def register_backbone(name: str):
    def wrap(fn: Callable[..., nn.Module]):
        if name in _REGISTRY:
            raise ValueError(f"backbone {name!r} registered twice")
        _REGISTRY[name] = fn
        return fn

    return wrap


def list_backbones() -> list[str]:
    return sorted(_REGISTRY)


class UnknownBackboneError(KeyError, ValueError):
    """An unknown backbone name: a ValueError for the CLI's one line, a KeyError as before."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def check_backbone_name(name: str) -> None:
    """One-line ValueError unless `name` is a built-in or an importable, known `timm:NAME`."""
    if name in _REGISTRY:
        return
    if timm_backbone.is_timm(name):
        timm_backbone.check_timm_name(name[len(timm_backbone.PREFIX):])
        return
    raise UnknownBackboneError(f"unknown backbone {name!r}; built-in: {', '.join(list_backbones())}, "
                               f"or timm:NAME for a timm model (e.g. timm:resnet18)")


def check_backbone_params(name: str, params: dict) -> None:
    """One-line ValueError unless a built-in backbone takes these keywords with values of their kind
    (`weights` aside: every backbone takes it); timm's keywords are timm's to check."""
    check_backbone_name(name)
    if not timm_backbone.is_timm(name):
        rest = {k: v for k, v in params.items() if k != "weights"}
        check_keywords(_REGISTRY[name], rest, f"backbone {name}", skip=("input_shape",))


def build_backbone(name: str, input_shape: tuple[int, ...] | list[int], **params) -> nn.Module:
    """The backbone `name` for inputs [B, *input_shape]; weights=FILE loads its starting weights: the
    backbone's own state dict, or an slc run's checkpoint.pt / best.pt (its backbone part)."""
    check_backbone_params(name, params)
    shape = tuple(int(s) for s in input_shape)
    if timm_backbone.is_timm(name):
        return timm_backbone.build_timm_backbone(name[len(timm_backbone.PREFIX):], shape, **params)
    weights = params.pop("weights", None)
    body = _REGISTRY[name](shape, **params)
    if weights is not None:
        timm_backbone.load_weights(body, weights, name)
    return body


def backbone_input_spec(name: str, **params) -> dict | None:
    """The input a backbone's weights expect: {"height", "width", "channels": 3, "mean", "std" (RGB,
    0..1 scale), "interpolation"} from timm's pretrained config; None for the built-ins (the data
    decides their input and normalisation)."""
    check_backbone_name(name)
    if timm_backbone.is_timm(name):
        return timm_backbone.timm_input_spec(name[len(timm_backbone.PREFIX):], **params)
    return None


def spec_normalisation(spec: dict) -> tuple[np.ndarray, np.ndarray]:
    """SLCNet's mean/std buffers for raw 0..255 RGB pixels from an input spec: mean*255, std*255
    per channel, float32 [3, 1, 1] (broadcast over [B, 3, H, W])."""
    mean = np.asarray(spec["mean"], dtype=np.float32).reshape(-1, 1, 1) * 255.0  # [3, 1, 1]
    std = np.asarray(spec["std"], dtype=np.float32).reshape(-1, 1, 1) * 255.0  # [3, 1, 1]
    return mean, std


class _Flatten(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, *shape] -> [B, prod(shape)]
        return x.reshape(x.shape[0], -1)


class Linear(nn.Module):
    """No hidden layer: the embedding is the flattened input (for fast tests)."""

    def __init__(self, input_shape: tuple[int, ...]):
        super().__init__()
        self.embed_dim = math.prod(input_shape)
        self.flatten = _Flatten()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.flatten(x)


class MLP(nn.Module):
    """The PoLS paper's MNIST network: FC layers of 500 units, each BatchNorm then ReLU."""

    def __init__(self, input_shape: tuple[int, ...], hidden: int = 500, layers: int = 2):
        super().__init__()
        dims = [math.prod(input_shape)] + [hidden] * layers
        blocks: list[nn.Module] = [_Flatten()]
        for d_in, d_out in zip(dims[:-1], dims[1:]):
            blocks += [nn.Linear(d_in, d_out), nn.BatchNorm1d(d_out), nn.ReLU()]
        self.net = nn.Sequential(*blocks)
        self.embed_dim = dims[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _conv_bn_relu(c_in: int, c_out: int, k: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, k, padding=k // 2), nn.BatchNorm2d(c_out), nn.ReLU()]


class CNN6(nn.Module):
    """The PoLS paper's CNN for 32x32 colour images.

    Six conv layers (5x5, 1x1, 5x5, 1x1, 5x5, 1x1; 128, 128, 256, 256, 512, 512 maps), a 3x3
    max-pool with stride 2 after the 2nd, 4th and 6th, then a dense layer of 1024; batch
    norm + ReLU after every layer. `width` scales the maps (1.0 = the paper).
    """

    def __init__(self, input_shape: tuple[int, ...], width: float = 1.0, dense: int = 1024):
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(f"cnn6 needs input_shape (C, H, W), got {input_shape}")
        c, h, w = input_shape
        maps = [max(1, int(round(m * width))) for m in (128, 128, 256, 256, 512, 512)]
        kernels = (5, 1, 5, 1, 5, 1)
        layers: list[nn.Module] = []
        c_in = c
        for i, (m, k) in enumerate(zip(maps, kernels)):
            layers += _conv_bn_relu(c_in, m, k)
            c_in = m
            if i % 2 == 1:
                layers.append(nn.MaxPool2d(3, stride=2, padding=1))
                h, w = (h + 1) // 2, (w + 1) // 2
        self.features = nn.Sequential(*layers)
        self.dense = nn.Sequential(_Flatten(), nn.Linear(c_in * h * w, dense), nn.BatchNorm1d(dense), nn.ReLU())
        self.embed_dim = dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, H, W] -> [B, dense]
        return self.dense(self.features(x))


class _Residual(nn.Module):
    """Two 3x3 conv + BN; the input added back (a 1x1 conv when the width or stride changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
                                  nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False), nn.BatchNorm2d(c_out))
        self.skip = nn.Identity() if c_in == c_out and stride == 1 else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, c_in, H, W] -> [B, c_out, H/stride, W/stride]
        return self.act(self.body(x) + self.skip(x))


class ResNetGlyph(nn.Module):
    """A small residual CNN for 32x32 (or 48x48) glyphs: a 3x3 stem, three stages of residual
    blocks (widths w, 2w, 4w; stride 2 between stages), average pooling to a `pool` x `pool` grid,
    and an embedding layer (linear + BN) of size `embed`: the h(x) whose rows the class head scores.
    The grid keeps where strokes are, which global pooling (pool=1) throws away (a pilot on typefaces
    never seen in training chose the grid)."""

    def __init__(self, input_shape: tuple[int, ...], width: int = 32, blocks: int = 1, embed: int = 256,
                 pool: int = 4):
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(f"resnet_glyph needs input_shape (C, H, W), got {input_shape}")
        widths = (width, 2 * width, 4 * width)
        layers: list[nn.Module] = [nn.Conv2d(input_shape[0], width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
        c_in = width
        for stage, c_out in enumerate(widths):
            for i in range(blocks):
                layers.append(_Residual(c_in, c_out, 2 if stage > 0 and i == 0 else 1))
                c_in = c_out
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(pool), _Flatten())  # [B, 4w·pool²]
        self.embedding = nn.Sequential(nn.Linear(c_in * pool * pool, embed), nn.BatchNorm1d(embed))
        self.embed_dim = embed

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, H, W] -> [B, embed]
        return self.embedding(self.features(x))


register_backbone("linear")(Linear)
register_backbone("resnet_glyph")(ResNetGlyph)
register_backbone("mlp")(MLP)
register_backbone("cnn6")(CNN6)
