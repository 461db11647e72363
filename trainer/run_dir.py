"""What `slc train --out` may write into, and what `--overwrite` may remove (docs/training.md "Run folders").

A run folder is recognised by what `slc train` writes first: a config.json that is a run's resolved
config (it names the loss, the dataset and the steps) beside a data.json. `--out` may be a new
folder, an empty one, or (with --overwrite) a run folder; anything else is refused in one line that
says what is there, before any data is read: a file, the current folder or one above it, a folder
that holds the data or lies inside it, a folder that is not a run.

`--overwrite` removes only the names a run writes (RUN_FILES), and only once the new run's data has
been found and checked (`clear_run`, called just before the new config is written); anything else a
user put into the run folder stays.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from serving.bundle import output

# Every name `slc train` writes into a run folder (files, then folders); `NAME.tmp` too (atomic writes).
RUN_FILES = ("config.json", "data.json", "checkpoint.pt", "best.pt", "metrics.json", "history.csv", "curves.png")
RUN_FOLDERS = ("checkpoints", "tensorboard")
RUN_KEYS = ("loss", "dataset", "steps")  # of a run's config.json


def run_config(path: Path) -> dict | None:
    """The run config in `path`/config.json when `path` is a run folder, else None."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or not all(k in config for k in RUN_KEYS) or not (path / "data.json").is_file():
        return None
    return config


def _about(path: Path) -> str:
    config = run_config(path) or {}
    return f" ({config.get('loss')} on {config.get('dataset')}, {config.get('status', 'finished')})"


def run_names(path: Path) -> set[str] | None:
    """The names of the run in `path` (RUN_FILES, RUN_FOLDERS and their .tmp present); None: not a run."""
    if run_config(path) is None:
        return None
    own = set(RUN_FILES) | set(RUN_FOLDERS)
    own |= {name + ".tmp" for name in own}
    return {p.name for p in path.iterdir() if p.name in own}


output.register(output.Kind("run", run_names, hint="--resume {out} to continue it, or choose another --out",
                            about=_about))


def check_out(out: Path, overwrite: bool, data: Path | None = None) -> None:
    """OutputRefused (a ValueError: one line naming what is there) unless `out` may receive a new run
    (serving/bundle/output.py). `data`: the dataset's folder or file, when it has one on disk."""
    output.check(out, "run", overwrite=overwrite, inputs=[data] if data is not None and data.exists() else [])


def clear_run(out: Path) -> list[str]:
    """Remove a run's own files from `out` (RUN_FILES, RUN_FOLDERS and their .tmp); the names kept."""
    out = Path(out)
    if not out.is_dir():
        return []
    own = set(RUN_FILES) | set(RUN_FOLDERS)
    own |= {name + ".tmp" for name in own}
    kept = []
    for entry in sorted(out.iterdir()):
        if entry.name not in own:
            kept.append(entry.name)
        elif entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    return kept


def make_out(out: Path) -> None:
    """The run folder, created with its parents."""
    os.makedirs(out, exist_ok=True)
