"""Defaults that follow the data size (docs/training.md, "Defaults on small data").

A fixed batch of 128 and 20 epochs give a folder of 172 training images one step per epoch and
20 steps per run: far too few to learn (test accuracy 0.57 / 0.67 on 12 letters of 24 images each,
0.91 with these defaults). So the fields a user left
unset (None) are resolved from the training split's size n:

- batch: the largest power of two from 16 to 128 that gives at least 8 batches per epoch
  (128 from n >= 1,024 on; never more than n). The remainder dropped each epoch is then under
  1/8 of the split (under 16 examples below n = 128), and a different part of it every epoch.
- epochs: 20, raised until the run has at least MIN_STEPS optimizer steps (not when a --max-steps
  budget is given).
- val_every: every epoch up to 20 epochs; beyond, every ceil(epochs / 20) epochs (about 20
  validations a run), the epochs rounded up so that the last one is validated.

A value the user gave always wins. The run's short-run warning (trainer/cli.py) uses MIN_STEPS too.
"""
from __future__ import annotations

import math
from dataclasses import replace

BATCH_MAX = 128
BATCH_MIN = 16
BATCHES_PER_EPOCH = 8
EPOCHS = 20
MIN_STEPS = 150
VALIDATIONS = 20
AUTO_FIELDS = ("batch_size", "epochs", "val_every")


def auto_batch(n_train: int, world: int = 1) -> int:
    """The largest power of two in [16, 128] with at least 8 batches of n_train; at most n_train."""
    batch = BATCH_MAX
    while batch > BATCH_MIN and n_train // batch < BATCHES_PER_EPOCH:
        batch //= 2
    return min(max(batch, 2 * world), n_train)


def auto_epochs(steps_per_epoch: int) -> int:
    """20 epochs, or as many more as MIN_STEPS optimizer steps need."""
    return max(EPOCHS, math.ceil(MIN_STEPS / max(1, steps_per_epoch)))


def resolve_defaults(cfg, n_train: int, world: int = 1):
    """(cfg with batch_size, epochs and val_every set, the record config.json keeps): the fields left
    None are resolved from n_train, the others kept as given."""
    given = [f for f in AUTO_FIELDS if getattr(cfg, f) is not None]
    batch = cfg.batch_size if cfg.batch_size is not None else auto_batch(n_train, world)
    steps_per_epoch = n_train // max(1, min(batch, n_train))
    epochs = cfg.epochs
    if epochs is None:
        epochs = EPOCHS if cfg.max_steps else auto_epochs(steps_per_epoch)
    val_every = cfg.val_every
    if val_every is None:
        val_every = math.ceil(epochs / VALIDATIONS)
        if cfg.epochs is None:
            epochs = math.ceil(epochs / val_every) * val_every  # the last epoch validated
    resolved = {"batch_size": batch, "epochs": epochs, "val_every": val_every}
    record = {"n_train": n_train, "by_rule": {k: v for k, v in resolved.items() if k not in given},
              "given": {k: v for k, v in resolved.items() if k in given}, "min_steps": MIN_STEPS,
              "rule": "docs/training.md#defaults-on-small-data"}
    return replace(cfg, **resolved), record


STILL_RISING = 0.10


def short_run_warning(steps: int, cal_accuracy: list[float], stopped_early: bool = False) -> str | None:
    """One line when the run was probably too short to converge, else None: fewer than MIN_STEPS
    optimizer steps (unless early stopping ended it: it had stopped improving), or (4 validations or
    more) the best calibration accuracy of the last quarter of the validations more than 0.10 above
    the best before it, i.e. still rising steeply at the end."""
    if steps < MIN_STEPS and not stopped_early:
        return (f"warning: only {steps} optimizer steps (fewer than {MIN_STEPS}): probably too short to converge; "
                f"raise --epochs, or leave --epochs and --batch-size to their defaults (docs/training.md)")
    if len(cal_accuracy) >= 4:
        last = max(1, len(cal_accuracy) // 4)
        before, end = max(cal_accuracy[:-last]), max(cal_accuracy[-last:])
        if end - before > STILL_RISING:
            return (f"warning: calibration accuracy still rising at the end ({before:.3f} -> {end:.3f} over the last "
                    f"{last} of {len(cal_accuracy)} validations): train longer (--epochs; docs/training.md)")
    return None
