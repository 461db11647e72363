"""The class-sharded head (trainer/sharded_head.py): with 2 gloo ranks, each holding half of the
class rows and half of the batch, the loss and the backbone and head gradients equal the
single-process loss on the full head, in float64, for ce and every PoLS loss."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.distributed import all_gather_no_grad, all_gather_with_grad, exit_rank, sum_gradients
from trainer.losses import build_loss
from trainer.sharded_head import Shard, shard_bounds, sharded_losses

WORLD = 2
N_IN, DIM, CLASSES, BATCH = 6, 5, 11, 12  # 11 classes: shards of 6 and 5 rows


def _problem():
    """A linear backbone, a full head and a global batch (with classes repeated and absent)."""
    gen = torch.Generator().manual_seed(3)
    backbone = torch.nn.Linear(N_IN, DIM).double()
    with torch.no_grad():
        backbone.weight.copy_(torch.randn(DIM, N_IN, generator=gen, dtype=torch.float64))
        backbone.bias.copy_(torch.randn(DIM, generator=gen, dtype=torch.float64))
    weight = torch.randn(CLASSES, DIM, generator=gen, dtype=torch.float64)
    bias = torch.randn(CLASSES, generator=gen, dtype=torch.float64)
    x = torch.randn(BATCH, N_IN, generator=gen, dtype=torch.float64)
    y = torch.tensor([0, 3, 3, 7, 10, 1, 0, 5, 9, 9, 2, 7])
    return backbone, weight, bias, x, y


def _losses():
    return [(name, {}) for name in sharded_losses()] + [("nce", {"mode": "sampled"})]


def _dense(name, params, backbone, weight, bias, x, y):
    """Reference: one process, the full head. x, y in the order the ranks gather them."""
    w = weight.clone().requires_grad_(True)
    b = bias.clone().requires_grad_(True)
    backbone.zero_grad()
    torch.manual_seed(11)  # nce's sampled noise: the same draws as the ranks
    loss = build_loss(name, CLASSES, **params)(backbone(x) @ w.T + b, y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in backbone.parameters()], w.grad, b.grad


def _sharded(name, params, backbone, weight, bias, x, y, rank):
    lo, hi = shard_bounds(CLASSES, rank, WORLD)
    w = weight[lo:hi].clone().requires_grad_(True)  # this rank's rows only
    b = bias[lo:hi].clone().requires_grad_(True)
    backbone.zero_grad()
    h = backbone(x[rank::WORLD])  # [B_r, d]: this rank's examples
    features, targets = all_gather_with_grad(h), all_gather_no_grad(y[rank::WORLD])  # [B, d], [B]
    torch.manual_seed(11)
    loss = build_loss(name, CLASSES, **params).sharded(features @ w.T + b, Shard.of_rank(CLASSES, targets))
    loss.backward()
    sum_gradients(backbone.parameters())
    return loss.detach(), [p.grad.clone() for p in backbone.parameters()], w.grad, b.grad


def _key(name: str, params: dict) -> str:
    return name + "".join(f"_{v}" for v in params.values())


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        backbone, weight, bias, x, y = _problem()
        results = {}
        for name, params in _losses():
            value, grads, w_grad, b_grad = _sharded(name, params, backbone, weight, bias, x, y, rank)
            for i, t in enumerate([value, *grads, w_grad, b_grad]):
                results[f"{_key(name, params)}/{i}"] = t.numpy()
        np.savez(f"{out_dir}/rank{rank}.npz", **results)
    finally:
        dist.destroy_process_group()
    exit_rank()  # results written: no interpreter teardown (a rank can abort in it)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """What each rank computed: {key/i: loss, backbone grads..., its head rows' grads}."""
    tmp = tmp_path_factory.mktemp("sharded")
    mp.start_processes(_worker, args=(str(tmp / "rendezvous"), str(tmp)), nprocs=WORLD, join=True,
                       start_method="fork")
    return [dict(np.load(tmp / f"rank{r}.npz")) for r in range(WORLD)]


@pytest.mark.integration
@pytest.mark.parametrize("name,params", _losses(), ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v.values())))
def test_two_shards_equal_the_full_head(two_ranks, name, params):
    """Loss, backbone gradients and each rank's head-row gradients = the full head's, to 1e-10."""
    backbone, weight, bias, x, y = _problem()
    order = torch.cat([torch.arange(BATCH)[r::WORLD] for r in range(WORLD)])  # the gathered batch's order
    value, grads, w_grad, b_grad = _dense(name, params, backbone, weight, bias, x[order], y[order])
    assert float(w_grad.abs().max()) > 1e-3 and float(grads[0].abs().max()) > 1e-3  # not trivially equal
    for rank, got in enumerate(two_ranks):
        lo, hi = shard_bounds(CLASSES, rank, WORLD)
        want = [value, *grads, w_grad[lo:hi], b_grad[lo:hi]]
        for i, ref in enumerate(want):
            np.testing.assert_allclose(got[f"{_key(name, params)}/{i}"], ref.numpy(), rtol=0, atol=1e-10,
                                       err_msg=f"rank {rank}, tensor {i} (0 loss, 1-2 backbone, 3-4 head rows)")


def test_the_sharded_losses_are_ce_max_margin_and_every_pols_loss():
    from trainer.losses import list_losses

    pols = {n for n in list_losses() if getattr(build_loss(n, 10), "pols", False)}
    assert set(sharded_losses()) == {"ce", "max_margin"} | pols


@pytest.mark.parametrize("name", sharded_losses())
def test_one_shard_is_the_dense_loss(name):
    """Without a process group, the sharded form over all classes is the loss itself (float64)."""
    gen = torch.Generator().manual_seed(0)
    z = (3 * torch.randn(9, 7, generator=gen, dtype=torch.float64)).requires_grad_(True)
    y = torch.tensor([0, 1, 1, 6, 2, 2, 2, 5, 0])
    loss = build_loss(name, 7)
    dense = loss(z, y)
    (g_dense,) = torch.autograd.grad(dense, z)
    sharded = loss.sharded(z, Shard.full(7, y))
    (g_sharded,) = torch.autograd.grad(sharded, z)
    torch.testing.assert_close(sharded, dense, rtol=0, atol=1e-12)
    torch.testing.assert_close(g_sharded, g_dense, rtol=0, atol=1e-12)


@pytest.mark.parametrize("classes,world", [(11, 2), (8, 2), (10, 3), (3, 3), (1000, 7)])
def test_shard_bounds_cover_every_class_once(classes, world):
    rows = [list(range(*shard_bounds(classes, r, world))) for r in range(world)]
    assert sum(rows, []) == list(range(classes))
    assert max(map(len, rows)) - min(map(len, rows)) <= 1


def test_more_ranks_than_classes_is_refused():
    with pytest.raises(ValueError, match="cannot be sharded"):
        shard_bounds(2, 0, 3)
