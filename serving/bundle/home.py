"""Where slc keeps its files: `SLC_HOME` (default ~/.cache/slc). The one place that resolves it.

Under it: default-bundle/ (the embedded model), data/ (gallery and index cache of `slc serve`),
bench/ (cached synthetic bundles of `slc bench`), runs and datasets of the trainer.
"""
from __future__ import annotations

import os
from pathlib import Path


def slc_home() -> Path:
    """$SLC_HOME, else ~/.cache/slc; `~` expanded, not created."""
    return Path(os.environ.get("SLC_HOME") or Path.home() / ".cache" / "slc").expanduser()
