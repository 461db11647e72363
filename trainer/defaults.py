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

Below SMALL_DATA training examples with --epochs left unset, a fixed epoch count was measured not to
converge (issue 50: 0.883-0.983 test accuracy on one folder by seed), so the run trains to
convergence instead (docs/training.md, "Training to convergence"): the epochs become a budget
(BUDGET_FACTOR times the above, or --max-steps), every epoch is validated, and --patience defaults to
auto_patience validations. From SMALL_DATA on (every built-in dataset) the recipe is as before.

- augment: `geometry` (trainer/augment.py) for an image folder (imagefolder:DIR) trained to
  convergence by the rule above, else none. An augmented run trains its whole budget (--patience
  defaults to 0): its calibration accuracy swings between validations while the learning rate is
  high (issue 50's folder, seed 1: 0.18-1.00 up to epoch 45 of 60), and patience stopped it on a
  lucky epoch. On issue 50's folder the classes' logits then separate by a margin: detect recall at
  the export's default thresholds from 0.817 / 0.767 / 0.867 to 0.983 / 0.917 / 0.983 at pooled precision 1.000,
  test accuracy kept (docs/results/small-folder-aims.md, "Augmentation by default on small folders").

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
AUTO_FIELDS = ("batch_size", "epochs", "val_every", "patience", "augment")
SMALL_DATA = BATCH_MAX * BATCHES_PER_EPOCH  # 1,024: below it a run with no --epochs trains to convergence
BUDGET_FACTOR = 3  # the convergence budget: this many times the epochs of the rule above
PATIENCE = 10  # validations without a better one before a converging run stops ...
PATIENCE_STEPS = 100  # ... and at least this many optimizer steps of them (noise at a high learning rate)
SMALL_FOLDER_AUGMENT = "geometry"  # an image folder trained to convergence: scale, shift, rotation (trainer/augment.py)


def auto_batch(n_train: int, world: int = 1) -> int:
    """The largest power of two in [16, 128] with at least 8 batches of n_train; at most n_train."""
    batch = BATCH_MAX
    while batch > BATCH_MIN and n_train // batch < BATCHES_PER_EPOCH:
        batch //= 2
    return min(max(batch, 2 * world), n_train)


def auto_epochs(steps_per_epoch: int) -> int:
    """20 epochs, or as many more as MIN_STEPS optimizer steps need."""
    return max(EPOCHS, math.ceil(MIN_STEPS / max(1, steps_per_epoch)))


def auto_patience(steps_per_validation: int) -> int:
    """PATIENCE validations, more when they make fewer than PATIENCE_STEPS steps."""
    return max(PATIENCE, math.ceil(PATIENCE_STEPS / max(1, steps_per_validation)))


def converges(cfg, n_train: int) -> bool:
    """Whether a run trains to convergence (patience within a budget) rather than for fixed epochs:
    as set, else when the epochs are left unset on small data."""
    if getattr(cfg, "converge", None) is not None:
        return bool(cfg.converge)
    return cfg.epochs is None and n_train < SMALL_DATA


def _epochs(cfg, steps_per_epoch: int, converge: bool) -> int:
    """The epochs a run leaves unset: the rule's (a convergence budget: BUDGET_FACTOR times, or --max-steps)."""
    if cfg.max_steps:
        return math.ceil(cfg.max_steps / max(1, steps_per_epoch)) if converge else EPOCHS
    return auto_epochs(steps_per_epoch) * (BUDGET_FACTOR if converge else 1)


def auto_augment(dataset: str, converge: bool) -> str:
    """SMALL_FOLDER_AUGMENT for an image folder (imagefolder:DIR) trained to convergence, else none."""
    return SMALL_FOLDER_AUGMENT if converge and str(dataset).startswith("imagefolder:") else "none"


def resolve_defaults(cfg, n_train: int, world: int = 1):
    """(cfg with batch_size, epochs, val_every, patience and augment set, the record config.json keeps):
    the fields left None are resolved from n_train (and the dataset), the others kept as given."""
    given = [f for f in AUTO_FIELDS if getattr(cfg, f) is not None]
    converge = converges(cfg, n_train)
    batch = cfg.batch_size if cfg.batch_size is not None else auto_batch(n_train, world)
    steps_per_epoch = n_train // max(1, min(batch, n_train))
    epochs = cfg.epochs if cfg.epochs is not None else _epochs(cfg, steps_per_epoch, converge)
    val_every = cfg.val_every
    if val_every is None:
        val_every = 1 if converge else math.ceil(epochs / VALIDATIONS)
        if cfg.epochs is None:
            epochs = math.ceil(epochs / val_every) * val_every  # the last epoch validated
    augment = cfg.augment if cfg.augment is not None else auto_augment(cfg.dataset, converge)
    patience = cfg.patience
    if patience is None:  # an augmented run's calibration accuracy swings at a high learning rate: the whole budget
        patience = auto_patience(steps_per_epoch * val_every) if converge and val_every and augment == "none" else 0
    resolved = {"batch_size": batch, "epochs": epochs, "val_every": val_every, "patience": patience,
                "augment": augment}
    record = {"n_train": n_train, "by_rule": {k: v for k, v in resolved.items() if k not in given},
              "given": {k: v for k, v in resolved.items() if k in given}, "min_steps": MIN_STEPS,
              "stopping": "converge" if converge else "epochs", "rule": "docs/training.md#defaults-on-small-data"}
    return replace(cfg, **resolved, converge=converge), record


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


STILL_IMPROVING = 0.005  # a better calibration accuracy by more than this within the window: still improving


def convergence(cal_accuracy: list[float], patience: int, stopped_early: bool) -> dict | None:
    """Whether the run converged, for config.json and the summary (docs/training.md, "Training to
    convergence"): stopped by patience, or no better calibration accuracy (by more than
    STILL_IMPROVING) in the last `window` validations (patience, else PATIENCE, at most half of them)
    when the budget ran out. None with fewer than 2 validations: nothing to tell it by."""
    n = len(cal_accuracy)
    if stopped_early:
        return {"converged": True, "by": "patience", "window": patience, "validations": n}
    window = min(patience or PATIENCE, n // 2)
    if window < 1:
        return None
    before, last = max(cal_accuracy[:-window]), max(cal_accuracy[-window:])
    return {"converged": last - before <= STILL_IMPROVING, "by": "budget", "window": window, "validations": n,
            "best_before_window": round(before, 6), "best_in_window": round(last, 6)}


def convergence_line(verdict: dict | None, epochs: int, steps: int, converge: bool) -> str | None:
    """The summary's line on convergence, with what to raise when the budget ran out while improving."""
    if verdict is None:
        return None
    if verdict["by"] == "patience":
        return (f"converged: no better calibration accuracy in {verdict['window']} validations, stopped after "
                f"{steps} steps (docs/training.md)")
    if verdict["converged"]:
        return (f"converged: no better calibration accuracy in the last {verdict['window']} of "
                f"{verdict['validations']} validations")
    raise_what = f"--max-steps (the budget: {steps} steps)" if converge else f"--epochs (now {epochs})"
    return (f"warning: not converged: calibration accuracy still improving when the budget ran out "
            f"({verdict['best_before_window']:.3f} -> {verdict['best_in_window']:.3f} in the last "
            f"{verdict['window']} of {verdict['validations']} validations); raise {raise_what} (docs/training.md)")
