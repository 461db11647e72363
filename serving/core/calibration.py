"""The thresholds the engine decides with, as ONE immutable object swapped whole (docs/api.md,
`POST /v1/admin/reload-calibration`): a query reads `engine.classes.calibration` once, so it decides with
all old or all new thresholds, Platt parameters and global fallback, never a mix. Protocol-free."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from serving.core import lookalikes as _lookalikes
from serving.errors import Conflict


@dataclass(frozen=True)
class Thresholds:
    """One calibration.json as the engine uses it."""

    threshold: np.ndarray  # [D] float32 per-class calibrated threshold
    platt_a: np.ndarray  # [D] float32
    platt_b: np.ndarray  # [D] float32
    global_threshold: float
    finite: bool  # every per-class threshold finite (else those classes fall back to the global one); True for
    # every calibration.json read through serving/bundle/calibration.py, which refuses numbers beyond float32
    calibration: dict  # calibration.json, per_class as a PerClassCalibration view
    sha256: str  # of calibration.json as the manifest lists it
    digest: str  # sha256 of the manifest.json bytes it came with

    @classmethod
    def of(cls, arrays: dict, calibration: dict, sha256: str, digest: str) -> Thresholds:
        threshold = np.asarray(arrays["threshold"])
        return cls(threshold, np.asarray(arrays["a"]), np.asarray(arrays["b"]),
                   float(calibration["global"]["threshold"]), bool(np.isfinite(threshold).all()),
                   calibration, sha256, digest)

    @classmethod
    def of_bundle(cls, bundle) -> Thresholds:
        sha = str(((bundle.manifest.get("files") or {}).get("calibration.json") or {}).get("sha256", ""))
        return cls.of({"threshold": bundle.thresholds, "a": bundle.platt_a, "b": bundle.platt_b},
                      bundle.calibration, sha, bundle.digest)

    def of_class(self, j: int) -> float:
        t = float(self.threshold[j])
        return t if math.isfinite(t) else self.global_threshold

    def of_classes(self, ids: np.ndarray) -> np.ndarray:
        """[N] float64 thresholds of class ids [N] (of_class's fallback rule)."""
        thr = self.threshold[ids].astype(np.float64)
        if not self.finite:
            thr[~np.isfinite(thr)] = self.global_threshold
        return thr

    @cached_property
    def lowest(self) -> float:
        """The least threshold any trained class decides with (of_class's rule): a logit below it matches
        no trained class, which tells an open-set top-k that nothing past its k entries can match."""
        finite = self.threshold[np.isfinite(self.threshold)]
        low = float(finite.min()) if finite.size else math.inf
        return low if self.finite else min(low, self.global_threshold)

    @cached_property
    def lookalikes(self) -> _lookalikes.Lookalikes:
        """The bundle's look-alike pairs (calibration.json `lookalikes`, written by `slc bundle fold`):
        of two classes of a pair, an input matches only the one it passes by more (serving/core/lookalikes.py)."""
        return _lookalikes.from_calibration(self.calibration, len(self.threshold))


def reload(bundle, current: Thresholds, expect_sha256: str | None) -> tuple[Thresholds, dict, dict]:
    """The calibration now in the served bundle's folder (checked: serving/bundle/recalibration.py), the
    manifest it came with, and the answer saying what changed. Conflict (409) when the folder holds
    another model, a calibration that does not match its manifest, or not the one `expect_sha256`
    names. Blocking: run off the loop."""
    from serving.bundle.recalibration import BundleChanged, CalibrationInvalid, read_snapshot

    try:
        snap = read_snapshot(bundle.path, bundle.manifest, bundle.classes)
    except BundleChanged as exc:
        raise Conflict(str(exc), code="bundle_changed") from None
    except CalibrationInvalid as exc:
        raise Conflict(f"{exc}; the served calibration is unchanged", code="calibration_invalid") from None
    if expect_sha256 is not None and snap.sha256 != expect_sha256:
        raise Conflict(f"the bundle folder holds calibration.json {snap.sha256[:12]}…, not the expected "
                       f"{expect_sha256[:12]}…; the served calibration is unchanged", code="calibration_unexpected")
    new = Thresholds.of(snap.arrays, snap.calibration, snap.sha256, hashlib.sha256(snap.manifest_bytes).hexdigest())
    moved = int(np.count_nonzero(new.threshold != current.threshold))
    answer = {"reloaded": new.sha256 != current.sha256, "calibration_sha256": new.sha256,
              "previous_sha256": current.sha256, "digest": new.digest, "target": snap.calibration.get("target"),
              "method": snap.calibration.get("method"), "classes_changed": moved,
              "recalibration": snap.manifest.get("recalibration")}
    return new, snap.manifest, answer
