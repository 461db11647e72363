"""calibration.json read into float32 arrays [D] (threshold, Platt a/b, precision, recall):
a 1M-class calibration is a million dicts, which the server must not keep."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from serving.bundle.files import read_bounded
from serving.bundle.format import json_load

# per_class fields kept as float32 arrays [D]: name -> path inside one calibration.json entry
_PER_CLASS_OPTIONAL = {"precision": ("precision",), "recall": ("recall",),
                       "test_precision": ("test", "precision"), "test_recall": ("test", "recall")}


class PerClassCalibration(Sequence):
    """`calibration["per_class"]` without a million dicts: entry j rebuilt from the float32 arrays on demand."""

    __slots__ = ("arrays",)

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays = arrays

    def __len__(self) -> int:
        return len(self.arrays["threshold"])

    def __getitem__(self, j):
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        j = int(j)
        if j < 0:
            j += len(self)
        if not 0 <= j < len(self):
            raise IndexError(f"class index {j} out of range")
        arr = self.arrays
        entry: dict[str, Any] = {"class_id": j, "threshold": float(arr["threshold"][j])}
        for key in ("precision", "recall"):
            if key in arr:
                entry[key] = float(arr[key][j])
        entry["platt"] = {"a": float(arr["a"][j]), "b": float(arr["b"][j])}
        if "test_precision" in arr and "test_recall" in arr:
            entry["test"] = {"precision": float(arr["test_precision"][j]), "recall": float(arr["test_recall"][j])}
        return entry

    def __repr__(self) -> str:
        return f"PerClassCalibration({len(self)} classes: {', '.join(self.arrays)})"


# The largest float32: a number beyond it becomes inf in the head's precision (thresholds, Platt a/b
# and biases are float32 arrays beside float32 rows), so it is refused, never rounded into range.
FLOAT32_MAX = float(np.finfo(np.float32).max)


def float32_finite(values):
    """|x| <= FLOAT32_MAX: finite once the server keeps it in float32 (NaN and inf fail too). For a
    number or an array (then elementwise). The one rule for every number a bundle or an enrolled class
    carries, shared by `slc verify`, the server's calibration reload, enrollment replay and `slc bundle fold`."""
    with np.errstate(invalid="ignore"):
        return np.abs(np.asarray(values, dtype=np.float64)) <= FLOAT32_MAX


