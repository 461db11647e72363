"""`slc bench head`: the time of one training step of the class head (logits, loss, backward) on
fixed features, full head against the sampled head (trainer/sampled_head.py) and the head
sharded over 2 processes (trainer/sharded_head.py), as D grows; and whole training steps of the
glyph network (images/s) the same three ways.

Features h [B, d] are fixed random vectors: the backbone's cost does not depend on D, the
head's does, and that is what is measured. The full and sampled heads run in this process on
all its CPU threads; the 2 shards run as 2 gloo processes with threads split between them, so
the three use the same cores.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from tools.report import md_table
from trainer.losses import build_loss
from trainer.sampled_head import ClassSampler

SHARDS = 2


def _step_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (allocations)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def head_step_times(num_classes: int, dim: int = 256, batch: int = 128, rate: float = 0.1, loss: str = "ce",
                    repeats: int = 5, seed: int = 0) -> dict:
    """Median seconds per step: full head, sampled head at `rate`, SHARDS shards; and their ratios."""
    t_full, t_sampled, size = _local_head_times(num_classes, dim, batch, rate, loss, repeats, seed)
    t_shard = run_sharded({"kind": "head", "classes": num_classes, "dim": dim, "batch": batch, "loss": loss,
                           "repeats": repeats, "seed": seed})
    return {"classes": num_classes, "dim": dim, "batch": batch, "rate": rate, "sampled_columns": size,
            "loss": loss, "full_ms": 1e3 * t_full, "sampled_ms": 1e3 * t_sampled, "full_over_sampled": t_full / t_sampled,
            "shards": SHARDS, "sharded_ms": 1e3 * t_shard, "full_over_sharded": t_full / t_shard,
            "rows_per_rank": -(-num_classes // SHARDS)}


def _local_head_times(num_classes: int, dim: int, batch: int, rate: float, loss: str, repeats: int,
                      seed: int) -> tuple[float, float, int]:
    """(full, sampled) median seconds per step in this process, and the sampled column count."""
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(num_classes, dim, generator=g) / dim ** 0.5).requires_grad_(True)  # [D, d]
    bias = torch.zeros(num_classes, requires_grad=True)  # [D]
    h = torch.randn(batch, dim, generator=g)  # [B, d]
    y = torch.randint(0, num_classes, (batch,), generator=g)  # [B]
    sampler = ClassSampler(num_classes, rate, batch, seed)
    full_loss, sampled_loss = build_loss(loss, num_classes), build_loss(loss, sampler.size)

    def full():
        weight.grad = bias.grad = None
        full_loss(h @ weight.T + bias, y).backward()  # logits [B, D]

    def sampled():
        weight.grad = bias.grad = None
        cols = sampler(y)  # [K]
        logits = h @ torch.index_select(weight, 0, cols).T + torch.index_select(bias, 0, cols)  # [B, K]
        sampled_loss(logits, ClassSampler.positions(cols, y)).backward()

    return _step_seconds(full, repeats), _step_seconds(sampled, repeats), sampler.size


def run_sharded(job: dict) -> float:
    """Median seconds per step of `job` on SHARDS gloo processes (the slowest rank's)."""
    import torch.multiprocessing as mp

    job = {**job, "threads": max(1, torch.get_num_threads() // SHARDS)}
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank_main, args=(f"{tmp}/rendezvous", tmp, job), nprocs=SHARDS, join=True,
                           start_method="spawn")
        return max(float(Path(tmp, f"rank{r}.txt").read_text()) for r in range(SHARDS))


def _rank_main(rank: int, init_file: str, out_dir: str, job: dict) -> None:
    import torch.distributed as dist

    from trainer.distributed import exit_rank

    torch.set_num_threads(job["threads"])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=SHARDS)
    step = _sharded_head_step(job, rank) if job["kind"] == "head" else _sharded_train_step(job, rank)

    def synced():
        dist.barrier()
        step()

    Path(out_dir, f"rank{rank}.txt").write_text(repr(_step_seconds(synced, job["repeats"])))
    dist.barrier()  # both ranks' figures are written before either leaves the group
    exit_rank()


def _sharded_head_step(job: dict, rank: int):
    """One step of this rank's rows on its half of fixed features (trainer/sharded_head.py)."""
    from trainer.distributed import all_gather_no_grad, all_gather_with_grad
    from trainer.sharded_head import Shard, shard_bounds

    D, dim, batch = job["classes"], job["dim"], job["batch"]
    g = torch.Generator().manual_seed(job["seed"] + rank)
    start, stop = shard_bounds(D, rank, SHARDS)
    weight = (torch.randn(stop - start, dim, generator=g) / dim ** 0.5).requires_grad_(True)  # [D_r, d]
    bias = torch.zeros(stop - start, requires_grad=True)
    h = torch.randn(batch // SHARDS, dim, generator=g, requires_grad=True)  # [B_r, d]
    y = torch.randint(0, D, (batch // SHARDS,), generator=g)
    loss = build_loss(job["loss"], D)

    def step():
        weight.grad = bias.grad = h.grad = None
        features, targets = all_gather_with_grad(h), all_gather_no_grad(y)  # [B, d], [B]
        loss.sharded(features @ weight.T + bias, Shard.of_rank(D, targets)).backward()

    return step


def _glyph_model(num_classes: int, width: int, embed: int):
    from trainer.runs import build_model

    return build_model("resnet_glyph", {"width": width, "embed": embed}, (1, 32, 32), num_classes, 128.0, 64.0).train()


def train_step_rates(num_classes: int, batch: int = 256, rate: float = 0.1, loss: str = "ce", width: int = 16,
                     embed: int = 256, repeats: int = 5, seed: int = 0) -> dict:
    """Training images/s of the glyph network (forward, loss, backward, Adam step): full head,
    sampled head at `rate`, and SHARDS sharded processes."""
    t_full, t_sampled = _local_train_times(num_classes, batch, rate, loss, width, embed, repeats, seed)
    t_shard = run_sharded({"kind": "train", "classes": num_classes, "batch": batch, "loss": loss, "width": width,
                           "embed": embed, "repeats": repeats, "seed": seed})
    return {"classes": num_classes, "batch": batch, "loss": loss, "rate": rate, "width": width, "embed": embed,
            "full_images_s": batch / t_full, "sampled_images_s": batch / t_sampled, "sharded_images_s": batch / t_shard}


def _local_train_times(num_classes: int, batch: int, rate: float, loss: str, width: int, embed: int, repeats: int,
                       seed: int) -> tuple[float, float]:
    torch.manual_seed(seed)
    model = _glyph_model(num_classes, width, embed)
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    x = torch.rand(batch, 1, 32, 32) * 255  # [B, 1, 32, 32] raw pixels
    y = torch.randint(0, num_classes, (batch,))
    sampler = ClassSampler(num_classes, rate, batch, seed)
    full_loss, sampled_loss = build_loss(loss, num_classes), build_loss(loss, sampler.size)

    def full():
        optimizer.zero_grad(set_to_none=True)
        full_loss(model(x), y).backward()
        optimizer.step()

    def sampled():
        optimizer.zero_grad(set_to_none=True)
        cols = sampler(y)
        sampled_loss(model(x, cols), ClassSampler.positions(cols, y)).backward()
        optimizer.step()

    return _step_seconds(full, repeats), _step_seconds(sampled, repeats)


def _sharded_train_step(job: dict, rank: int):
    """One training step of the glyph network with this rank's head rows and half the batch."""
    from trainer.distributed import all_gather_no_grad, all_gather_with_grad, sum_gradients
    from trainer.sharded_head import Shard, keep_shard

    D, batch = job["classes"], job["batch"]
    torch.manual_seed(job["seed"])
    model = _glyph_model(D, job["width"], job["embed"])
    model.head = keep_shard(model.head, D)
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    x = torch.rand(batch // SHARDS, 1, 32, 32) * 255
    y = torch.randint(0, D, (batch // SHARDS,))
    loss = build_loss(job["loss"], D)

    def step():
        optimizer.zero_grad(set_to_none=True)
        features, targets = all_gather_with_grad(model.embed(x)), all_gather_no_grad(y)  # [B, d], [B]
        loss.sharded(model.head(features), Shard.of_rank(D, targets)).backward()
        sum_gradients(model.backbone.parameters())
        optimizer.step()

    return step


def head_bench_markdown(rows: list[dict], train_rows: list[dict], command: str) -> str:
    threads = torch.get_num_threads()
    lines = ["# Training at many classes: full head vs sampled head vs sharded head", "", f"Command: `{command}`", "",
             "Machine: 2 shared CPU cores, no GPU. Medians of the repeats, every column of a row measured in the same "
             f"run. Full and sampled heads: one process, {threads} torch threads. Sharded: {SHARDS} gloo processes on "
             f"the same cores ({max(1, threads // SHARDS)} thread(s) each), each holding D/{SHARDS} class rows and "
             "half of the batch; the slowest rank's time.", "",
             "## Head time per step on fixed features", "",
             "One step = logits, loss, backward of the head; features h [B, d] are fixed (the backbone's cost does "
             "not depend on D).", "",
             md_table(["D", "d", "B", "loss", "R", "sampled columns", "full ms", "sampled ms", f"{SHARDS} shards ms",
                       "full / sampled", f"full / {SHARDS} shards", "head rows per rank"],
                      [[f"{r['classes']:,}", r["dim"], r["batch"], r["loss"], f"{r['rate']:g}", f"{r['sampled_columns']:,}",
                        f"{r['full_ms']:.1f}", f"{r['sampled_ms']:.1f}", f"{r['sharded_ms']:.1f}", f"{r['full_over_sampled']:.1f}",
                        f"{r['full_over_sharded']:.2f}", f"{r['rows_per_rank']:,}"] for r in rows], "rrrlrrrrrrrr")]
    if train_rows:
        lines += ["", "## Whole training steps of the glyph network (images/s)", "",
                  "`resnet_glyph` (pooled 4×4 grid, 256-d embedding), random 32×32 images, Adam; forward, loss, "
                  "backward and optimizer step.", "",
                  md_table(["D", "B", "width", "loss", "full head", "sampled R", "sampled head", f"{SHARDS} shards"],
                           [[f"{r['classes']:,}", r["batch"], r["width"], r["loss"], f"{r['full_images_s']:.0f}", f"{r['rate']:g}",
                             f"{r['sampled_images_s']:.0f}", f"{r['sharded_images_s']:.0f}"] for r in train_rows],
                           "rrrlrrrr")]
    lines += ["", "Reading: the sampled head computes R·D logits, but its gradient is still a dense [D, d] tensor (zeros "
              "outside the sampled rows), and Adam then updates all D rows: both cost O(D·d) per step, which caps the "
              "gain below 1/R. Sharding splits the head's rows, logits and optimizer state over ranks (each holds "
              f"D/{SHARDS}), so its gain is memory per rank and, on machines with a core per rank, time; on these 2 "
              "shared cores the two processes compete with each other, and the gathers and all-reduces are extra "
              "work, so the time ratio here says little about a real multi-GPU run.", ""]
    return "\n".join(lines)
