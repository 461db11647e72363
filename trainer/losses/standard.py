"""Per-example losses that do NOT satisfy the PoLS (docs/losses.md): the baselines of Table 1.

Each is the mean over the batch of a per-example loss of logits z [B, C] and targets y [B].
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from trainer.losses import Loss, Scheduled, register_loss


def true_logits(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """z_{i, y_i} -> [B]."""
    return logits.gather(1, target[:, None]).squeeze(1)


def max_false_logits(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """max_{j != y_i} z_{ij} -> [B] (needs C >= 2)."""
    is_true = F.one_hot(target, logits.shape[1]).bool()  # [B, C]
    return logits.masked_fill(is_true, float("-inf")).amax(dim=1)


def false_logits(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """logits [B, C] with each example's true class at −inf."""
    return logits.masked_fill(F.one_hot(target, logits.shape[1]).bool(), float("-inf"))


def smooth_max(z: torch.Tensor, tau: float, dim: int | None = 1) -> torch.Tensor:
    """max over `dim` (all elements if None) when tau = 0, else tau·logsumexp(z/tau) >= max,
    which tends to the max as tau -> 0 and spreads the gradient over z by softmax(z/tau)."""
    if dim is None:
        z, dim = z.reshape(-1), 0
    return z.amax(dim=dim) if tau == 0 else tau * torch.logsumexp(z / tau, dim=dim)


class SmoothHinge(Scheduled):
    """A hinge loss of margin `gamma` and its option (docs/losses.md, "Hinge losses at many classes"):
    `tau` > 0 replaces each max over false logits by tau·logsumexp(·/tau) (and a min by its mirror);
    `anneal` in (0, 1] lowers tau linearly to 0 over that share of training (set_progress), so the
    loss is the exact hinge from then on. Defaults tau=0, anneal=0: the hinge as defined."""

    # initial bias None (Loss): only differences of logits enter a hinge

    def __init__(self, num_classes: int, gamma: float = 1.0, tau: float = 0.0, anneal: float = 0.0):
        super().__init__(num_classes)
        if tau < 0 or not 0 <= anneal <= 1:
            raise ValueError(f"need tau >= 0 and 0 <= anneal <= 1, got tau={tau}, anneal={anneal}")
        self.gamma, self.tau, self.anneal = float(gamma), float(tau), float(anneal)

    @property
    def current_tau(self) -> float:
        if self.anneal == 0:
            return self.tau
        return self.tau * max(0.0, 1.0 - self.progress / self.anneal)


def log_square_plus(u: torch.Tensor, c: float) -> torch.Tensor:
    """log(u² + c) for u [B, C], c > 0, without overflow of u² at large |u|.

    Rows are scaled by s = max(1, max_j |u_j|) (constant, no gradient):
    log(u² + c) = 2·log s + log((u/s)² + c/s²); (u/s)² <= 1.
    """
    scale = u.detach().abs().amax(dim=1, keepdim=True).clamp_min(1.0)  # [B, 1]
    return 2.0 * torch.log(scale) + torch.log((u / scale) ** 2 + c / scale**2)


@register_loss("ce")
class CrossEntropy(Loss):
    """−log p_y, the softmax cross-entropy (not PoLS: logits only compete within an example)."""

    pols = False
    # initial bias None (Loss): softmax is unchanged by one constant added to every logit

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, target)

    def sharded(self, z: torch.Tensor, shard) -> torch.Tensor:
        """The same loss from this rank's columns z [B, D_r] (trainer/sharded_head.py)."""
        return (shard.logsumexp(z) - shard.true_logits(z)).mean()


@register_loss("max_margin")
class MaxMargin(SmoothHinge):
    """Multiclass hinge max(0, γ − z_y + max_{j≠y} z_j). Default gamma=1; tau=0, anneal=0 (the
    SmoothHinge option, off: with tau > 0 the max is τ·logsumexp_{j≠y}(z_j/τ))."""

    pols = False

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        tau = self.current_tau
        worst = max_false_logits(logits, target) if tau == 0 else smooth_max(false_logits(logits, target), tau)  # [B]
        return F.relu(self.gamma - true_logits(logits, target) + worst).mean()

    def sharded(self, z: torch.Tensor, shard) -> torch.Tensor:
        return F.relu(self.gamma - shard.true_logits(z) + shard_false_max(z, shard, self.current_tau)).mean()


