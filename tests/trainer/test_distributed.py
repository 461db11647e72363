"""Batch losses under torch.distributed (2 CPU ranks, gloo) equal the single-process loss on the
global batch, and the gradient convention of trainer/distributed.py gives the single-process
gradient: raw logits get world_size × ∂L/∂z_local; DDP-averaged parameter gradients equal
the single-process parameter gradients.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.distributed import exit_rank
from trainer.losses import build_loss

torch.set_num_threads(1)

WORLD = 2
C, D = 4, 3
BATCH_LOSSES = ["batch_ce", "batch_max_margin", "lgl_inr"]
UNEQUAL = [0, 5, 8]  # rank r holds rows UNEQUAL[r]:UNEQUAL[r+1] of the 8-row global batch
EQUAL = [0, 4, 8]


def global_batch():
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(8, C, generator=gen, dtype=torch.float64)
    target = torch.tensor([0, 1, 2, 0, 1, 3, 3, 2])
    inputs = torch.randn(8, D, generator=gen, dtype=torch.float64)
    return logits, target, inputs


def linear_model():
    torch.manual_seed(1)
    return torch.nn.Linear(D, C).double()


def _average_gradients(model: torch.nn.Module) -> None:
    """What DDP does to parameter gradients: all-reduce and divide by the world size."""
    for param in model.parameters():
        dist.all_reduce(param.grad)
        param.grad /= WORLD


def _worker(rank: int, init_file: str, out_dir: str, use_ddp: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        logits, target, inputs = global_batch()
        results = {}
        for name in BATCH_LOSSES:
            lo, hi = UNEQUAL[rank], UNEQUAL[rank + 1]
            shard = logits[lo:hi].clone().requires_grad_(True)
            value = build_loss(name, C)(shard, target[lo:hi])
            value.backward()
            results[f"{name}_value"] = value.detach().numpy()
            results[f"{name}_grad"] = shard.grad.numpy()

            # Parameter gradients averaged over ranks, by DDP itself (its import of torch._dynamo
            # costs ~10 s, hence the slow test) or by the same all-reduce-and-divide.
            lo, hi = EQUAL[rank], EQUAL[rank + 1]
            if use_ddp:
                model = torch.nn.parallel.DistributedDataParallel(linear_model())
                build_loss(name, C)(model(inputs[lo:hi]), target[lo:hi]).backward()
                model = model.module
            else:
                model = linear_model()
                build_loss(name, C)(model(inputs[lo:hi]), target[lo:hi]).backward()
                _average_gradients(model)
            results[f"{name}_ddp_weight_grad"] = model.weight.grad.numpy()
            results[f"{name}_ddp_bias_grad"] = model.bias.grad.numpy()
        np.savez(f"{out_dir}/rank{rank}.npz", **results)
    finally:
        dist.destroy_process_group()
    exit_rank()  # results written: no interpreter teardown (a rank can abort in it)


def run_ranks(tmp, use_ddp: bool) -> list[dict]:
    # fork: the children inherit the imported torch, which keeps this test at a few seconds.
    mp.start_processes(_worker, args=(str(tmp / "rendezvous"), str(tmp), use_ddp), nprocs=WORLD, join=True,
                       start_method="fork")
    return [dict(np.load(tmp / f"rank{r}.npz")) for r in range(WORLD)]


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("dist"), use_ddp=False)


def single_process_parameter_gradients(name):
    _, target, inputs = global_batch()
    model = linear_model()
    build_loss(name, C)(model(inputs), target).backward()
    return model.weight.grad.numpy(), model.bias.grad.numpy()


@pytest.mark.parametrize("name", BATCH_LOSSES)
def test_value_and_logit_gradient_match_global_batch(rank_results, name):
    logits, target, _ = global_batch()
    logits.requires_grad_(True)
    value = build_loss(name, C)(logits, target)
    value.backward()
    for rank, res in enumerate(rank_results):
        assert res[f"{name}_value"] == pytest.approx(value.item(), rel=1e-12)
        lo, hi = UNEQUAL[rank], UNEQUAL[rank + 1]
        np.testing.assert_allclose(res[f"{name}_grad"], WORLD * logits.grad[lo:hi].numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", BATCH_LOSSES)
def test_averaged_parameter_gradient_matches_single_process(rank_results, name):
    weight_grad, bias_grad = single_process_parameter_gradients(name)
    for res in rank_results:
        np.testing.assert_allclose(res[f"{name}_ddp_weight_grad"], weight_grad, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(res[f"{name}_ddp_bias_grad"], bias_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_real_ddp_parameter_gradient_matches_single_process(tmp_path):
    results = run_ranks(tmp_path, use_ddp=True)
    for name in BATCH_LOSSES:
        weight_grad, bias_grad = single_process_parameter_gradients(name)
        for res in results:
            np.testing.assert_allclose(res[f"{name}_ddp_weight_grad"], weight_grad, rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(res[f"{name}_ddp_bias_grad"], bias_grad, rtol=1e-10, atol=1e-12)


def test_without_process_group_gather_is_identity():
    from trainer.distributed import all_gather_with_grad, gather_batch, is_distributed

    logits, target, _ = global_batch()
    assert not is_distributed()
    assert all_gather_with_grad(logits) is logits
    z, y = gather_batch(logits, target)
    assert z is logits and y is target
