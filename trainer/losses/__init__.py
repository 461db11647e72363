"""Loss registry (docs/losses.md): `list_losses()`, `build_loss(name, num_classes, **params)`.

Every loss module takes logits [B, C] and targets [B] and returns a scalar; it carries
`pols` (does it satisfy the Principle of Logit Separation). Scheduled losses also have
`set_progress(fraction)`.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

_REGISTRY: dict[str, Callable[..., nn.Module]] = {}


def register_loss(name: str):
    def wrap(cls):
        if name in _REGISTRY:
            raise ValueError(f"loss {name!r} registered twice")
        _REGISTRY[name] = cls
        cls.loss_name = name
        return cls

    return wrap


def list_losses() -> list[str]:
    return sorted(_REGISTRY)


def loss_class(name: str) -> Callable[..., nn.Module]:
    """The registered class (or factory) of a loss: what its code and its defaults are."""
    if name not in _REGISTRY:
        raise KeyError(f"unknown loss {name!r}; known: {', '.join(list_losses())}")
    return _REGISTRY[name]


def build_loss(name: str, num_classes: int, **params) -> nn.Module:
    return loss_class(name)(num_classes=num_classes, **params)


# Importing the families fills the registry.
from trainer.losses import standard, pols, smooth_topk  # noqa: E402,F401
