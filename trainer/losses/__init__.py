"""Loss registry (docs/losses.md): `list_losses()`, `build_loss(name, num_classes, **params)`.

Every loss module takes logits [B, C] and targets [B] and returns a scalar; it carries
`pols` (does it satisfy the Principle of Logit Separation). Scheduled losses also have
`set_progress(fraction)`.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from trainer.losses.init import ZERO_HEAD

_REGISTRY: dict[str, Callable[..., nn.Module]] = {}


class Loss(nn.Module):
    """What every registered loss carries (trainer/losses/init.py): `pols`, the head's initial weight scale,
    and `initial_bias` (None unless a loss says where its optimum puts a constant logit)."""

    pols = False
    initial_weight_scale = ZERO_HEAD

    def __init__(self, num_classes: int):
        super().__init__()
        self.num_classes = num_classes

    def initial_bias(self, num_classes: int, batch_size: int | None = None):
        return None


class Scheduled(Loss):
    """A loss that changes over training: the trainer calls `set_progress(fraction)`, 0 at the start, 1 at the end."""

    def __init__(self, num_classes: int):
        super().__init__(num_classes)
        self.progress = 0.0

    def set_progress(self, fraction: float) -> None:
        self.progress = min(max(float(fraction), 0.0), 1.0)


def register_loss(name: str):
    def wrap(cls):
        if name in _REGISTRY:
            raise ValueError(f"loss {name!r} registered twice")
        _REGISTRY[name] = cls
        cls.loss_name = name
        return cls

    return wrap


def list_losses() -> list[str]:
    """The losses a user can choose; a name that starts with `_` is registered by a test and not listed."""
    return sorted(name for name in _REGISTRY if not name.startswith("_"))


def loss_class(name: str) -> Callable[..., nn.Module]:
    """The registered class (or factory) of a loss: what its code and its defaults are."""
    if name not in _REGISTRY:
        raise KeyError(f"unknown loss {name!r}; known: {', '.join(list_losses())}")
    return _REGISTRY[name]


def build_loss(name: str, num_classes: int, **params) -> nn.Module:
    return loss_class(name)(num_classes=num_classes, **params)


# Importing the families fills the registry.
from trainer.losses import standard, pols, smooth_topk  # noqa: E402,F401
