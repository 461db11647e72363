"""The training recipe: one linear function from config to a run directory.

RUN/config.json    the resolved TrainConfig plus what it resolved to (sizes, steps, versions)
RUN/checkpoint.pt  state_dict of SLCNet (normalisation mean/std are buffers in it)
RUN/data.json      dataset name, input_shape, classes, normalisation mean/std (train split)
RUN/metrics.json   {"calibration": slc_metrics + separation, "test": ...} on raw logits

Data-parallel: under `torchrun` (WORLD_SIZE > 1 in the environment) the process group is
initialised with gloo, every rank draws the same permutation and takes its own interleaved
shard of each global batch (`batch_size` is the global batch), the model is wrapped in
DistributedDataParallel, and batch losses gather the global batch themselves
(trainer.distributed). Only rank 0 evaluates and writes.

The last incomplete batch of each epoch is dropped: batch losses and BatchNorm both need
a full batch of examples to mean what they say.
"""
from __future__ import annotations

import json
import math
import os
import platform
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from models import ClassHead, SLCNet, build_backbone
from trainer.data import Splits, load_dataset
from trainer.losses import build_loss
from trainer.metrics import head_chunks, pooled_separation, slc_metrics, streaming_slc_metrics
from trainer.distributed import all_gather_no_grad, all_gather_with_grad, broadcast_parameters, sum_gradients
from trainer.sampled_head import ClassSampler
from trainer.sharded_head import Shard, gather_head, keep_shard, sharded_losses


OPTIMIZERS = ("adam", "sgd")
SCHEDULES = ("cosine", "constant")


@dataclass
class TrainConfig:
    dataset: str
    backbone: str = "mlp"
    backbone_params: dict = field(default_factory=dict)
    loss: str = "batch_ce"
    loss_params: dict = field(default_factory=dict)
    epochs: int = 20
    lr: float = 0.01
    batch_size: int = 128
    optimizer: str = "adam"  # adam | sgd (momentum 0.9)
    schedule: str = "cosine"  # cosine (per step, to 0) | constant
    weight_decay: float = 0.0
    seed: int = 0
    head_sample: float = 1.0  # R: logits for the batch's classes + a uniform sample, R·D columns (trainer/sampled_head.py)
    head_shard: bool = False  # each torchrun rank holds D/world class rows (trainer/sharded_head.py)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_model(backbone: str, backbone_params: dict, input_shape, num_classes: int, mean, std) -> SLCNet:
    body = build_backbone(backbone, input_shape, **backbone_params)
    head = ClassHead(body.embed_dim, num_classes)
    return SLCNet(body, head, torch.as_tensor(np.asarray(mean, dtype=np.float32)), torch.as_tensor(np.asarray(std, dtype=np.float32)))


def _optimizer(cfg: TrainConfig, params) -> torch.optim.Optimizer:
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}; known: adam, sgd")


def _schedule(cfg: TrainConfig, optimizer, total_steps: int):
    if cfg.schedule == "cosine":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1.0 + math.cos(math.pi * min(s, total_steps) / total_steps)))
    if cfg.schedule == "constant":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    raise ValueError(f"unknown schedule {cfg.schedule!r}; known: cosine, constant")


def check_head_options(cfg: TrainConfig) -> None:
    """Refuse head options that cannot work together, before any data is loaded."""
    if cfg.head_shard and cfg.loss not in sharded_losses():
        raise ValueError(f"--head-shard supports the losses {', '.join(sharded_losses())}, not {cfg.loss}")
    if cfg.head_shard and cfg.head_sample < 1.0:
        raise ValueError("--head-shard with --head-sample below 1 is not supported yet: choose one")
    if cfg.head_sample < 1.0 and cfg.loss == "nce" and cfg.loss_params.get("q") is not None:
        raise ValueError("nce with a class prior q cannot be trained with --head-sample (docs/losses.md)")


