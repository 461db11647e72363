"""The training recipe: one linear function from config to a run directory.

RUN/config.json    the resolved TrainConfig plus what it resolved to (sizes, steps, device,
                   versions); `status` is running, interrupted or completed
RUN/data.json      dataset, input_shape, classes, normalisation mean/std (train split), the image
                   spec, the data's fingerprint and how to load it again
RUN/checkpoint.pt  state_dict of SLCNet (normalisation mean/std are buffers in it): the weights
                   export reads (the best validated epoch's, unless --no-restore-best)
RUN/best.pt        the best validated weights so far (per-epoch validation on the calibration split)
RUN/checkpoints/   training state every --checkpoint-every steps and at each epoch end, the last
                   --keep-checkpoints kept: `slc train --resume RUN` continues exactly from the newest
RUN/history.csv    per-step loss, lr, gradient norm; per-epoch calibration metrics (trainer/history.py)
RUN/curves.png     history.csv drawn
RUN/metrics.json   {"calibration": slc_metrics + separation, "test": ...} on raw logits

Batches come from trainer/loader.py (a DataLoader over the arrays as stored; the batch order is a
function of (seed, epoch) alone, whatever the number of workers). Device and precision:
trainer/device.py.

Data-parallel: under `torchrun` (WORLD_SIZE > 1 in the environment) the process group is
initialised (NCCL on GPUs, gloo on CPUs), every rank draws the same permutation and reads its own
interleaved share of each global batch (`batch_size` is the global batch), the model is wrapped in
DistributedDataParallel, and batch losses gather the global batch themselves
(trainer.distributed). Only rank 0 validates and writes.

The last incomplete batch of each epoch is dropped: batch losses and BatchNorm both need
a full batch of examples to mean what they say. The batch, epochs and validation cadence a user
leaves unset follow the training split's size (trainer/defaults.py), so that remainder stays small.
"""
from __future__ import annotations

import json
import math
import os
import platform
import random
import signal
import time
import dataclasses
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from models import SLCNet, backbone_input_spec, spec_normalisation
from trainer.augment import augment_generator, build_augment
from trainer.checkpoint import atomic_save, checkpoint_dir, latest_checkpoint, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from trainer.data import Splits, load_dataset
from trainer.data.imagefiles import dataset_path
from trainer.defaults import convergence, resolve_defaults
from trainer.device import autocast, check_precision, grad_scaler, process_group_backend, resolve_device
from trainer.distributed import all_gather_no_grad, all_gather_with_grad, broadcast_parameters, sum_gradients
from trainer.history import History, plot_curves
from trainer.loader import EpochBatches, batch_loader
from trainer.losses import build_loss
from trainer.run_dir import check_out, clear_run, make_out
from trainer.runs import build_model, model_metrics
from trainer.start_line import announce
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
    epochs: int | None = None  # None: 20, more on small data (trainer/defaults.py)
    lr: float = 0.01
    batch_size: int | None = None  # None: 128, less on small data (trainer/defaults.py)
    optimizer: str = "adam"  # adam | sgd (momentum 0.9)
    schedule: str = "cosine"  # cosine (per step, to 0) | constant
    weight_decay: float = 0.0
    seed: int = 0
    head_sample: float = 1.0  # R: logits for the batch's classes + a uniform sample, R·D columns (trainer/sampled_head.py)
    head_shard: bool = False  # each torchrun rank holds D/world class rows (trainer/sharded_head.py)
    max_steps: int = 0  # stop after this many steps (a budget: the schedule ends there); 0 = epochs decide
    warmup_steps: int = -1  # linear LR warmup; -1 = auto: 5% of the steps, at most 1,000
    clip_grad_norm: float = 0.0  # clip the global gradient norm to this; 0 = off (the norm is logged either way)
    device: str = "auto"  # auto | cpu | cuda[:N] (trainer/device.py)
    precision: str = "fp32"  # fp32 | bf16 | fp16 (autocast; fp16 with a gradient scaler, CUDA only)
    channels_last: bool = False  # NHWC memory layout for conv backbones
    compile: bool = False  # torch.compile the network
    workers: int = 0  # DataLoader worker processes
    augment: str | None = None  # none | geometry | ... (trainer/augment.py), image datasets; None: by trainer/defaults.py
    val_every: int | None = None  # validate every N epochs; 0 = never; None: 1, or about 20 a run (trainer/defaults.py)
    patience: int | None = None  # stop after N validations without a better one; 0 = off; None: by trainer/defaults.py
    converge: bool | None = None  # train to convergence (a budget, patience); None: by trainer/defaults.py
    restore_best: bool = True  # the run's checkpoint.pt holds the best validated weights, not the last
    checkpoint_every: int = 0  # training-state checkpoint every N steps (and at every epoch end); 0 = epoch ends
    keep_checkpoints: int = 2  # how many training-state checkpoints to keep
    tensorboard: bool = False  # also write RUN/tensorboard events
    weights: str | None = None  # pretrained backbone weights file, read once when training starts (not on resume)
    image: dict | None = None  # image files decoded to {height, width, channels} (imagefolder:, csv:)
    skip_bad_images: bool = False  # unreadable image files counted and skipped instead of refused


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _optimizer(cfg: TrainConfig, params) -> torch.optim.Optimizer:
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}; known: adam, sgd")


