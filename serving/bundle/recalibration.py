"""A bundle's calibration replaced (`slc calibrate`, docs/calibration.md), and read back by a running
server (`POST /v1/admin/reload-calibration`, docs/api.md). The bundle format only: no trainer, no torch.

Writing: a staging directory next to the output gets copies of the bundle's files (not hard links:
onnx's checker refuses external data with several links, and a later in-place write into one
bundle must not reach another), the calibration being replaced as calibration.previous.json, the
new calibration.json, and a manifest hashing them all; the stage must pass `slc verify` before it
takes the output's place (swap_dir: one rename exchange where Linux can, so a reader never finds
the folder missing).

Reading back: manifest and calibration through one directory handle, so a swap between the two
reads cannot pair the manifest of one bundle with the calibration of another; everything but the
calibration must be what the server loaded (else only a restart may serve it).
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from serving.bundle.calibration import calibration_limit, parse_calibration
from serving.bundle.format import (MANIFEST, SELF_HASH_KEY, BundleError, canonical_manifest_hash, carry_files,
                                   json_load, write_manifest)
from serving.bundle.output import OutputRefused, check, real_target, staged
from serving.bundle.verify import MAX_MANIFEST_BYTES, inspect_bundle, parse_manifest, verify_bundle

CALIBRATION = "calibration.json"
PREVIOUS = "calibration.previous.json"  # the calibration the current one replaced (one generation)
CALIBRATION_FILES = (CALIBRATION, PREVIOUS)
# manifest keys a recalibration rewrites; every other one must stay what the server loaded
REWRITTEN = ("files", SELF_HASH_KEY, "calibration_target", "recalibration")


class RecalibrationError(ValueError):
    """The recalibrated bundle cannot be written; one line."""


class SourceRefused(RecalibrationError):
    """The bundle cannot be recalibrated, or not into that output: said before any work; one line."""


@dataclass
class Source:
    """A bundle about to be recalibrated, read once (`read_source`): everything `slc calibrate` takes from it."""

    path: Path
    manifest: dict
    calibration: dict  # as written: the previous thresholds, method and target
    weight: np.ndarray  # [D, d] memory-mapped
    bias: np.ndarray  # [D]
    negatives: tuple | None  # (embeddings [n, d], labels [n]) memory-mapped, when the bundle carries them
    target: Path | None = None  # the folder the recalibrated bundle goes to (open_source)


def open_source(bundle: Path, out: Path | None, in_place: bool, overwrite: bool = False) -> Source:
    """The bundle read once for `slc calibrate`, with the folder to write (`out`, or BUNDLE itself with
    `in_place`: check_out), if it loads and takes images; SourceRefused (one line) otherwise, before any
    image is decoded."""
    target = check_out(bundle, bundle if in_place else out, in_place, overwrite)
    problems, _ = inspect_bundle(bundle, deep=False)
    if problems:
        raise SourceRefused(f"{bundle} does not load, so it is not recalibrated: {problems[0]}")
    source = read_source(bundle)
    if not isinstance(source.manifest.get("image"), dict):
        raise SourceRefused(f"{bundle} takes no images (its manifest has no image spec): recalibrate it "
                            "with slc export on its run instead")
    source.target = target
    return source


def read_source(bundle: Path) -> Source:
    """The manifest, calibration, head rows and calibration embeddings of a bundle that `inspect_bundle`
    accepted (the caller checks first): the one place that knows their file names."""
    from serving.bundle.negatives import read_negatives
    from serving.bundle.npy import open_head

    manifest, calibration = (json_load((bundle / name).read_bytes()) for name in (MANIFEST, CALIBRATION))
    weight, bias, _ = open_head(bundle, manifest)
    return Source(bundle, manifest, calibration, weight, bias, read_negatives(bundle))


class BundleChanged(ValueError):
    """The folder now holds another model than the one being served: only a restart may serve it."""


class CalibrationInvalid(ValueError):
    """The folder's calibration does not match its manifest or is not a calibration."""


# ------------------------------------------------------------------------------ writing
def check_out(source: Path, out: Path, in_place: bool, overwrite: bool = False) -> Path:
    """The folder to write (the real bundle with `in_place`, its symlinks followed), or
    RecalibrationError (one line) for an output that must not be written, before any work."""
    try:
        if not in_place and real_target(out) == Path(source).resolve():
            raise SourceRefused(f"--out {out} is the bundle itself; pass --in-place to replace it")
        return check(out, "bundle", overwrite=overwrite, inputs=[source], in_place=in_place)
    except OutputRefused as exc:
        raise SourceRefused(str(exc)) from None


def write_recalibrated(source: Path, calibration: dict, out: Path, note: dict, head=None, *,
                       in_place: bool = False, overwrite: bool = False) -> Path:
    """Write the bundle `source` with `calibration` to `out` (`in_place`: `source` itself is replaced,
    through its symlinks); `note` goes into the manifest's `recalibration` entry. `head`: new rows
    [D, d] (sliced like an array: serving/calibration/adapt.py), written with the graphs, samples and quantized
    heads that read them (serving/bundle/newhead.py). Verified before it takes `out`'s place."""
    from serving.bundle.newhead import write_new_head  # onnx: not imported by a server

    source = Path(source)
    in_place = in_place or Path(out).resolve() == source.resolve()
    manifest = json.loads((source / MANIFEST).read_text())  # as written: the full class list
    try:
        with staged(out, "bundle", overwrite=overwrite, inputs=[source], in_place=in_place,  # the output checked
                    verify=_verified) as stage:
            (stage / CALIBRATION).write_text(json.dumps(calibration, indent=1, allow_nan=False) + "\n")
            changed = {"calibration_target": calibration["target"],
                       "recalibration": {**note, "previous_calibration": PREVIOUS}}
            replaced = {PREVIOUS}
            if head is not None:
                new = write_new_head(source, stage, [head], np.load(source / "head_bias.npy", allow_pickle=False),
                                     manifest, trained=head.shape[0])
                changed, replaced = {**changed, **new.manifest}, replaced | new.replaced
            known = carry_files(source, stage, manifest["files"], skip=replaced, renamed={CALIBRATION: PREVIOUS})
            write_manifest(stage, {**manifest, **changed}, known_hashes=known)
    except (OutputRefused, BundleError) as exc:
        raise RecalibrationError(str(exc)) from None
    return real_target(out, in_place)


