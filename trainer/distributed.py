"""Data-parallel helpers for losses defined on the whole batch (docs/losses.md).

`batch_ce`, `batch_max_margin` and `lgl_inr` couple all examples of a batch, so under
`torch.distributed` every rank gathers the logits and targets of all ranks and computes
the loss of the *global* batch; its value is then identical on every rank and equal to the
single-process loss on the concatenated batch.

Gradient convention (why no manual scaling is needed): each rank's loss is the same number
L(global batch), so the objective summed over ranks is world_size · L. The backward of
`all_gather_with_grad` is the adjoint of the gather for that summed objective: it all-reduces
(SUM) the gradient of the gathered tensor and hands each rank its own slice, i.e. the local
logits receive world_size · ∂L/∂z_local. DistributedDataParallel then *averages* parameter
gradients over ranks, dividing by world_size, so the parameters get exactly the gradient
of L on the global batch. (Without DDP averaging, divide by world_size yourself.)
Per-example losses need no gathering: DDP's average of local means is the global mean
when shards are equal.
"""
from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """True when a process group with more than one rank is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def exit_rank() -> NoReturn:
    """End a worker rank whose results are written, without the interpreter's teardown.

    Left to interpreter exit, gloo's threads are torn down under the process and a rank can die
    of SIGABRT ("terminate called without an active exception") after its work is done, even
    with the process group destroyed; the launcher (torchrun, torch.multiprocessing) then fails
    the whole run. Exit status 0, output flushed.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _gather_sizes(n: int, device: torch.device) -> list[int]:
    size = torch.tensor([n], dtype=torch.long, device=device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    return [int(s.item()) for s in sizes]


def _gather_padded(t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """All-gather along dim 0, allowing different first-dimension sizes per rank."""
    longest = max(sizes)
    padded = t.new_zeros((longest, *t.shape[1:]))  # [longest, ...]
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0)  # [sum(sizes), ...]


class _AllGatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        sizes = _gather_sizes(t.shape[0], t.device)
        rank = dist.get_rank()
        ctx.start = sum(sizes[:rank])
        ctx.stop = ctx.start + sizes[rank]
        return _gather_padded(t.detach(), sizes)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        # Every rank's loss depends on every shard: sum the gradients of all ranks.
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad[ctx.start : ctx.stop]


def all_gather_with_grad(t: torch.Tensor) -> torch.Tensor:
    """Concatenate `t` [n_r, ...] of all ranks in rank order -> [Σ n_r, ...].

    Gradient flows back to the local shard (summed over ranks, see the module doc).
    Without a multi-rank process group this returns `t` unchanged.
    """
    if not is_distributed():
        return t
    return _AllGatherWithGrad.apply(t)


def all_gather_no_grad(t: torch.Tensor) -> torch.Tensor:
    """Same concatenation for tensors without gradient (e.g. targets)."""
    if not is_distributed():
        return t
    with torch.no_grad():
        return _gather_padded(t, _gather_sizes(t.shape[0], t.device))


def gather_batch(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [B_global, C], target [B_global]) of the global batch under torch.distributed."""
    if not is_distributed():
        return logits, target
    return all_gather_with_grad(logits), all_gather_no_grad(target)


class _AllReduceSum(torch.autograd.Function):
    """Forward: the sum over ranks. Backward: identity. Every rank computes the same scalar loss L
    from the reduced value, and differentiating its own copy of L through its own addend gives
    exactly ∂L/∂(its addend): no gradient crosses ranks here (the sharded head, docs/losses.md)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        out = t.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Σ over ranks of `t` (any shape), differentiable with the identity backward above."""
    if not is_distributed():
        return t
    return _AllReduceSum.apply(t)


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """Element-wise max over ranks, without gradient (used for shifts and to find owners)."""
    if not is_distributed():
        return t.detach()
    out = t.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out


def sum_gradients(params) -> None:
    """All-reduce (SUM) the gradients of replicated parameters in one flat message: each rank's
    backward gave the part of ∂L/∂θ that flows through its own head shard."""
    if not is_distributed():
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def broadcast_parameters(module: torch.nn.Module, src: int = 0) -> None:
    """Make every rank start from rank `src`'s parameters and buffers."""
    if not is_distributed():
        return
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src)
