"""The class-sharded head of Partial FC (An et al.): under torchrun, rank r holds only the class
rows [start, stop) of W and b, and no rank ever holds the [B, D] logit matrix.

One step (trainer/train.py, `--head-shard`):
    h_r = backbone(x_r)              [B_r, d]    this rank's examples
    H   = all_gather(h_r)            [B, d]      every rank sees the global batch's features
    Z_r = H @ W_r.T + b_r            [B, D_r]    this rank's classes only
    L   = loss.sharded(Z_r, shard)   scalar, the same on every rank: each reduction over
                                     classes (max, logsumexp, sums over negatives, the true
                                     logit) is an all-reduce (the methods of `Shard`)
Backward: the all-reduces pass gradients through unchanged (trainer.distributed.all_reduce_sum),
so rank r's backward gives exactly ∂L/∂W_r for its rows and the part of ∂L/∂H that flows through
its classes; the gather's backward sums those parts, and `sum_gradients` sums the backbone's.
With one rank (`Shard.full`), every method is the ordinary dense computation.

The identity backward is exact because every loss here only *adds up* per-rank terms after its
reductions (log of a summed normaliser, a summed true logit, sums over negatives). A loss that
fed an all-reduced value back into per-class terms reduced again (Σ_j f(z_ij − z_iy)) would need
a summing backward instead: check that before adding a `sharded` method.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trainer.distributed import all_reduce_max, all_reduce_sum, is_distributed


def shard_bounds(num_classes: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of rank's rows: contiguous, sizes differing by at most one."""
    if num_classes < world:
        raise ValueError(f"{num_classes} classes cannot be sharded over {world} ranks")
    base, extra = divmod(num_classes, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _rank_world() -> tuple[int, int]:
    if not is_distributed():
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


@dataclass
class Shard:
    """This rank's slice of the classes, and the global batch's targets seen from it."""

    num_classes: int
    start: int
    stop: int
    targets: torch.Tensor  # [B] global class ids of the global batch
    local: torch.Tensor = field(init=False)  # [B] target's column in this shard, or -1
    owns: torch.Tensor = field(init=False)  # [B] bool: the target is one of this shard's classes

    def __post_init__(self) -> None:
        self.owns = (self.targets >= self.start) & (self.targets < self.stop)
        self.local = torch.where(self.owns, self.targets - self.start, torch.full_like(self.targets, -1))

    @classmethod
    def of_rank(cls, num_classes: int, targets: torch.Tensor) -> "Shard":
        rank, world = _rank_world()
        return cls(num_classes, *shard_bounds(num_classes, rank, world), targets)

    @classmethod
    def full(cls, num_classes: int, targets: torch.Tensor) -> "Shard":
        return cls(num_classes, 0, num_classes, targets)

    @property
    def size(self) -> int:
        return self.stop - self.start

    def columns(self, per_class: torch.Tensor) -> torch.Tensor:
        """This shard's slice of a per-class tensor [D, ...] -> [D_r, ...]."""
        return per_class[self.start:self.stop]

    def class_ids(self, device=None) -> torch.Tensor:
        return torch.arange(self.start, self.stop, device=device)  # [D_r]

    @staticmethod
    def sum(t: torch.Tensor) -> torch.Tensor:
        """Σ over ranks (identity backward)."""
        return all_reduce_sum(t)

    def true_logits(self, z: torch.Tensor) -> torch.Tensor:
        """z_{i, y_i} of the full head, [B, D_r] -> [B]: the owner contributes, the others add 0."""
        mine = z.gather(1, self.local.clamp(min=0)[:, None]).squeeze(1)  # [B]
        return self.sum(torch.where(self.owns, mine, torch.zeros_like(mine)))

    def logsumexp(self, z: torch.Tensor) -> torch.Tensor:
        """logsumexp over all D classes, [B, D_r] -> [B]."""
        shift = all_reduce_max(z.amax(dim=1))  # [B], no gradient (any shift is exact)
        return shift + torch.log(self.sum(torch.exp(z - shift[:, None]).sum(dim=1)))

    def logsumexp_all(self, z: torch.Tensor) -> torch.Tensor:
        """logsumexp over every logit of the batch, [B, D_r] -> scalar."""
        shift = all_reduce_max(z.amax())
        return shift + torch.log(self.sum(torch.exp(z - shift).sum()))

    def max_false(self, z: torch.Tensor) -> torch.Tensor:
        """max_{j≠y_i} z_ij of the full head, [B, D_r] -> [B]. The gradient goes to the one rank
        holding the maximum (the lowest such rank on a tie across ranks)."""
        is_true = torch.zeros_like(z, dtype=torch.bool)
        is_true[self.owns, self.local[self.owns]] = True
        mine = z.masked_fill(is_true, float("-inf")).amax(dim=1)  # [B], -inf if no false class here
        best = all_reduce_max(mine)  # [B]
        rank, world = _rank_world()
        candidate = torch.where(mine == best, torch.full_like(best, rank), torch.full_like(best, world))
        owner = -all_reduce_max(-candidate)  # [B] lowest rank holding the max
        return self.sum(torch.where(owner == rank, mine, torch.zeros_like(mine)))


def sharded_losses() -> list[str]:
    """Losses with a `sharded(z, shard)` form: ce, max_margin and every PoLS loss."""
    from trainer.losses import list_losses, loss_class

    return [name for name in list_losses() if hasattr(loss_class(name), "sharded")]


def keep_shard(head, num_classes: int):
    """Replace a full ClassHead by this rank's rows (a ClassHead of D_r rows), so sharded training
    starts from the very head a single process would (the full head exists once, at start)."""
    from models import ClassHead

    rank, world = _rank_world()
    start, stop = shard_bounds(num_classes, rank, world)
    with torch.random.fork_rng():  # the shard's own init draws would leave ranks' random streams apart
        shard = ClassHead(head.weight.shape[1], stop - start)
    with torch.no_grad():
        shard.weight.copy_(head.weight[start:stop])
        shard.bias.copy_(head.bias[start:stop])
    return shard


def gather_head(shard_head, num_classes: int):
    """The full ClassHead on rank 0 from every rank's rows (None on the other ranks)."""
    from models import ClassHead

    rank, world = _rank_world()
    if world == 1:
        return shard_head
    import torch.distributed as dist

    rows = max(stop - start for start, stop in (shard_bounds(num_classes, r, world) for r in range(world)))
    dim = shard_head.weight.shape[1]
    mine = torch.zeros(rows, dim + 1, device=shard_head.weight.device)  # [rows, d + 1]: weight | bias, padded to the largest shard
    mine[:shard_head.weight.shape[0], :dim] = shard_head.weight.detach()
    mine[:shard_head.weight.shape[0], dim] = shard_head.bias.detach()
    parts = [torch.empty_like(mine) for _ in range(world)] if rank == 0 else None
    dist.gather(mine, parts, dst=0)
    if rank != 0:
        return None
    full = torch.cat([p[:stop - start] for p, (start, stop) in zip(parts, (shard_bounds(num_classes, r, world) for r in range(world)))])
    head = ClassHead(dim, num_classes).to(full.device)
    with torch.no_grad():
        head.weight.copy_(full[:, :dim])
        head.bias.copy_(full[:, dim])
    return head