def _verified(stage: Path) -> list[str]:
    if problems := verify_bundle(stage):
        raise RecalibrationError("the recalibrated bundle fails verification, nothing was written: "
                                 + "; ".join(problems[:3]))
    return []


def previous_digests(path: Path, expect: str | None = None) -> list[str]:
    """The sha256 the folder's manifest.json may have had before its last recalibration, rebuilt as
    write_recalibrated changed it: this manifest without `recalibration`, its calibration.json entry
    that of calibration.previous.json, `calibration_target` that calibration's target (an export) or
    absent (a synthetic bundle). Only a first recalibration of the same head can be rebuilt; [] else.
    Why: enrolled classes an older slc stored under that digest belong to this model (docs/api.md).
    `expect`: the sha256 the manifest must have (the one loaded), else [] (the folder changed since)."""
    try:
        data = (path / MANIFEST).read_bytes()
        if expect is not None and hashlib.sha256(data).hexdigest() != expect:
            return []
        manifest = json.loads(data)
        files = manifest.get("files") or {}
        if "recalibration" not in manifest or PREVIOUS not in files:
            return []
        target = json.loads((path / PREVIOUS).read_bytes()).get("target")
    except (OSError, ValueError, AttributeError):
        return []
    base = {k: v for k, v in manifest.items() if k not in ("recalibration", SELF_HASH_KEY)}
    base["files"] = {k: (files[PREVIOUS] if k == CALIBRATION else v) for k, v in files.items() if k != PREVIOUS}
    variants = [{k: v for k, v in base.items() if k != "calibration_target"}]
    if "calibration_target" in base and target is not None:
        variants.append({**base, "calibration_target": target})
    digests = []
    for m in variants:
        m[SELF_HASH_KEY] = canonical_manifest_hash(m)
        text = json.dumps(m, indent=1, allow_nan=False) + "\n"
        digests.append(hashlib.sha256(text.encode()).hexdigest())
    return digests


# ------------------------------------------------------------------------------ reading back (the server)
@dataclass
class Snapshot:
    """A bundle folder's manifest and calibration, read together."""

    manifest: dict
    manifest_bytes: bytes
    calibration: dict  # per_class as a PerClassCalibration view
    arrays: dict  # float32 [D] threshold, a, b, ...
    sha256: str  # of calibration.json


def read_snapshot(path: Path, loaded: dict, classes) -> Snapshot:
    """The calibration now in the bundle folder `path`, checked against its manifest (hash, size,
    content), whose model must be `loaded` (manifest) with class names `classes`.
    BundleChanged / CalibrationInvalid, one line each."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        dfd = os.open(path, flags)
    except OSError as exc:
        raise CalibrationInvalid(f"the bundle folder {path} cannot be opened ({exc.strerror})") from None
    try:
        manifest_bytes = _read_at(dfd, MANIFEST, MAX_MANIFEST_BYTES)
        manifest, problems = parse_manifest(manifest_bytes)
        if problems:
            raise CalibrationInvalid(problems[0])
        if changed := model_changes(loaded, manifest, classes):
            raise BundleChanged(f"the bundle folder {path} now holds another model ({', '.join(changed[:3])} "
                                "changed): restart the server to serve it")
        entry = manifest["files"].get(CALIBRATION) or {}
        data = _read_at(dfd, CALIBRATION, calibration_limit(manifest["num_classes"]))
    finally:
        os.close(dfd)
    digest = hashlib.sha256(data).hexdigest()
    if entry.get("sha256") != digest or entry.get("bytes") != len(data):
        raise CalibrationInvalid(f"{CALIBRATION}: sha256 {digest[:12]}… does not match {MANIFEST}")
    calibration, arrays, problems = parse_calibration(data, int(manifest["num_classes"]))
    if problems:
        raise CalibrationInvalid(problems[0])
    return Snapshot(manifest, manifest_bytes, calibration, arrays, digest)


def model_changes(loaded: dict, new: dict, classes) -> list[str]:
    """What differs between two manifests besides the calibration: files, manifest keys, class names."""
    old_files, new_files = ({k: v for k, v in m["files"].items() if k not in CALIBRATION_FILES} for m in (loaded, new))
    changed = [k for k in sorted(old_files.keys() | new_files.keys()) if old_files.get(k) != new_files.get(k)]
    changed += [f"manifest key {k!r}" for k in sorted(loaded.keys() | new.keys())
                if k not in REWRITTEN and k != "classes" and loaded.get(k) != new.get(k)]
    names = new["classes"]
    if len(names) != len(classes) or any(a != b for a, b in zip(names, classes)):
        changed.append("class names")
    return changed


def _read_at(dfd: int, name: str, limit: int) -> bytes:
    """A regular file's bytes, opened relative to the directory handle (no symlink, no FIFO wait)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(name, flags, dir_fd=dfd)
    except OSError as exc:
        raise CalibrationInvalid(f"{name}: cannot be opened ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CalibrationInvalid(f"{name}: not a regular file")
        if st.st_size > limit:
            raise CalibrationInvalid(f"{name}: {st.st_size} bytes is over the limit of {limit}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(st.st_size + 1)
    finally:
        os.close(fd)
