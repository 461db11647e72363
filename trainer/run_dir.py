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

# Every name `slc train` writes into a run folder (files, then folders); `NAME.tmp` too (atomic writes).
RUN_FILES = ("config.json", "data.json", "checkpoint.pt", "best.pt", "metrics.json", "history.csv", "curves.png")
RUN_FOLDERS = ("checkpoints", "tensorboard")
RUN_KEYS = ("loss", "dataset", "steps")  # of a run's config.json
SHOW = 4  # names listed when a folder is described


def run_config(path: Path) -> dict | None:
    """The run config in `path`/config.json when `path` is a run folder, else None."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or not all(k in config for k in RUN_KEYS) or not (path / "data.json").is_file():
        return None
    return config


def describe(path: Path) -> str:
    """What a folder holds, in a few words: `data/, notes.txt and 3 more`."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    shown = ", ".join(names[:SHOW])
    return shown + (f" and {len(names) - SHOW} more" if len(names) > SHOW else "")


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def check_out(out: Path, overwrite: bool, data: Path | None = None) -> None:
    """ValueError (one line naming what is there) unless `out` may receive a new run (module doc).
    `data`: the dataset's folder or file, when it has one on disk."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        kind = "a file" if out.is_file() else "not a folder"
        raise ValueError(f"--out {out} is {kind} ({out.stat().st_size:,} bytes); give a new folder for the run")
    real, cwd = out.resolve(), Path.cwd().resolve()
    if _inside(cwd, real):
        what = "the current folder" if real == cwd else f"a folder above the current one ({cwd})"
        raise ValueError(f"--out {out} is {what}; give a new folder for the run, e.g. --out runs/NAME")
    if data is not None and data.exists():
        data = data.resolve()
        if _inside(data, real):
            raise ValueError(f"--out {out} holds the data ({data}); give a folder outside it for the run")
        if data.is_dir() and _inside(real, data):
            raise ValueError(f"--out {out} lies inside the image folder {data}; its files would become data: "
                             "give a folder outside it")
    if not out.is_dir() or not any(out.iterdir()):
        return
    config = run_config(out)
    if config is None:
        raise ValueError(f"--out {out} is not a run of slc train (it holds {describe(out)}); give a new or empty "
                         "folder (--overwrite replaces only a run)")
    if not overwrite:
        status = config.get("status", "finished")
        raise ValueError(f"--out {out} already holds a run ({config['loss']} on {config['dataset']}, {status}); "
                         f"add --overwrite to replace it, --resume {out} to continue it, or choose another --out")


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
