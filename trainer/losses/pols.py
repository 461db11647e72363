"""Losses that satisfy the Principle of Logit Separation (docs/losses.md; Keren, Sabato & Schuller).

A small loss forces every true logit above every false logit *across* examples, so one
logit z_j(x) compared with a threshold answers "is x of class j?".

`batch_ce`, `batch_max_margin` and `lgl_inr` are defined on the batch as a whole; under
torch.distributed they gather logits and targets of all ranks first, so their value is the
single-process value on the global batch (gradient convention: trainer/distributed.py).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from trainer.distributed import gather_batch
from trainer.losses import Loss, register_loss
from trainer.losses.init import expected_present, prior_logit
from trainer.losses.standard import SmoothHinge, false_logits, shard_false_max, smooth_max, true_logits


@register_loss("self_norm")
class SelfNormalization(Loss):
    """−log p_y + α·(logsumexp_j z_j)² (Devlin et al. 2014). Default alpha=0.1 (Devlin et al.'s value).

    The second term pins the softmax normaliser at 1, so e^{z_j} is itself a probability.
    """

    pols = True

    def __init__(self, num_classes: int, alpha: float = 0.1):
        super().__init__(num_classes)
        if alpha <= 0:
            raise ValueError("alpha must be > 0 (alpha = 0 is plain ce, which is not PoLS)")
        self.alpha = float(alpha)

    def initial_bias(self, num_classes: int, batch_size: int | None = None) -> float:
        """−log C: equal logits then have logsumexp 0, so the penalty starts at its minimum and
        e^{z_j} = 1/C, the prior (C = the columns this loss sees)."""
        return -math.log(self.num_classes)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        log_norm = torch.logsumexp(logits, dim=1)  # [B]
        ce = log_norm - true_logits(logits, target)  # [B]
        return (ce + self.alpha * log_norm**2).mean()

    def sharded(self, z: torch.Tensor, shard) -> torch.Tensor:
        """The same loss from this rank's columns z [B, D_r] (trainer/sharded_head.py)."""
        log_norm = shard.logsumexp(z)  # [B]
        return (log_norm - shard.true_logits(z) + self.alpha * log_norm**2).mean()


@register_loss("nce")
class NoiseContrastive(Loss):
    """NCE (Mnih & Teh 2012): −log g_y − t·Σ_j q_j log(1 − g_j), g_j = σ(z_j − log(t·q_j)).

    Defaults: t=10 noise samples, q uniform (1/C), mode="exact" (the expectation over j~q,
    deterministic). mode="sampled" replaces the expectation by t draws j~q per example
    (−Σ_{s≤t} log(1 − g_{j_s})), an unbiased Monte-Carlo estimate of the exact term.
    `q` (length C, positive) is normalised to sum to 1.
    """

    pols = True

    def __init__(self, num_classes: int, t: int = 10, q: Sequence[float] | None = None, mode: str = "exact"):
        super().__init__(num_classes)
        if mode not in ("exact", "sampled"):
            raise ValueError(f"mode must be 'exact' or 'sampled', got {mode!r}")
        if int(t) != t or t < 1:
            raise ValueError("t must be a positive integer")
        prior = torch.full((num_classes,), 1.0 / num_classes, dtype=torch.float64) if q is None else (
            torch.as_tensor(q, dtype=torch.float64).flatten())
        if prior.numel() != num_classes or not bool((prior > 0).all()):
            raise ValueError(f"q must hold {num_classes} positive values")
        self.num_classes, self.t, self.mode = num_classes, int(t), mode
        self.register_buffer("q", prior / prior.sum(), persistent=False)  # [C]
        self.uniform = q is None

    def initial_bias(self, num_classes: int, batch_size: int | None = None) -> float | torch.Tensor:
        """log q_j, where g_j = σ(z_j − log(t·q_j)) = 1/(1 + t): the posterior that an example of
        class j is data, not one of the t noise draws, and the constant logit minimising the
        expected loss when the classes occur with frequencies q. Uniform q: −log C, a float."""
        if self.uniform:
            return -math.log(self.num_classes)
        if num_classes != self.num_classes:
            raise ValueError(f"nce with a prior q of {self.num_classes} classes cannot start a head of {num_classes}")
        return torch.log(self.q).float()  # [C]

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        q = self.q.to(device=logits.device, dtype=logits.dtype)  # [C]
        shifted = logits - torch.log(self.t * q)  # z_j − log(t q_j), [B, C]
        positive = -true_logits(F.logsigmoid(shifted), target)  # −log g_y, [B]
        if self.mode == "exact":
            noise = -self.t * (F.logsigmoid(-shifted) * q).sum(dim=1)  # [B]
        else:
            draws = self.draw_noise(logits.shape[0], logits.device)  # [B, t]
            noise = -F.logsigmoid(-shifted.gather(1, draws)).sum(dim=1)  # [B]
        return (positive + noise).mean()

    def draw_noise(self, batch: int, device=None) -> torch.Tensor:
        """Sampled mode's noise classes: t draws j ~ q per example, [B, t]."""
        return torch.multinomial(self.q.to(device), batch * self.t, replacement=True).view(batch, self.t)

    def on_columns(self, z: torch.Tensor, cols: torch.Tensor, target: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
        """Sampled mode from the logits of a few classes only: z [B, K] of the classes cols [K],
        holding every target and every draw; target [B] and draws [B, t] are positions in cols.
        Equal to forward() on the full logits with the same draws (trainer/train.py uses it)."""
        q = self.q[cols].to(device=z.device, dtype=z.dtype)  # [K]
        shifted = z - torch.log(self.t * q)  # [B, K]
        positive = -true_logits(F.logsigmoid(shifted), target)  # [B]
        noise = -F.logsigmoid(-shifted.gather(1, draws)).sum(dim=1)  # [B]
        return (positive + noise).mean()

    def sharded(self, z: torch.Tensor, shard) -> torch.Tensor:
        """The same loss from this rank's columns z [B, D_r]. Sampled mode: each rank draws t noise
        classes per example and counts those in its shard; the summed noise term is an unbiased
        estimate of the exact one whether or not the ranks' draws coincide (they do when their
        random streams are in step, as training keeps them)."""
        q = shard.columns(self.q).to(device=z.device, dtype=z.dtype)  # [D_r]
        shifted = z - torch.log(self.t * q)  # [B, D_r]
        positive = -shard.true_logits(F.logsigmoid(shifted))  # [B]
        if self.mode == "exact":
            noise = -self.t * shard.sum((F.logsigmoid(-shifted) * q).sum(dim=1))  # [B]
        else:
            draws = self.draw_noise(z.shape[0], z.device)  # [B, t]
            inside = (draws >= shard.start) & (draws < shard.stop)  # [B, t]
            local = (draws - shard.start).clamp(0, shard.size - 1)
            picked = F.logsigmoid(-shifted.gather(1, local))  # [B, t]
            noise = -shard.sum(torch.where(inside, picked, torch.zeros_like(picked)).sum(dim=1))  # [B]
        return (positive + noise).mean()


@register_loss("bce")
class BinaryCrossEntropy(Loss):
    """One-vs-all logistic loss −log σ(z_y) − Σ_{j≠y} log(1 − σ(z_j)) ("LGL"), summed over classes."""

    pols = True

    def initial_bias(self, num_classes: int, batch_size: int | None = None) -> float:
        """−log(C − 1): σ(b) = 1/C, the prior of each one-vs-all logit."""
        return prior_logit(self.num_classes)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        onehot = F.one_hot(target, logits.shape[1]).to(logits.dtype)  # [B, C]
        per_logit = F.binary_cross_entropy_with_logits(logits, onehot, reduction="none")  # [B, C]
        return per_logit.sum(dim=1).mean()

    def sharded(self, z: torch.Tensor, shard) -> torch.Tensor:
        """Σ_j softplus(z_j) − z_y (the same sum) from this rank's columns z [B, D_r]."""
        return (shard.sum(F.softplus(z).sum(dim=1)) - shard.true_logits(z)).mean()


@register_loss("batch_ce")
class BatchCrossEntropy(Loss):
    """KL(P_B ‖ Q_B) over the m×C batch = mean_i(−z_{i,y_i}) + logsumexp_{i,j} z_{ij} − log m.

    One softmax over all logits of the (global) batch. No parameters.
    """

    pols = True

    # initial bias None (Loss): adding one constant to every logit of the batch leaves the loss unchanged

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits, target = gather_batch(logits, target)  # [m, C], [m]
        m = logits.shape[0]
        return -true_logits(logits, target).mean() + torch.logsumexp(logits.flatten(), dim=0) - math.log(m)

    def sharded(self, z: torch.Tensor, shard) -> torch.Tensor:
        """The same loss from this rank's columns z [B, D_r] of the (already global) batch."""
        return -shard.true_logits(z).mean() + shard.logsumexp_all(z) - math.log(z.shape[0])


@register_loss("batch_max_margin")
class BatchMaxMargin(SmoothHinge):
    """(1/m)·max(0, γ − z⁺ + z⁻) + mean_i max_margin_i, z⁺ = min true logit, z⁻ = max false logit
    of the (global) batch. Default gamma=1; tau=0, anneal=0 (the SmoothHinge option, off: with
    tau > 0 every max is τ·logsumexp(·/τ) and the min −τ·logsumexp(−·/τ)).
    """

    pols = True

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits, target = gather_batch(logits, target)  # [m, C], [m]
        return self._from(true_logits(logits, target), smooth_max(false_logits(logits, target), self.current_tau))

    def sharded(self, z: torch.Tensor, shard) -> torch.Tensor:
        """The same loss from this rank's columns z [B, D_r] of the (already global) batch."""
        return self._from(shard.true_logits(z), shard_false_max(z, shard, self.current_tau))

    def _from(self, z_true: torch.Tensor, z_false_max: torch.Tensor) -> torch.Tensor:  # [m], [m] -> scalar
        """z_false_max: each example's (smooth) max false logit; their (smooth) max is the batch's,
        since τ·logsumexp composes: τ·LSE_i(τ·LSE_j(z_ij/τ)/τ) = τ·LSE_ij(z_ij/τ)."""
        tau = self.current_tau
        z_plus, z_minus = -smooth_max(-z_true, tau, dim=None), smooth_max(z_false_max, tau, dim=None)
        batch_term = F.relu(self.gamma - z_plus + z_minus) / z_true.shape[0]
        return batch_term + F.relu(self.gamma - z_true + z_false_max).mean()


@register_loss("lgl_inr")
class LogisticInNegativeReweighted(Loss):
    """LGL-INR (Li et al., Eq. 11) summed over target classes j, on the (global) batch.

    Σ_{k present} −mean_{i∈S_k} log σ(z_ik)
      + Σ_j Σ_{k present, k≠j} λ_kj · (−mean_{i∈S_k} log(1 − σ(z_ij))),
    λ_{·j} = softmax over present k≠j of β·mean_{i∈S_k} σ(z_ij); S_k = batch examples of
    class k. Classes absent from the batch are skipped; a sum, not divided by C or B.
    Defaults beta=1 (the paper's choice), detach_weights=False (λ gets gradient too;
    True treats λ as constants, as a pure reweighting).
    """

    pols = True

    def __init__(self, num_classes: int, beta: float = 1.0, detach_weights: bool = False):
        super().__init__(num_classes)
        if beta < 0:
            raise ValueError("beta must be >= 0")
        self.beta, self.detach_weights = float(beta), bool(detach_weights)

    def initial_bias(self, num_classes: int, batch_size: int | None = None) -> float | None:
        """log(P/C), P the expected number of classes present in a batch: at equal logits b the
        loss is P·softplus(−b) + C·softplus(b) (each column's negative weights λ sum to 1), which
        is smallest there. Without the batch size None (0), far nearer that optimum than bce's
        −log(C − 1) for any usual batch (at 2,000 classes, from a zero head: accuracy 0.37 with bce's constant, 0.69 with this one)."""
        if batch_size is None:
            return None
        present = min(expected_present(num_classes, batch_size), self.num_classes)
        return math.log(present / self.num_classes)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits, target = gather_batch(logits, target)  # [m, C], [m]
        return self._terms(logits, target, torch.arange(logits.shape[1], device=logits.device))

    def sharded(self, z: torch.Tensor, shard) -> torch.Tensor:
        """The same sum from this rank's columns z [m, D_r]: every term belongs to one column j."""
        return shard.sum(self._terms(z, shard.targets, shard.class_ids(z.device)))

    def _terms(self, logits: torch.Tensor, target: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
        """The loss's terms of the columns `classes` [C'] (global ids) of logits [m, C']."""
        # Only the P <= m classes present in the batch have an S_k: work on [P, C'], never [C, C].
        present = torch.unique(target)  # [P], sorted class ids
        members = (target[:, None] == present[None, :]).to(logits.dtype)  # [m, P]
        class_mean = members.t() / members.sum(dim=0)[:, None]  # [P, m]: row k averages over S_k

        here = torch.isin(present, classes)  # [P]: present classes among these columns
        cols = torch.searchsorted(classes, present[here])  # their positions (classes is sorted)
        pos_loss = -(class_mean[here] * F.logsigmoid(logits[:, cols]).t()).sum(dim=1)  # −mean_{S_k} log σ(z_ik)
        neg_loss = class_mean @ (-F.logsigmoid(-logits))  # [P, C']: −mean_{S_k} log(1 − σ(z_ij))
        hardness = self.beta * (class_mean @ torch.sigmoid(logits))  # [P, C']: β·mean_{S_k} σ(z_ij)

        # λ[k, j]: softmax over present k ≠ j (column j); a column with no such k gets zeros.
        eligible = present[:, None] != classes[None, :]  # [P, C']
        shift = hardness.detach().masked_fill(~eligible, float("-inf")).amax(dim=0)  # [C']
        shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
        expo = torch.exp((hardness - shift).masked_fill(~eligible, float("-inf")))  # [P, C'], 0 where not eligible
        weights = expo / expo.sum(dim=0).clamp_min(torch.finfo(logits.dtype).tiny)  # [P, C']
        if self.detach_weights:
            weights = weights.detach()

        return pos_loss.sum() + (weights * neg_loss).sum()
