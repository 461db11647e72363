"""`load_bundle(path)`: a bundle opened for serving, the head memory-mapped, never copied.

Memory at large D (the head is the only thing allowed to scale with D): calibration.json is
parsed once into float32 arrays before the per-class dicts are dropped; class names
"0".."D-1" are kept as `IdNames`, which stores nothing; `release_memory()` hands the freed
heap back to the OS after start-up. `load_bundle(verify=False)` checks manifest, head shapes
and calibration only; with verify it runs every check of `slc verify` first.
"""
from __future__ import annotations

import gc
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from serving.bundle.format import GRAPH_KINDS, BundleError
from serving.bundle.names import IdNames, compact_names
from serving.bundle.verify import inspect_bundle

_DECIMAL_ID = re.compile(r"-?[0-9]{1,18}")  # ASCII only: str.isdigit() also accepts "²"


def release_memory() -> None:
    """Collect garbage and return freed heap pages to the OS (glibc keeps freed arenas otherwise).

    Called after start-up: parsing a 1M-class bundle frees hundreds of MB that would stay resident.
    """
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


# ---------------------------------------------------------------- the loaded bundle


@dataclass
class Bundle:
    path: Path
    manifest: dict
    calibration: dict  # calibration.json; "per_class" is a PerClassCalibration view over float32 arrays
    name: str
    input_shape: tuple[int, ...]
    embed_dim: int
    num_classes: int
    classes: Sequence  # of str: a list, or IdNames when the names are "0".."D-1"
    weight: np.ndarray  # [D, d] float32, memory-mapped read-only
    bias: np.ndarray  # [D] float32
    thresholds: np.ndarray  # [D] float32 per-class calibrated threshold
    platt_a: np.ndarray  # [D] float32
    platt_b: np.ndarray  # [D] float32
    global_threshold: float
    digest: str  # sha256 hex of manifest.json bytes
    image: dict | None = None  # how an image becomes one input (manifest "image"; serving/codecs/images.py)
    heads: dict = field(default_factory=dict)  # quantized heads {precision: {"weight", "scale"}} (bundle/quantize.py)
    _class_index: dict[str, int] | None = field(default=None, repr=False, compare=False)

    def graph_path(self, kind: str) -> Path:
        if kind not in GRAPH_KINDS:
            raise ValueError(f"unknown graph kind {kind!r}; known: {', '.join(GRAPH_KINDS)}")
        return self.path / f"{kind}.onnx"

    def class_id(self, ref: str | int) -> int:
        """A class name from the manifest, else an integer id (int or decimal string); KeyError if unknown."""
        if isinstance(ref, (int, np.integer)) and not isinstance(ref, bool):
            if 0 <= int(ref) < self.num_classes:
                return int(ref)
            raise KeyError(f"class id {ref} out of range 0..{self.num_classes - 1}")
        if isinstance(ref, str):
            if isinstance(self.classes, IdNames):
                j = self.classes.id_of(ref)
                if j is not None:
                    return j
            else:
                if self._class_index is None:  # built on the first name lookup
                    self._class_index = {name: i for i, name in enumerate(self.classes)}
                if ref in self._class_index:
                    return self._class_index[ref]
            if _DECIMAL_ID.fullmatch(ref) and 0 <= int(ref) < self.num_classes:  # no trimming: " 7" is not 7
                return int(ref)
        raise KeyError(f"unknown class {ref!r}")


def load_bundle(path: Path | str, verify: bool = True) -> Bundle:
    """Open a bundle directory (head memory-mapped); with verify, every check of verify_bundle first."""
    path = Path(path)
    problems, parts = inspect_bundle(path, deep=verify)
    if problems:
        raise BundleError("; ".join(problems))
    manifest, calibration, arrays = parts["manifest"], parts["calibration"], parts["arrays"]
    weight, bias, manifest_bytes = parts["weight"], parts["bias"], parts["manifest_bytes"]
    heads = parts.get("heads") or {}
    classes = compact_names(manifest["classes"])
    manifest["classes"] = classes  # the parsed list of D strings goes; the self-hash was checked on it already
    parts.clear()
    gc.collect()
    return Bundle(
        path=path,
        manifest=manifest,
        calibration=calibration,
        name=str(manifest["name"]),
        input_shape=tuple(int(s) for s in manifest["input"]["shape"]),
        embed_dim=int(manifest["embed_dim"]),
        num_classes=int(manifest["num_classes"]),
        classes=classes,
        weight=weight,
        bias=bias,
        thresholds=arrays["threshold"],
        platt_a=arrays["a"],
        platt_b=arrays["b"],
        global_threshold=float(calibration["global"]["threshold"]),
        digest=hashlib.sha256(manifest_bytes).hexdigest(),
        image=manifest.get("image"),
        heads=heads,
    )