def warmup_steps(cfg: TrainConfig, total_steps: int) -> int:
    """The LR warmup's length: as configured, or (-1) 5% of the run, at most 1,000 steps."""
    return min(1000, round(0.05 * total_steps)) if cfg.warmup_steps < 0 else cfg.warmup_steps


def _schedule(cfg: TrainConfig, optimizer, total_steps: int):
    """Per step: linear warmup from ~0 to lr, then cosine decay to 0 (or constant)."""
    warm = warmup_steps(cfg, total_steps)
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {cfg.schedule!r}; known: cosine, constant")

    def factor(s: int) -> float:
        if s < warm:
            return (s + 1) / (warm + 1)
        if cfg.schedule == "constant":
            return 1.0
        return 0.5 * (1.0 + math.cos(math.pi * min(s - warm, total_steps - warm) / max(1, total_steps - warm)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def check_head_options(cfg: TrainConfig) -> None:
    """Refuse head options that cannot work together, before any data is loaded."""
    if cfg.head_shard and cfg.loss not in sharded_losses():
        raise ValueError(f"--head-shard supports the losses {', '.join(sharded_losses())}, not {cfg.loss}")
    if cfg.head_shard and cfg.head_sample < 1.0:
        raise ValueError("--head-shard with --head-sample below 1 is not supported yet: choose one")
    if cfg.head_sample < 1.0 and cfg.loss == "nce" and cfg.loss_params.get("q") is not None:
        raise ValueError("nce with a class prior q cannot be trained with --head-sample (docs/losses.md)")


class _Forward:
    """The network's forward passes under the run's precision, always giving float32 out."""

    def __init__(self, net: nn.Module, model: SLCNet, precision: str, device: torch.device, channels_last: bool):
        self.net, self.model, self.precision, self.device = net, model, precision, device
        self.channels_last = channels_last

    def input(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device, non_blocking=True)
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last and x.dim() == 4 else x

    def logits(self, x: torch.Tensor, cols: torch.Tensor | None = None) -> torch.Tensor:
        with autocast(self.precision, self.device):
            return (self.net(x) if cols is None else self.net(x, cols)).float()

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        with autocast(self.precision, self.device):
            return self.model.embed(x).float()

    def head(self, h: torch.Tensor) -> torch.Tensor:
        with autocast(self.precision, self.device):
            return self.model.head(h).float()


def _batch_loss(cfg: TrainConfig, fwd: _Forward, loss_fn: nn.Module, sampler, x: torch.Tensor, y: torch.Tensor,
                y_global: torch.Tensor, num_classes: int) -> torch.Tensor:
    """The loss of one global batch as this rank computes it from its share x [B_rank, ...], y [B_rank]:
    full head, sampled head, or sharded."""
    if cfg.head_shard:
        features = all_gather_with_grad(fwd.embed(x))  # [B, d]: the global batch, in rank order
        targets = all_gather_no_grad(y)  # [B]
        return loss_fn.sharded(fwd.head(features), Shard.of_rank(num_classes, targets))  # [B, D_r]
    if sampler is None and getattr(loss_fn, "mode", None) == "sampled":  # nce: only the targets' and noise logits
        draws = loss_fn.draw_noise(len(y)).to(y.device)  # [B_rank, t]
        cols = torch.unique(torch.cat([y, draws.flatten()]))  # [K] sorted
        pos = torch.searchsorted
        return loss_fn.on_columns(fwd.logits(x, cols), cols, pos(cols, y), pos(cols, draws))  # [B_rank, K]
    if sampler is None:
        return loss_fn(fwd.logits(x), y)  # [B_rank, D]
    cols = sampler(y_global.cpu()).to(y.device)  # [K], the same on every rank
    return loss_fn(fwd.logits(x, cols), ClassSampler.positions(cols, y))  # [B_rank, K]


def _distributed(device: torch.device) -> tuple[int, int]:
    """(rank, world_size); initialises the process group (NCCL on GPUs, gloo on CPUs) when
    launched by torchrun with more than one rank."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(process_group_backend(device))
    return dist.get_rank(), dist.get_world_size()


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
    from trainer.data import image_spec

    return {
        "dataset": cfg.dataset,
        "input_shape": list(splits.input_shape),
        "classes": splits.classes,
        "mean": np.asarray(splits.mean).tolist(),
        "std": np.asarray(splits.std).tolist(),
        "sizes": {name: len(splits.split(name)[1]) for name in ("train", "calibration", "test")},
        "image": getattr(splits, "image", None) or image_spec(cfg.dataset),
        "fingerprint": getattr(splits, "fingerprint", None),
        "source": getattr(splits, "source", None),
    }


def _load_data(cfg: TrainConfig, progress: bool) -> Splits:
    """The dataset; image files decoded to cfg.image (or the size and RGB a pretrained backbone
    expects), bad files refused or skipped. A pretrained backbone's normalisation replaces the
    data's statistics (its weights were trained with it)."""
    spec = backbone_input_spec(cfg.backbone, **cfg.backbone_params) if cfg.backbone != "auto" else None
    if cfg.dataset.startswith("npz:"):
        return load_dataset(cfg.dataset, image=cfg.image, progress=progress)
    if not cfg.dataset.startswith(("imagefolder:", "csv:")):
        return load_dataset(cfg.dataset, progress=progress)
    image = cfg.image or ({"height": spec["height"], "width": spec["width"], "channels": 3} if spec else None)
    splits = load_dataset(cfg.dataset, image=image, skip_bad=cfg.skip_bad_images, progress=progress)
    if spec is not None:
        mean, std = spec_normalisation(spec)
        splits = replace(splits, mean=mean, std=std)
    return splits


AUTO_BACKBONES = ("resnet_glyph", "mlp")  # what `auto` chooses from (resolve_backbone)


def resolve_backbone(cfg: TrainConfig, splits: Splits) -> str:
    """`auto`: the small residual CNN for images of 16 pixels and more a side, else the MLP."""
    if cfg.backbone != "auto":
        return cfg.backbone
    shape = tuple(splits.input_shape)
    return AUTO_BACKBONES[0] if len(shape) == 3 and min(shape[1:]) >= 16 else AUTO_BACKBONES[1]


def prepare_run_dir(cfg: "TrainConfig", out: Path, resume: bool, overwrite: bool) -> None:
    """Before any data is read: refuse an --out that may not receive this run (trainer/run_dir.py), one line."""
    if resume:
        resume_config(out)  # one line when there is nothing to resume
        return
    data = dataset_path(cfg.dataset) if cfg.dataset.startswith(("imagefolder:", "csv:", "npz:")) else None
    check_out(out, overwrite, data)


def _clear_out(out: Path) -> None:
    """The run folder emptied of an old run's own files (--overwrite) and created; a word on what stays."""
    if kept := clear_run(out):
        print(f"--out {out}: kept {len(kept)} name(s) that are not the run's: {', '.join(kept[:4])}")
    make_out(out)


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def _model_state(model: SLCNet) -> dict:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


class TrainingInterrupted(Exception):
    """Training stopped before its last step (Ctrl-C / SIGTERM, or `stop_at_step`); the state of
    the last completed step is saved and `slc train --resume RUN` continues from it."""

    def __init__(self, run: Path, step: int, total: int):
        super().__init__(f"interrupted at step {step} of {total}; state saved. Resume with: slc train --resume {run}")
        self.run, self.step, self.total = run, step, total


@dataclass
class _Progress:
    """Where a run is: what a training-state checkpoint restores besides the tensors."""

    step: int = 0  # completed optimizer steps
    best: float | None = None  # best calibration accuracy seen by a validation
    kept: float | None = None  # the calibration accuracy of the weights in best.pt (converging runs: within one image)
    best_epoch: int | None = None
    best_step: int | None = None
    stale: int = 0  # validations since the best one
    stopped_early: bool = False


class _StopRequest:
    """SIGINT / SIGTERM ask the loop to stop after the step in progress (a step cut in half would
    leave the optimizer's state torn); a second Ctrl-C stops at once."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def __enter__(self):
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _build(cfg: TrainConfig, splits: Splits, num_classes: int, n_train: int, resume: bool):
    """(model, loss, class sampler or None) with the loss's initial head bias; the pretrained
    weights file is read for a new run only (a resumed run's checkpoint holds them)."""
    params = {**cfg.backbone_params, **({"weights": cfg.weights} if cfg.weights and not resume else {})}
    model = build_model(cfg.backbone, params, splits.input_shape, num_classes, splits.mean, splits.std)
    sampler = ClassSampler(num_classes, cfg.head_sample, min(cfg.batch_size, n_train), cfg.seed) \
        if cfg.head_sample < 1.0 else None
    loss_fn = build_loss(cfg.loss, sampler.size if sampler else num_classes, **cfg.loss_params)
    if not resume:
        _init_head(model, loss_fn, num_classes, cfg.batch_size)
    return model, loss_fn, sampler


def _init_head(model: SLCNet, loss_fn, num_classes: int, batch_size: int) -> None:
    """Where the loss wants the head to start (trainer/losses/init.py, docs/losses.md "Initial head"):
    its weights scaled by `initial_weight_scale` (0: every logit starts at its bias) and its bias at
    `initial_bias`, the constant where the loss's optimum puts false logits (e.g. −log(D−1) for bce).
    A user's loss without these hooks keeps the default head."""
    scale = getattr(loss_fn, "initial_weight_scale", None)
    initial = getattr(loss_fn, "initial_bias", None)
    value = _initial_bias(initial, num_classes, batch_size) if callable(initial) else None
    with torch.no_grad():
        if scale is not None:
            model.head.weight.mul_(float(scale))
        if value is not None:
            model.head.bias.copy_(torch.as_tensor(value, dtype=torch.float32).expand(num_classes))


def _initial_bias(rule, num_classes: int, batch_size: int):
    try:
        return rule(num_classes, batch_size=batch_size)
    except TypeError:  # a user's loss written before the batch size was passed
        return rule(num_classes)


def _checkpoint_state(cfg, model, optimizer, schedule, scaler, sampler, progress: _Progress) -> dict:
    return {"config": asdict(cfg), "progress": asdict(progress), "model": model.state_dict(),
            "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(), "scaler": scaler.state_dict(),
            "rng": rng_state(), "sampler": sampler.generator.get_state() if sampler is not None else None}


def _restore(path: Path, model, optimizer, schedule, scaler, sampler) -> _Progress:
    state = load_checkpoint(path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"])
    if sampler is not None and state["sampler"] is not None:
        sampler.generator.set_state(state["sampler"])
    return _Progress(**state["progress"])


def _validate(model: SLCNet, splits: Splits, progress: _Progress, epoch: int, history: History, out: Path,
              cfg: TrainConfig, echo, check_chance: bool = False) -> None:
    """Calibration-split metrics after an epoch; the best weights kept in RUN/best.pt; with
    `check_chance`, a warning when the accuracy is still chance."""
    t0 = time.perf_counter()
    m = model_metrics(model, *splits.calibration)
    history.log_epoch(progress.step, epoch, **{f"cal_{k}": m[k] for k in
                                               ("accuracy", "top5_accuracy", "auprc", "p_at_r99", "separation")},
                      val_seconds=time.perf_counter() - t0)
    if _keep(m["accuracy"], progress, cfg.converge, len(splits.calibration[1])):
        progress.best_epoch, progress.best_step, progress.kept = epoch, progress.step, m["accuracy"]
        atomic_save(_model_state(model), out / "best.pt")
    chance = 1.0 / splits.num_classes
    if check_chance and m["accuracy"] < 2 * chance:
        echo(f"warning: calibration accuracy {m['accuracy']:.4f} after epoch {epoch + 1} ({progress.step} steps) is chance "
             f"(1/{splits.num_classes}):"
             f" {cfg.loss} with lr {cfg.lr:g} has not started learning; try another --lr or --warmup-steps "
             f"(docs/losses.md, docs/training.md)")
    if cfg.patience and progress.stale >= cfg.patience:
        progress.stopped_early = True


def _keep(accuracy: float, progress: _Progress, converge: bool, n_cal: int) -> bool:
    """Count the validation (a better accuracy resets the patience) and say whether its weights go to
    best.pt: a better accuracy; on a converging run also one within one calibration image of the best,
    the later weights being the more trained ones (a first maximum on 60 images is often a lucky
    epoch at a high learning rate: docs/results/small-folder-defaults.md)."""
    if progress.best is None or accuracy > progress.best:
        progress.best, progress.stale = accuracy, 0
        return True
    progress.stale += 1
    return bool(converge) and accuracy >= progress.best - 1.0 / max(1, n_cal) - 1e-9


@dataclass
class _Session:
    """Everything one run's loop works with, built once by `_setup`."""

    cfg: TrainConfig
    out: Path
    rank: int
    world: int
    device: torch.device
    splits: Splits
    y_train: torch.Tensor  # [N] labels in memory (pixels stay where they are stored)
    model: SLCNet
    net: nn.Module  # model, or its DDP / compiled wrapper
    loss_fn: nn.Module
    sampler: ClassSampler | None
    augment: object
    optimizer: torch.optim.Optimizer
    schedule: object
    scaler: torch.amp.GradScaler
    batch: int
    steps_per_epoch: int
    total_steps: int
    ckpt_dir: Path
    history: History
    state: _Progress
    resolved: dict
    chance_epoch: int = 0  # the validation that warns when the accuracy is still chance

    def save(self) -> None:
        """A training-state checkpoint of the step just completed, and the history up to it."""
        if self.rank == 0 or self.cfg.head_shard:
            state = _checkpoint_state(self.cfg, self.model, self.optimizer, self.schedule, self.scaler, self.sampler,
                                      self.state)
            save_checkpoint(self.ckpt_dir, state, self.state.step, self.cfg.keep_checkpoints)
        if self.rank == 0:
            self.history.write()


def _place(cfg: TrainConfig, model: SLCNet, num_classes: int, device: torch.device, world: int) -> nn.Module:
    """Move the model to its device and layout; the network the loop calls (DDP, compiled)."""
    if cfg.head_shard:  # no DDP: the backbone's gradients are summed by hand (sum_gradients)
        model.head = keep_shard(model.head, num_classes)
    model.to(device)
    if cfg.channels_last:
        model.to(memory_format=torch.channels_last)
    net: nn.Module = model
    if cfg.head_shard:
        broadcast_parameters(model.backbone)
    elif world > 1:
        net = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return torch.compile(net) if cfg.compile else net


def _setup(cfg: TrainConfig, out: Path, progress: bool, resume: bool, overwrite: bool) -> _Session:
    """Checks, run directory, data, model, optimizer, and the state to start from."""
    check_head_options(cfg)
    device = resolve_device(cfg.device)
    check_precision(cfg.precision, device)
    rank, world = _distributed(device)
    if rank == 0:
        prepare_run_dir(cfg, out, resume, overwrite)
    seed_everything(cfg.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)

    splits = _load_data(cfg, progress and rank == 0)
    data_info = _data_info(cfg, splits)
    cfg = replace(cfg, backbone=resolve_backbone(cfg, splits))
    y_train = torch.tensor(np.asarray(splits.train[1], dtype=np.int64))  # [N]
    n_train, num_classes = len(y_train), splits.num_classes
    cfg, defaults = resolve_defaults(cfg, n_train, world)
    augment = build_augment(cfg.augment, splits.input_shape, data_info["image"])
    model, loss_fn, sampler = _build(cfg, splits, num_classes, n_train, resume)
    net = _place(cfg, model, num_classes, device, world)

    batch = min(cfg.batch_size, n_train)
    if batch < 2 * world:
        raise ValueError(f"batch_size {batch} too small for {world} rank(s): every rank needs 2 examples")
    steps_per_epoch = n_train // batch  # drop the last incomplete batch
    if rank == 0 and not resume:  # data found and checked: only now are an old run's own files removed
        _clear_out(out)
    total_steps = min(max(1, cfg.epochs * steps_per_epoch), cfg.max_steps or 1 << 62)
    optimizer = _optimizer(cfg, net.parameters())
    schedule = _schedule(cfg, optimizer, total_steps)
    scaler = grad_scaler(cfg.precision, device)
    ckpt_dir = checkpoint_dir(out, rank if cfg.head_shard and world > 1 else None)
    history = History(out, tensorboard=cfg.tensorboard and rank == 0)
    state = _Progress()
    if resume:
        state = _restore(latest_checkpoint(ckpt_dir), model, optimizer, schedule, scaler, sampler)
        history.resume(state.step)
    resolved = {**asdict(cfg), "num_classes": num_classes, "input_shape": list(splits.input_shape),
                "embed_dim": int(model.backbone.embed_dim), "loss_pols": bool(getattr(loss_fn, "pols", False)),
                "steps": total_steps, "steps_per_epoch": steps_per_epoch, "world_size": world,
                "warmup_steps_resolved": warmup_steps(cfg, total_steps), "device_resolved": str(device),
                "defaults": _defaults_record(out, defaults, resume, total_steps, steps_per_epoch),
                "versions": _versions(), "status": "running"}
    if rank == 0:
        _write_json(out / "config.json", resolved)
        _write_json(out / "data.json", data_info)
        announce(resolved, resume)  # what was chosen, before the first step
    return _Session(cfg, out, rank, world, device, splits, y_train, model, net, loss_fn, sampler, augment, optimizer,
                    schedule, scaler, batch, steps_per_epoch, total_steps, ckpt_dir, history, state, resolved,
                    chance_check_epoch(steps_per_epoch, cfg.val_every, total_steps))


def _defaults_record(out: Path, record: dict, resume: bool, total_steps: int, steps_per_epoch: int) -> dict:
    """What trainer/defaults.py resolved, with the steps it gave; a resumed run keeps its first
    record (its checkpoint's config holds the resolved values, which read as given)."""
    if resume and (out / "config.json").is_file():
        old = json.loads((out / "config.json").read_text()).get("defaults")
        if old is not None:
            return {**old, "steps": total_steps}
    return {**record, "steps": total_steps, "steps_per_epoch": steps_per_epoch}


CHANCE_CHECK_STEPS = 50


def chance_check_epoch(steps_per_epoch: int, val_every: int, total_steps: int) -> int:
    """The first validated epoch ending at least 50 steps (or the whole run) in: the first epoch on
    larger data; later on small data, whose first epoch is a few warmup steps."""
    if not val_every:
        return -1
    need = min(CHANCE_CHECK_STEPS, total_steps)
    epochs = max(1, math.ceil(need / max(1, steps_per_epoch)))  # epochs to run for `need` steps
    return math.ceil(epochs / val_every) * val_every - 1


def _run_epoch(s: _Session, epoch: int, fwd: _Forward, bar, stop: _StopRequest, stop_at_step: int | None) -> None:
    """The steps of one epoch from where the state is, up to its end, a stop or the budget."""
    cfg, state = s.cfg, s.state
    batches = EpochBatches(len(s.y_train), s.batch, cfg.seed, epoch, state.step - epoch * s.steps_per_epoch,
                           s.rank, s.world)
    loader = batch_loader(s.splits.train[0], s.y_train.numpy(), batches, cfg.workers,
                          pin_memory=s.device.type == "cuda")
    tick = time.perf_counter()
    for global_idx, (x, y, _) in zip(batches.global_batches(), loader):
        x, y = fwd.input(x), y.to(s.device, non_blocking=True)
        if s.augment is not None:
            x = s.augment(x, augment_generator(cfg.seed, state.step))
        if hasattr(s.loss_fn, "set_progress"):
            s.loss_fn.set_progress(state.step / s.total_steps)
        y_global = s.y_train[global_idx].to(s.device)
        loss = _batch_loss(cfg, fwd, s.loss_fn, s.sampler, x, y, y_global, s.splits.num_classes)
        lr, grad_norm = _optimizer_step(cfg, loss, s.net, s.model, s.optimizer, s.scaler, s.schedule, epoch, state.step)
        state.step += 1
        now = time.perf_counter()
        s.history.log_step(state.step, epoch, loss=loss.item(), lr=lr, grad_norm=grad_norm,
                           images_per_s=s.batch / max(now - tick, 1e-9))
        tick = now
        bar.update()
        if state.step % 10 == 0:
            bar.set_postfix(epoch=epoch, loss=f"{loss.item():.4f}")
        if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0:
            s.save()
        if stop.requested or state.step in (stop_at_step, s.total_steps):
            break


def train(cfg: TrainConfig, out: Path, progress: bool = True, *, resume: bool = False, overwrite: bool = False,
          stop_at_step: int | None = None) -> Path:
    """Fit SLCNet on cfg.dataset with cfg.loss; write the run directory `out` and return it.
    `resume` continues `out` from its newest checkpoint; `stop_at_step` stops there as Ctrl-C would."""
    from tqdm.auto import tqdm

    out = Path(out)
    s = _setup(cfg, out, progress, resume, overwrite)
    cfg, state = s.cfg, s.state
    fwd = _Forward(s.net, s.model, cfg.precision, s.device, cfg.channels_last)
    bar = tqdm(total=s.total_steps, initial=state.step, desc=f"{cfg.loss} lr={cfg.lr:g}",
               disable=not progress or s.rank != 0, leave=False)
    started, steps_at_start = time.perf_counter(), state.step
    s.net.train()
    with _StopRequest() as stop:
        for epoch in range(state.step // s.steps_per_epoch, cfg.epochs):
            _run_epoch(s, epoch, fwd, bar, stop, stop_at_step)
            epoch_done = state.step in ((epoch + 1) * s.steps_per_epoch, s.total_steps)
            if epoch_done and s.rank == 0 and not cfg.head_shard and cfg.val_every and (epoch + 1) % cfg.val_every == 0:
                _validate(s.model, s.splits, state, epoch, s.history, out, cfg, tqdm.write, epoch == s.chance_epoch)
                s.net.train()
            state.stopped_early = _agree(state.stopped_early, s.world, s.device)
            interrupted = stop.requested or state.step == stop_at_step
            if epoch_done or interrupted:
                s.save()
            if interrupted:
                bar.close()
                if s.rank == 0:
                    _write_json(out / "config.json", {**s.resolved, "status": "interrupted", "step": state.step})
                raise TrainingInterrupted(out, state.step, s.total_steps)
            if state.stopped_early:
                tqdm.write(f"early stop after epoch {epoch + 1}: no better calibration accuracy in {cfg.patience} "
                           f"validations")
            if state.stopped_early or state.step == s.total_steps:
                break
    bar.close()
    s.history.close()
    _end(s, time.perf_counter() - started, (state.step - steps_at_start) * s.batch)
    return out


def _end(s: _Session, train_seconds: float, images: int) -> None:
    """The full head back on rank 0 (--head-shard), the final files, the process group closed."""
    if s.cfg.head_shard:
        s.model.head = gather_head(s.model.head, s.splits.num_classes)
    if s.rank == 0:
        cal = [float(r["cal_accuracy"]) for r in s.history.rows if r["kind"] == "epoch" and r.get("cal_accuracy") != ""]
        _finish(s.out, s.model, s.splits, s.state, s.resolved, s.cfg, train_seconds, images, cal)
    if s.world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()  # every rank is here (slc train then ends it with exit_rank)


def _optimizer_step(cfg: TrainConfig, loss: torch.Tensor, net: nn.Module, model: SLCNet, optimizer, scaler,
                    schedule, epoch: int, step: int) -> tuple[float, float]:
    """Backward, gradient norm (clipped when asked), optimizer and schedule step: (lr used, norm)."""
    if not torch.isfinite(loss):
        raise FloatingPointError(f"loss {cfg.loss} is {loss.item()} at epoch {epoch} step {step} "
                                 f"(lr={cfg.lr}); try a lower --lr or --clip-grad-norm")
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    if cfg.head_shard:
        sum_gradients(model.backbone.parameters())
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.clip_grad_norm or float("inf"))
    lr = optimizer.param_groups[0]["lr"]
    scaler.step(optimizer)
    scaler.update()
    schedule.step()
    return lr, float(grad_norm)


def _agree(flag: bool, world: int, device: torch.device) -> bool:
    """Rank 0's decision, on every rank (early stopping is decided where validation runs)."""
    if world == 1:
        return flag
    import torch.distributed as dist

    t = torch.tensor([int(flag)], device=device)
    dist.broadcast(t, 0)
    return bool(t.item())


def _finish(out: Path, model: SLCNet, splits: Splits, state: _Progress, resolved: dict, cfg: TrainConfig,
            train_seconds: float, images: int, cal_accuracy: list[float]) -> None:
    """The run's final files: chosen weights, metrics on both held-out splits, whether it converged
    (trainer/defaults.py), curves."""
    t0 = time.perf_counter()
    chosen = "last"
    if cfg.restore_best and (out / "best.pt").is_file() and state.best_step is not None:
        model.load_state_dict(torch.load(out / "best.pt", map_location="cpu", weights_only=True))
        chosen = "best"
    model.eval()
    metrics = {name: model_metrics(model, *splits.split(name)) for name in ("calibration", "test")}
    torch.save(_model_state(model), out / "checkpoint.pt")
    _write_json(out / "metrics.json", metrics)
    _write_json(out / "config.json", {
        **resolved, "status": "completed", "step": state.step, "stopped_early": state.stopped_early,
        "kept_weights": {"chosen": chosen, "best_epoch": state.best_epoch, "best_step": state.best_step,
                    "best_calibration_accuracy": state.best, "kept_calibration_accuracy": state.kept},
        "convergence": convergence(cal_accuracy, cfg.patience, state.stopped_early),
        "train_seconds": round(train_seconds, 1), "train_images_per_second": round(images / max(train_seconds, 1e-9), 1),
        "eval_seconds": round(time.perf_counter() - t0, 1)})
    plot_curves(out, title=f"{out.name}: {cfg.loss} on {cfg.dataset}")


def resume_config(run: Path, epochs: int | None = None) -> TrainConfig:
    """The TrainConfig a run was started with (its checkpoint's copy), `epochs` optionally raised."""
    path = latest_checkpoint(checkpoint_dir(run)) or latest_checkpoint(checkpoint_dir(run, 0))
    if path is None:
        raise ValueError(f"{run} has no training checkpoint to resume (RUN/checkpoints/step-*.pt)")
    saved = load_checkpoint(path)["config"]
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in saved.items() if k in fields})
    return replace(cfg, epochs=epochs) if epochs else cfg