def _batch_loss(cfg: TrainConfig, net: nn.Module, model: SLCNet, loss_fn: nn.Module, sampler, x, y,
                global_idx: torch.Tensor, rank: int, world: int, num_classes: int) -> torch.Tensor:
    """The loss of one global batch as this rank computes it: full head, sampled head, or sharded."""
    idx = global_idx[rank::world]  # this rank's examples
    if cfg.head_shard:
        features = all_gather_with_grad(model.embed(x[idx]))  # [B, d]: the global batch, in rank order
        targets = all_gather_no_grad(y[idx])  # [B]
        return loss_fn.sharded(model.head(features), Shard.of_rank(num_classes, targets))  # [B, D_r]
    if sampler is None and getattr(loss_fn, "mode", None) == "sampled":  # nce: only the targets' and noise logits
        draws = loss_fn.draw_noise(len(idx))  # [B_rank, t]
        cols = torch.unique(torch.cat([y[idx], draws.flatten()]))  # [K] sorted
        pos = torch.searchsorted
        return loss_fn.on_columns(net(x[idx], cols), cols, pos(cols, y[idx]), pos(cols, draws))  # [B_rank, K]
    if sampler is None:
        return loss_fn(net(x[idx]), y[idx])  # [B_rank, D]
    cols = sampler(y[global_idx])  # [K], the same on every rank
    return loss_fn(net(x[idx], cols), ClassSampler.positions(cols, y[idx]))  # [B_rank, K]


