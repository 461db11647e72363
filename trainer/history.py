"""A run's learning curve: RUN/history.csv, drawn in RUN/curves.png, optionally TensorBoard events.

history.csv has one row per training step (kind `step`: loss, lr, grad_norm, images/s) and
one per validation (kind `epoch`: the calibration split's accuracy, top-5, AUPRC, P@R0.99 and
separation, and the validation's seconds). Rows are appended in memory and the file is
rewritten whole at every checkpoint and epoch end (atomically), so it always matches the
newest checkpoint; a resumed run keeps the rows up to its checkpoint's step and goes on.
"""
from __future__ import annotations

import csv
import io
import math
import os
from pathlib import Path

STEP_FIELDS = ("loss", "lr", "grad_norm", "images_per_s")
EPOCH_FIELDS = ("cal_accuracy", "cal_top5_accuracy", "cal_auprc", "cal_p_at_r99", "cal_separation", "val_seconds")
COLUMNS = ("kind", "step", "epoch") + STEP_FIELDS + EPOCH_FIELDS


class History:
    def __init__(self, run: Path, tensorboard: bool = False):
        self.path = Path(run) / "history.csv"
        self.rows: list[dict] = []
        self.writer = _tensorboard_writer(Path(run) / "tensorboard") if tensorboard else None

    def resume(self, step: int) -> None:
        """Keep the rows of steps up to `step` (those the checkpoint being resumed has seen)."""
        if self.path.is_file():
            with open(self.path, newline="") as f:
                self.rows = [r for r in csv.DictReader(f) if int(r["step"]) <= step]

    def log_step(self, step: int, epoch: int, **values: float) -> None:
        self.rows.append({"kind": "step", "step": step, "epoch": epoch, **values})
        if self.writer:
            for key, value in values.items():
                self.writer.add_scalar(f"train/{key}", value, step)

    def log_epoch(self, step: int, epoch: int, **values: float) -> None:
        self.rows.append({"kind": "epoch", "step": step, "epoch": epoch, **values})
        if self.writer:
            for key, value in values.items():
                self.writer.add_scalar(f"calibration/{key.removeprefix('cal_')}", value, step)
            self.writer.flush()

    def write(self) -> None:
        buffer = io.StringIO()
        out = csv.DictWriter(buffer, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
        out.writeheader()
        for row in self.rows:
            out.writerow({k: _cell(v) for k, v in row.items()})
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(buffer.getvalue())
        os.replace(tmp, self.path)

    def close(self) -> None:
        if self.writer:
            self.writer.close()


def _cell(value):
    if isinstance(value, float):
        return f"{value:.6g}" if math.isfinite(value) else str(value)
    return value


def _tensorboard_writer(folder: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
    return SummaryWriter(str(folder))


def read_history(path: Path) -> tuple[list[dict], list[dict]]:
    """(step rows, epoch rows) of a history.csv, numbers as floats."""
    steps, epochs = [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            parsed = {k: (float(v) if v not in ("", None) and k != "kind" else v) for k, v in row.items()}
            (steps if row["kind"] == "step" else epochs).append(parsed)
    return steps, epochs


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` points (the loss of one step is noisy)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_curves(run: Path, title: str = "") -> Path:
    """RUN/curves.png: training loss (raw and smoothed), LR, gradient norm, calibration metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, epochs = read_history(Path(run) / "history.csv")
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    x = [r["step"] for r in steps]
    window = max(1, len(steps) // 50)
    ax = axes[0, 0]
    ax.plot(x, [r["loss"] for r in steps], color="0.8", lw=0.6, label="per step")
    ax.plot(x, smooth([r["loss"] for r in steps], window), color="C0", label=f"mean of {window}")
    ax.set(title="training loss", xlabel="step")
    ax.legend()
    axes[0, 1].plot(x, [r["lr"] for r in steps], color="C1")
    axes[0, 1].set(title="learning rate", xlabel="step")
    axes[1, 0].plot(x, [r["grad_norm"] for r in steps], color="0.7", lw=0.6)
    axes[1, 0].plot(x, smooth([r["grad_norm"] for r in steps], window), color="C2")
    axes[1, 0].set(title="gradient norm (before clipping)", xlabel="step", yscale="log")
    ax = axes[1, 1]
    for key, label in (("cal_accuracy", "accuracy"), ("cal_auprc", "AUPRC"), ("cal_p_at_r99", "P@R0.99")):
        ax.plot([r["step"] for r in epochs], [r[key] for r in epochs], marker="o", label=label)
    ax.set(title="calibration split, per epoch", xlabel="step", ylim=(0, 1))
    ax.legend()
    fig.suptitle(title)
    path = Path(run) / "curves.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
