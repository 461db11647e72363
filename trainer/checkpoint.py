"""Training-state checkpoints of a run: RUN/checkpoints/step-NNNNNNNN.pt, the last K kept.

A checkpoint holds everything `slc train --resume RUN` needs to continue exactly: the model,
optimizer, LR schedule and gradient scaler states, the random generators, the step and epoch,
the best-so-far validation, and the resolved config it was trained with (beside every
checkpoint, as torchtune keeps it). Written to a temporary file and renamed into place, so a
crash or a kill mid-write leaves the previous checkpoint whole.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch

PATTERN = re.compile(r"step-(\d+)\.pt$")


def checkpoint_dir(run: Path, shard: int | None = None) -> Path:
    """RUN/checkpoints, or RUN/checkpoints/rank-R for a rank's own state (--head-shard: each rank
    holds different head rows)."""
    folder = Path(run) / "checkpoints"
    return folder if shard is None else folder / f"rank-{shard}"


def list_checkpoints(folder: Path) -> list[Path]:
    """The checkpoints in `folder`, oldest first."""
    found = [(int(m.group(1)), p) for p in Path(folder).glob("step-*.pt") if (m := PATTERN.search(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(folder: Path) -> Path | None:
    found = list_checkpoints(folder)
    return found[-1] if found else None


def atomic_save(obj, path: Path) -> None:
    """torch.save to PATH.tmp, fsync, rename: readers see the old file or the new, never half."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(folder: Path, state: dict, step: int, keep: int) -> Path:
    """Write the state of `step` into `folder`; remove all but the `keep` newest checkpoints."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:08d}.pt"
    atomic_save(state, path)
    for old in list_checkpoints(folder)[:-max(1, keep)]:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: Path) -> dict:
    """A checkpoint's state (tensors on the CPU; the caller moves them where the model lives)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