def _distributed() -> tuple[int, int]:
    """(rank, world_size); initialises gloo when launched by torchrun with more than one rank."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


@torch.no_grad()
def run_logits(model: nn.Module, x, batch_size: int = 2048) -> np.ndarray:
    """Logits float32 [N, D] of raw inputs x [N, *shape], in eval mode, batch by batch."""
    was_training = model.training
    model.eval()
    # batch by batch from the (possibly memory-mapped, uint8) array: never a float copy of all of x
    out = [model(torch.tensor(np.asarray(x[i : i + batch_size], dtype=np.float32))) for i in range(0, len(x), batch_size)]
    model.train(was_training)
    return torch.cat(out).numpy() if out else np.zeros((0, 0), dtype=np.float32)


def split_metrics(scores: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """slc_metrics plus the pooled separation of the scores."""
    return {**slc_metrics(scores, labels), "separation": pooled_separation(scores, labels)}


DENSE_METRICS_MAX = 20_000_000  # N·D above this: metrics stream over class chunks instead of an [N, D] matrix


@torch.no_grad()
def model_metrics(model: SLCNet, x, labels: np.ndarray) -> dict[str, float]:
    """split_metrics of the model's logits on x; without an [N, D] matrix when N·D is large
    (embeddings [N, d], then logits 1,024 classes at a time: trainer.metrics.streaming_slc_metrics)."""
    num_classes = model.head.weight.shape[0]
    if len(x) * num_classes <= DENSE_METRICS_MAX:
        return split_metrics(run_logits(model, x), labels)
    was_training = model.training
    model.eval()
    h = torch.cat([model.embed(torch.tensor(np.asarray(x[i:i + 2048], dtype=np.float32)))
                   for i in range(0, len(x), 2048)]).double().numpy()  # [N, d]
    model.train(was_training)
    w = model.head.weight.detach().double().numpy()  # [D, d]
    b = model.head.bias.detach().double().numpy()  # [D]
    return streaming_slc_metrics(head_chunks(h, w, b), labels, num_classes)


def _versions() -> dict[str, str]:
    import sklearn

    try:
        from importlib.metadata import version

        slc_version = version("slc")
    except Exception:  # not installed as a distribution
        slc_version = "dev"
    return {"slc": slc_version, "torch": torch.__version__, "numpy": np.__version__, "sklearn": sklearn.__version__,
            "python": platform.python_version()}


def _data_info(cfg: TrainConfig, splits: Splits) -> dict:
    return {
        "dataset": cfg.dataset,
        "input_shape": list(splits.input_shape),
        "classes": splits.classes,
        "mean": np.asarray(splits.mean).tolist(),
        "std": np.asarray(splits.std).tolist(),
        "sizes": {name: len(splits.split(name)[1]) for name in ("train", "calibration", "test")},
    }


def train(cfg: TrainConfig, out: Path, progress: bool = True) -> Path:
    """Fit SLCNet on cfg.dataset with cfg.loss; write the run directory `out` and return it."""
    from tqdm.auto import tqdm

    out = Path(out)
    check_head_options(cfg)
    rank, world = _distributed()
    seed_everything(cfg.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)

    splits = load_dataset(cfg.dataset)
    x_train = torch.tensor(splits.train[0])  # [N, *shape] raw
    y_train = torch.tensor(splits.train[1])  # [N]
    n_train, num_classes = len(y_train), splits.num_classes

    model = build_model(cfg.backbone, cfg.backbone_params, splits.input_shape, num_classes, splits.mean, splits.std)
    sampler = ClassSampler(num_classes, cfg.head_sample, min(cfg.batch_size, n_train), cfg.seed) \
        if cfg.head_sample < 1.0 else None
    loss_fn = build_loss(cfg.loss, sampler.size if sampler else num_classes, **cfg.loss_params)
    net: nn.Module = model
    if cfg.head_shard:  # no DDP: the backbone's gradients are summed by hand (sum_gradients)
        model.head = keep_shard(model.head, num_classes)
        broadcast_parameters(model.backbone)
    elif world > 1:
        net = nn.parallel.DistributedDataParallel(model)

    batch = min(cfg.batch_size, n_train)
    if batch < 2 * world:
        raise ValueError(f"batch_size {batch} too small for {world} rank(s): every rank needs 2 examples")
    steps_per_epoch = n_train // batch  # drop the last incomplete batch
    total_steps = max(1, cfg.epochs * steps_per_epoch)
    optimizer = _optimizer(cfg, net.parameters())
    schedule = _schedule(cfg, optimizer, total_steps)
    permutation_rng = torch.Generator().manual_seed(cfg.seed)  # the same on every rank

    net.train()
    started = time.perf_counter()
    bar = tqdm(total=total_steps, desc=f"{cfg.loss} lr={cfg.lr:g}", disable=not progress or rank != 0, leave=False)
    step = 0
    for epoch in range(cfg.epochs):
        permutation = torch.randperm(n_train, generator=permutation_rng)
        for b in range(steps_per_epoch):
            global_idx = permutation[b * batch : (b + 1) * batch]
            if hasattr(loss_fn, "set_progress"):
                loss_fn.set_progress(step / total_steps)
            loss = _batch_loss(cfg, net, model, loss_fn, sampler, x_train, y_train, global_idx, rank, world, num_classes)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"loss {cfg.loss} is {loss.item()} at epoch {epoch} step {step} (lr={cfg.lr})")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.head_shard:
                sum_gradients(model.backbone.parameters())
            optimizer.step()
            schedule.step()
            step += 1
            bar.update()
            if step % 10 == 0:
                bar.set_postfix(epoch=epoch, loss=f"{loss.item():.4f}")
    bar.close()
    train_seconds = time.perf_counter() - started
    if cfg.head_shard:  # rank 0 gets the full head back: checkpoint and export see one head
        model.head = gather_head(model.head, num_classes)

    if rank == 0:
        model.eval()
        metrics = {name: model_metrics(model, *splits.split(name)) for name in ("calibration", "test")}
        out.mkdir(parents=True, exist_ok=True)
        resolved = {
            **asdict(cfg),
            "num_classes": num_classes,
            "input_shape": list(splits.input_shape),
            "embed_dim": int(model.backbone.embed_dim),
            "loss_pols": bool(getattr(loss_fn, "pols", False)),
            "steps": total_steps,
            "steps_per_epoch": steps_per_epoch,
            "world_size": world,
            "train_seconds": round(train_seconds, 1),
            "train_images_per_second": round(total_steps * batch / train_seconds, 1),
            "eval_seconds": round(time.perf_counter() - started - train_seconds, 1),
            "versions": _versions(),
        }
        (out / "config.json").write_text(json.dumps(resolved, indent=2))
        (out / "data.json").write_text(json.dumps(_data_info(cfg, splits), indent=2))
        torch.save(model.state_dict(), out / "checkpoint.pt")
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()  # every rank is here (slc train then ends it with exit_rank)
    return out


def load_run(run: Path) -> tuple[SLCNet, dict, dict]:
    """(SLCNet in eval mode, config dict, data_info dict) of a run directory."""
    run = Path(run)
    config = json.loads((run / "config.json").read_text())
    data_info = json.loads((run / "data.json").read_text())
    model = build_model(config["backbone"], config.get("backbone_params", {}), data_info["input_shape"],
                        len(data_info["classes"]), data_info["mean"], data_info["std"])
    model.load_state_dict(torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=True))
    return model.eval(), config, data_info


def evaluate_run(run: Path, split: str = "test", print_table: bool = False) -> dict[str, float]:
    """Recompute the single-logit metrics (+ separation) of a run on a split of its dataset."""
    model, config, data_info = load_run(run)
    x, y = load_dataset(data_info["dataset"]).split(split)
    metrics = model_metrics(model, x, y)
    if print_table:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"{run} — {config['loss']} on {data_info['dataset']} ({split}, {len(y)} examples)")
        table.add_column("metric")
        table.add_column("value", justify="right")
        table.add_column("1 − value", justify="right")
        for key, value in metrics.items():
            table.add_row(key, f"{value:.4f}", f"{1 - value:.4f}")
        Console().print(table)
    return metrics