def is_number(x) -> bool:
    """A JSON number (not a bool) that is finite in float32 (`float32_finite`)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return bool(abs(float(x)) <= FLOAT32_MAX)
    except OverflowError:  # an integer beyond any float
        return False


def number_problem(what: str, x) -> str | None:
    """`what` and why `x` is not a number the server can keep, or None: one phrase for a one-line message."""
    if is_number(x):
        return None
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return f"{what} is {type(x).__name__}, not a number"
    return f"{what} {x:.6g} is not finite in float32 (|x| > {FLOAT32_MAX:.6g})"


def calibration_arrays(calibration: dict, num_classes: int) -> dict[str, np.ndarray]:
    """per_class list -> float32 arrays [D] of threshold, a, b (and precision, recall, test_precision,
    test_recall when every entry has them); ValueError naming the first bad entry.

    Vectorised (np.fromiter) because a 1M-class calibration.json is a million dicts.
    """
    per = calibration.get("per_class") if isinstance(calibration, dict) else None
    if not isinstance(per, list) or len(per) != num_classes:
        got = len(per) if isinstance(per, list) else type(per).__name__
        raise ValueError(f"'per_class' must hold one entry per class ({num_classes}), got {got}")
    try:
        ids = np.fromiter((e["class_id"] for e in per), dtype=np.int64, count=num_classes)
        out = {
            "threshold": np.fromiter((e["threshold"] for e in per), dtype=np.float64, count=num_classes),
            "a": np.fromiter((e["platt"]["a"] for e in per), dtype=np.float64, count=num_classes),
            "b": np.fromiter((e["platt"]["b"] for e in per), dtype=np.float64, count=num_classes),
        }
        bad = ids != np.arange(num_classes)
        for v in out.values():
            bad |= ~float32_finite(v)
    except (KeyError, TypeError, ValueError, OverflowError):
        bad = None
    if bad is None or bad.any():
        # slow path only to name the first bad entry
        for j, e in enumerate(per):
            if problem := _entry_problem(j, e):
                raise ValueError(f"per_class[{j}]: {problem}")
        raise ValueError("per_class entries are not numbers")  # pragma: no cover
    for key, where in _PER_CLASS_OPTIONAL.items():
        values = _optional_field(per, where, num_classes)
        if values is not None:
            out[key] = values
    return {k: v.astype(np.float32) for k, v in out.items()}


def _entry_problem(j: int, e) -> str | None:
    """What is wrong with per_class entry j, or None."""
    if not isinstance(e, dict) or e.get("class_id") != j:
        return f"needs class_id {j}, a threshold and platt {{a, b}}"
    platt = e.get("platt")
    if not isinstance(platt, dict):
        return "needs platt {a, b}"
    for what, x in (("threshold", e.get("threshold")), ("platt a", platt.get("a")), ("platt b", platt.get("b"))):
        if problem := number_problem(what, x):
            return problem
    return None


def _optional_field(per: list, where: tuple[str, ...], num_classes: int) -> np.ndarray | None:
    """The number at `where` in every entry as float64 [D], or None when any entry lacks a finite one."""
    def get(e):
        for key in where:
            e = e[key]
        if not is_number(e):
            raise TypeError
        return e

    try:
        return np.fromiter((get(e) for e in per), dtype=np.float64, count=num_classes)
    except (KeyError, TypeError, ValueError, OverflowError):
        return None


def lookalikes_problem(value, num_classes: int) -> str | None:
    """What is wrong with calibration.json's optional `lookalikes` {"pairs": [[a, b], ...], "note"}, or None:
    each pair two different class ids of the bundle, ints 0..D-1 (serving/core/lookalikes.py reads them)."""
    if not isinstance(value, dict) or not isinstance(value.get("pairs"), list):
        got = type(value.get("pairs") if isinstance(value, dict) else value).__name__
        return f"'lookalikes' must be {{'pairs': [[a, b], ...]}} (class ids), got {got}"
    for i, pair in enumerate(value["pairs"]):
        if not (isinstance(pair, list) and len(pair) == 2
                and all(isinstance(c, int) and not isinstance(c, bool) for c in pair)):
            return f"lookalikes pair {i} is {_shown(pair)}, not two class ids [a, b]"
        a, b = pair
        if not (0 <= a < num_classes and 0 <= b < num_classes):
            return f"lookalikes pair {i} {pair}: class ids must be 0..{num_classes - 1}"
        if a == b:
            return f"lookalikes pair {i} {pair}: a class is not its own look-alike"
    return None


def _shown(x, limit: int = 40) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[:limit] + "…"


def calibration_limit(num_classes: int) -> int:
    """The most bytes calibration.json may hold: about 200 bytes per class, a bound far above it."""
    return (1 << 20) + 4096 * int(num_classes)


def read_calibration(path: Path, manifest: dict) -> tuple[dict | None, dict | None, list[str]]:
    """(calibration, arrays, problems); strict JSON, so every number in it is finite."""
    name = "calibration.json"
    try:
        data = read_bounded(path / name, calibration_limit(manifest["num_classes"]))
    except FileNotFoundError:
        return None, None, [f"{name}: missing"]
    except Exception as e:  # noqa: BLE001
        return None, None, [f"{name}: not valid JSON ({e})"]
    return parse_calibration(data, int(manifest["num_classes"]))


def parse_calibration(data: bytes, num_classes: int) -> tuple[dict | None, dict | None, list[str]]:
    """read_calibration's checks on the file's bytes (the server's reload reads them itself)."""
    name = "calibration.json"
    try:
        cal = json_load(data)
    except Exception as e:  # noqa: BLE001
        return None, None, [f"{name}: not valid JSON ({e})"]
    problems = []
    if not isinstance(cal, dict):
        return None, None, [f"{name}: not a JSON object"]
    target = cal.get("target")
    if not (isinstance(target, dict) and len(target) == 1 and next(iter(target)) in ("precision", "recall", "quantile")
            and is_number(next(iter(target.values())))):
        problems.append(f"{name}: 'target' must be {{'precision'|'recall'|'quantile': number}}")
    g = cal.get("global")
    if not (isinstance(g, dict) and is_number(g.get("threshold"))):
        problems.append(f"{name}: 'global' needs a threshold finite in float32")
    try:
        arrays = calibration_arrays(cal, num_classes)
    except ValueError as e:
        problems.append(f"{name}: {e}")
        arrays = None
    if "lookalikes" in cal and (problem := lookalikes_problem(cal["lookalikes"], num_classes)):
        problems.append(f"{name}: {problem}")
    if problems:
        return None, arrays, problems
    cal["per_class"] = PerClassCalibration(arrays)  # the D dicts are freed here
    return cal, arrays, problems
