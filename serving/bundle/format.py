"""The bundle's format (docs/bundle-format.md): names, the manifest and its hashes.

Writers (trainer export, synthetic bundles) and readers (load, verify) share these, so the
format is defined once.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

import orjson

from serving.bundle.files import atomic_write_text

FORMAT = "slc-bundle"
FORMAT_VERSION = 1
GRAPH_KINDS = ("backbone", "full", "single")
REQUIRED_FILES = (
    "backbone.onnx", "full.onnx", "single.onnx", "head_weight.npy", "head_bias.npy", "calibration.json", "samples.npz",
)
MANIFEST = "manifest.json"
SELF_HASH_KEY = "content_sha256"  # hash of the manifest's canonical JSON without this key
GRAPH_IO = {  # kind -> (input names, output names)
    "backbone": (["input"], ["embedding"]),
    "full": (["input"], ["logits"]),
    "single": (["input", "class_id"], ["logit"]),
}
CHUNK = 1 << 20
MODEL_FILES = ("backbone.onnx", "head_weight.npy", "head_bias.npy")  # what a model key hashes (model_key)


class BundleError(Exception):
    """A bundle that cannot be used; the message names the bad file."""


def sha256_file(path: Path | str) -> tuple[str, int]:
    """(hex digest, bytes) streamed in 1 MiB chunks: never holds a big file in memory."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def canonical_manifest_hash(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != SELF_HASH_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def model_key(manifest: dict, classes: Sequence[str] | None = None) -> str:
    """What a row computed against this bundle depends on, as one sha256: the backbone (and its
    external data), the trained rows and biases, the class names, read from the manifest's `files`.
    Not calibration.json nor the manifest's own hash: a recalibration keeps the key, new head rows
    or a new export change it (enrolled classes are kept under it: docs/api.md "Enroll a class")."""
    files = manifest["files"]
    backbone_data = (manifest.get("external_data") or {}).get("backbone.onnx") or []
    h = hashlib.sha256(b"slc-model-key/1\n")
    for name in (*MODEL_FILES, *sorted(backbone_data)):
        h.update(f"{name}\0{files[name]['sha256']}\n".encode())
    names = manifest["classes"] if classes is None else classes
    h.update(orjson.dumps([str(c) for c in names]))
    return h.hexdigest()


def backbone_key(manifest: dict) -> str:
    """The backbone graph of a bundle as one sha256 (backbone.onnx and its external data, from the
    manifest's `files`): bundles with the same key compute the same embeddings, so a server running
    several of them shares one backbone session (serving/core/backbones.py)."""
    files = manifest["files"]
    backbone_data = (manifest.get("external_data") or {}).get("backbone.onnx") or []
    h = hashlib.sha256(b"slc-backbone-key/1\n")
    for name in ("backbone.onnx", *sorted(backbone_data)):
        h.update(f"{name}\0{files[name]['sha256']}\n".encode())
    return h.hexdigest()


def json_load(data: bytes) -> Any:
    """Strict JSON: orjson rejects NaN, Infinity and overflowing numbers (a bundle holds finite
    numbers), and parses a million-entry calibration.json far faster than json."""
    return orjson.loads(data)


def base_manifest(name: str, input_shape: Sequence[int], embed_dim: int, classes: Sequence[str], loss: dict,
                  backbone: dict, training: dict, version: str = "1", **extra: Any) -> dict:
    """The manifest fields every bundle carries; `extra` adds writer-specific ones (files and the
    self-hash are filled in by write_manifest)."""
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "name": str(name),
        "version": str(version),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "input": {"shape": [int(s) for s in input_shape], "dtype": "float32"},
        "embed_dim": int(embed_dim),
        "num_classes": len(classes),
        "classes": [str(c) for c in classes],
        "loss": loss,
        "backbone": backbone,
        "training": training,
    }
    manifest.update(extra)
    return manifest


def carry_files(src: Path, out: Path, files: dict, skip=(), renamed: dict[str, str] | None = None
                ) -> dict[str, tuple[str, int]]:
    """The files `files` (a manifest's `files` entry) of the bundle `src` copied into `out` (copies, not
    links: a later write into one bundle must not reach another), but those in `skip`; a name in
    `renamed` under its new name. Their (sha256, bytes) as the manifest lists them, under the names
    written, for write_manifest (not read again: verify reads them once, on the new bundle).
    BundleError for a listed name that is not a plain file name."""
    import shutil

    renamed = renamed or {}
    known = {}
    for name, info in files.items():
        if name in skip:
            continue
        if "/" in name or "\\" in name or name in ("", ".", "..", MANIFEST):
            raise BundleError(f"{MANIFEST} lists a bad file name {name!r}")
        shutil.copyfile(Path(src) / name, Path(out) / renamed.get(name, name))
        known[renamed.get(name, name)] = (str(info["sha256"]), int(info["bytes"]))
    return known


def write_manifest(out: Path, manifest: dict, known_hashes: dict[str, tuple[str, int]] | None = None) -> Path:
    """Fill `files` with sha256/bytes of every other file in `out`, add the self-hash, write manifest.json.

    `known_hashes` lets writers that hashed a file while streaming it skip re-reading it.
    """
    out = Path(out)
    known_hashes = known_hashes or {}
    files = {}
    for p in sorted(out.iterdir()):
        if p.name == MANIFEST or not p.is_file():
            continue
        digest, size = known_hashes.get(p.name) or sha256_file(p)
        if size != p.stat().st_size:
            digest, size = sha256_file(p)
        files[p.name] = {"sha256": digest, "bytes": size}
    manifest = dict(manifest, files=files)
    manifest.pop(SELF_HASH_KEY, None)
    manifest[SELF_HASH_KEY] = canonical_manifest_hash(manifest)
    return atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1, allow_nan=False) + "\n")