def shard_false_max(z: torch.Tensor, shard, tau: float) -> torch.Tensor:
    """max_{j≠y} z_j (tau = 0) or its smooth form over all D classes from this rank's columns [B, D_r] -> [B]."""
    if tau == 0:
        return shard.max_false(z)
    is_true = torch.zeros_like(z, dtype=torch.bool)
    is_true[shard.owns, shard.local[shard.owns]] = True
    return tau * shard.logsumexp(z.masked_fill(is_true, float("-inf")) / tau)


@register_loss("taylor_softmax")
class TaylorSoftmax(Loss):
    """−log of the second-order Taylor softmax, f(z) = 1 + z + z²/2 = ((z+1)² + 1)/2 > 0.

    Computed as log((z+1)² + 1) per logit (the 1/2 cancels) and a logsumexp over classes.
    """

    pols = False
    def initial_bias(self, num_classes: int, batch_size: int | None = None) -> None:
        """None (0): equal logits give p_y = 1/C at any value; at 0 the true logit's gradient
        −f'(b)/f(b)·(1 − 1/C) is largest, while −1 (f's minimum, the false logits' optimum) is a
        stationary point of a zero head where nothing would move."""
        return None

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        log_f = log_square_plus(logits + 1.0, 1.0)  # [B, C]
        return (torch.logsumexp(log_f, dim=1) - true_logits(log_f, target)).mean()


@register_loss("spherical_softmax")
class SphericalSoftmax(Loss):
    """−log((z_y² + ε) / Σ_j (z_j² + ε)). Default eps=1e-6 (the blog's small additive term).

    Computed in log space with per-row scaling, so z of magnitude 1e3 (and far beyond)
    stays finite in float32.
    """

    pols = False
    def __init__(self, num_classes: int, eps: float = 1e-6):
        super().__init__(num_classes)
        if eps <= 0:
            raise ValueError("eps must be > 0")
        self.eps = float(eps)

    def initial_bias(self, num_classes: int, batch_size: int | None = None) -> float:
        """1.0: equal logits give p_y = 1/C at any value, but f = z² + ε is symmetric about 0, so a
        zero head at bias 0 has no gradient at all, and a random one lets a true logit grow to
        either sign; at 1 every true logit is pushed up (gradient ≈ −2/b) and every false one
        down toward f's minimum, so large positive logits mean "yes", as a single logit needs."""
        return 1.0

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        log_f = log_square_plus(logits, self.eps)  # [B, C]
        return (torch.logsumexp(log_f, dim=1) - true_logits(log_f, target)).mean()


def _parse_schedule(schedule) -> list[float]:
    if isinstance(schedule, str):  # "0,0.1,0.5" from the command line
        schedule = [s for s in schedule.replace("[", "").replace("]", "").split(",") if s.strip()]
    if isinstance(schedule, (int, float)):
        schedule = [schedule]
    focus = [float(f) for f in schedule]
    if not focus or any(not 0.0 <= f <= 0.5 for f in focus):
        raise ValueError(f"schedule must be a non-empty list of focus values in [0, 0.5], got {schedule!r}")
    return focus


@register_loss("ce_el")
class CrossEntropyExpectation(Scheduled):
    """a·(−log p_y) + b·(1 − p_y), the CE + expectation-loss mix of Battash et al.

    The focus F (the p_y where the gradient is largest) follows `schedule`, a list of F
    values played in equal phases over training progress; default [0, 0.1, 0.2, 0.3, 0.4, 0.5]
    (the paper's "F = 0-0.5"). F < 0.5 → a = 1, b = 1/(1 − 2F); F = 0.5 → a = 0, b = 1.
    Call `set_progress(fraction)` (0 = start, 1 = end); it starts at 0.
    """

    pols = False
    # initial bias None (Loss): softmax is unchanged by one constant added to every logit

    def __init__(self, num_classes: int, schedule: Sequence[float] | str = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)):
        super().__init__(num_classes)
        self.schedule = _parse_schedule(schedule)

    @property
    def phase(self) -> int:
        n = len(self.schedule)
        return min(int(math.floor(self.progress * n)), n - 1)

    @property
    def focus(self) -> float:
        return self.schedule[self.phase]

    @property
    def weights(self) -> tuple[float, float]:
        """(a, b) of the current phase."""
        focus = self.focus
        if focus >= 0.5:
            return 0.0, 1.0
        return 1.0, 1.0 / (1.0 - 2.0 * focus)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        a, b = self.weights
        log_p_true = true_logits(F.log_softmax(logits, dim=1), target)  # [B]
        return (a * (-log_p_true) + b * (1.0 - log_p_true.exp())).mean()
