"""`slc verify` and the checks load_bundle runs: manifest (format, header, its own content
hash), sha256 and size of every listed file (streamed), head shapes, calibration (strict JSON,
one entry per class), onnx.checker with full_check on each graph by path (external data is
never loaded by the checker), I/O names and a plain Gather in single.onnx, and samples.npz
re-run through all three graphs with onnxruntime, plus the single logits recomputed from the
.npy rows, and the calibration negatives when present (serving/bundle/negatives.py). Every problem
is one line naming its file. No torch here, ever.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from serving.bundle.calibration import read_calibration
from serving.bundle.imagespec import check_image_spec
from serving.bundle.format import MANIFEST, REQUIRED_FILES, SELF_HASH_KEY, FORMAT, FORMAT_VERSION, canonical_manifest_hash, json_load, sha256_file
from serving.bundle.files import not_regular, read_bounded
from serving.bundle.quantize import check_heads, open_heads
from serving.bundle.graphs import check_graphs
from serving.bundle.negatives import check_negatives
from serving.bundle.npy import open_head
from serving.bundle.session import ort_session

MAX_MANIFEST_BYTES = 1 << 30  # class names of millions of classes fit many times over
SAMPLE_RTOL = 1e-4
SAMPLE_ATOL = 1e-4


def verify_bundle(path: Path | str) -> list[str]:
    """Every problem found, each naming its file; [] when the bundle is sound."""
    return inspect_bundle(Path(path), deep=True)[0]


def _unsafe_files(path: Path, manifest: dict) -> list[str]:
    files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    names = sorted({*REQUIRED_FILES, *(n for n in files if isinstance(n, str) and "/" not in n and n not in ("", ".", ".."))})
    return [f"{name}: {why}" for name in names if (why := not_regular(path / name))]


def read_manifest(path: Path) -> tuple[dict | None, bytes, list[str]]:
    mpath = path / MANIFEST
    if not path.is_dir():
        return None, b"", [f"{path}: not a bundle directory"]
    if why := not_regular(mpath):
        return None, b"", [f"{MANIFEST}: {why}"]
    if not mpath.is_file():
        return None, b"", [f"{MANIFEST}: missing"]
    try:
        data = read_bounded(mpath, MAX_MANIFEST_BYTES)
    except (OSError, ValueError) as e:
        return None, b"", [f"{MANIFEST}: cannot be read ({e})"]
    manifest, problems = parse_manifest(data)
    return manifest, data, problems


def parse_manifest(data: bytes) -> tuple[dict | None, list[str]]:
    """The manifest from its bytes and every problem of its header (read_manifest's checks; the
    server's calibration reload reads the bytes itself, through a directory handle)."""
    try:
        manifest = json_load(data)
    except Exception as e:  # noqa: BLE001 - any parse failure is the file's fault
        return None, [f"{MANIFEST}: not valid JSON ({e})"]
    if not isinstance(manifest, dict):
        return None, [f"{MANIFEST}: not a JSON object"]
    problems = []
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        problems.append(f"{MANIFEST}: format must be {FORMAT!r} version {FORMAT_VERSION}, "
                        f"got {manifest.get('format')!r} version {manifest.get('format_version')!r}")
    for key in ("name", "input", "embed_dim", "num_classes", "classes", "files"):
        if key not in manifest:
            problems.append(f"{MANIFEST}: missing key {key!r}")
    if problems:
        return None, problems
    if SELF_HASH_KEY not in manifest:
        problems.append(f"{MANIFEST}: missing {SELF_HASH_KEY}")
    else:
        try:
            if canonical_manifest_hash(manifest) != manifest[SELF_HASH_KEY]:
                problems.append(f"{MANIFEST}: content does not match its {SELF_HASH_KEY} (edited after export?)")
        except ValueError as e:
            problems.append(f"{MANIFEST}: {e}")
    try:
        D, d = int(manifest["num_classes"]), int(manifest["embed_dim"])
        shape = [int(s) for s in manifest["input"]["shape"]]
        if D < 1 or d < 1 or any(s < 1 for s in shape):
            problems.append(f"{MANIFEST}: num_classes, embed_dim and input shape must be positive")
        if len(manifest["classes"]) != D:
            problems.append(f"{MANIFEST}: {len(manifest['classes'])} class names for num_classes {D}")
        if manifest["input"].get("dtype", "float32") != "float32":
            problems.append(f"{MANIFEST}: input dtype must be float32")
        if manifest.get("image") is not None:
            bad = check_image_spec(manifest["image"], tuple(shape)) if isinstance(manifest["image"], dict) \
                else "image must be an object"
            if bad:
                problems.append(f"{MANIFEST}: {bad}")
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        problems.append(f"{MANIFEST}: bad header field ({e})")
    return manifest, problems  # with problems, so the caller can still report the other files


def check_files(path: Path, manifest: dict) -> list[str]:
    problems = []
    files = manifest.get("files")
    if not isinstance(files, dict):
        return [f"{MANIFEST}: 'files' must be an object"]
    for name in REQUIRED_FILES:
        if name not in files:
            problems.append(f"{name}: not listed in {MANIFEST}")
    for name, info in files.items():
        if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", "..") or name == MANIFEST:
            problems.append(f"{MANIFEST}: bad file name {name!r}")
            continue
        p = path / name
        if not p.is_file():
            problems.append(f"{name}: missing (listed in {MANIFEST})")
            continue
        try:
            want_hash, want_size = str(info["sha256"]), int(info["bytes"])
        except (KeyError, TypeError, ValueError):
            problems.append(f"{name}: {MANIFEST} entry needs sha256 and bytes")
            continue
        size = p.stat().st_size
        if size != want_size:
            problems.append(f"{name}: size {size} bytes, {MANIFEST} says {want_size}")
            continue
        digest, _ = sha256_file(p)
        if digest != want_hash:
            problems.append(f"{name}: sha256 {digest[:12]}… does not match {MANIFEST} ({want_hash[:12]}…)")
    return problems



def _close(got: np.ndarray, want: np.ndarray) -> bool:
    if got.shape != want.shape or not np.all(np.isfinite(got)):
        return False
    scale = max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
    return bool(np.allclose(got, want, rtol=SAMPLE_RTOL, atol=SAMPLE_ATOL * scale))


def check_samples(path: Path, manifest: dict, weight: np.ndarray | None, bias: np.ndarray | None) -> list[str]:
    """samples.npz through each graph vs the stored outputs; single logits vs the npy head rows."""
    name = "samples.npz"
    problems = []
    try:
        _check_unpacked_size(path / name)
        with np.load(path / name, allow_pickle=False) as f:
            s = {k: f[k] for k in f.files}
    except Exception as e:  # noqa: BLE001
        return [f"{name}: cannot be read ({e})"]
    need = ("input", "embedding", "logits", "logit_columns", "class_id", "logit")
    if missing := [k for k in need if k not in s]:
        return [f"{name}: missing arrays {missing}"]
    x = s["input"].astype(np.float32, copy=False)
    shape = tuple(int(v) for v in manifest["input"]["shape"])
    D = int(manifest["num_classes"])
    cols, cid = s["logit_columns"].astype(np.int64), s["class_id"].astype(np.int64)
    if x.shape[1:] != shape or len(x) < 1:
        return [f"{name}: input shape {list(x.shape)} does not match manifest input {list(shape)}"]
    if cols.size == 0 or cols.min() < 0 or cols.max() >= D or cid.shape != (len(x),) or cid.min() < 0 or cid.max() >= D:
        return [f"{name}: class ids out of range"]
    runs = {
        "backbone": ({"input": x}, lambda out: out, "embedding"),
        "full": ({"input": x}, lambda out: out[:, cols], "logits"),
        "single": ({"input": x, "class_id": cid}, lambda out: out, "logit"),
    }
    for kind, (feeds, pick, key) in runs.items():
        gname = f"{kind}.onnx"
        if not (path / gname).is_file():
            continue
        try:
            sess = ort_session(path / gname, prepack=False)
            out = sess.run(None, feeds)[0]
            del sess
        except Exception as e:  # noqa: BLE001
            problems.append(f"{gname}: onnxruntime cannot run it ({str(e).splitlines()[0][:300]})")
            continue
        want_shape = {"backbone": (len(x), int(manifest["embed_dim"])), "full": (len(x), D), "single": (len(x),)}[kind]
        if out.shape != want_shape:
            problems.append(f"{gname}: output {key!r} has shape {list(out.shape)} on {name}, expected {list(want_shape)}")
            continue
        got = pick(out)
        if not _close(got, s[key]):
            err = float(np.max(np.abs(got - s[key]))) if got.shape == s[key].shape else float("nan")
            problems.append(f"{gname}: output {key!r} on {name} differs from the stored one (max abs diff {err:.3g})")
    if weight is not None and bias is not None and weight.shape == (D, int(manifest["embed_dim"])) and bias.shape == (D,):
        h = s["embedding"].astype(np.float64)  # [n, d]
        rows = np.asarray(weight[cid], dtype=np.float64)  # [n, d]
        z = (h * rows).sum(axis=1) + bias[cid].astype(np.float64)  # [n]
        if not _close(z, s["logit"].astype(np.float64)):
            problems.append(f"head_weight.npy: rows (with head_bias.npy) do not reproduce the single logits in {name}")
    return problems


MAX_SAMPLES_BYTES = 256 << 20  # a few inputs and their outputs; far more is a decompression bomb


def _check_unpacked_size(p: Path) -> None:
    """Refuse an .npz whose members unpack to more than MAX_SAMPLES_BYTES (read from the zip
    directory, before anything is decompressed)."""
    import zipfile

    with zipfile.ZipFile(p) as z:
        total = sum(i.file_size for i in z.infolist())
    if total > MAX_SAMPLES_BYTES:
        raise ValueError(f"it unpacks to {total} bytes, over the limit of {MAX_SAMPLES_BYTES}")


def inspect_bundle(path: Path, deep: bool) -> tuple[list[str], dict]:
    """Problems and the parsed parts. Always: manifest, head shapes, calibration. Deep: + hashes,
    onnx checker, samples through the graphs."""
    manifest, manifest_bytes, problems = read_manifest(path)
    parts: dict[str, Any] = {"manifest": manifest, "manifest_bytes": manifest_bytes}
    if manifest is None:
        return problems, parts
    if unsafe := _unsafe_files(path, manifest):  # nothing else is opened: a FIFO would block, a link could move
        return problems + unsafe, parts
    if deep:
        problems += check_files(path, manifest)
    try:
        weight, bias, head_problems = open_head(path, manifest)
        problems += head_problems
        heads, quantized_problems = open_heads(path, manifest)
        problems += quantized_problems
        parts["heads"] = heads
        if deep and weight is not None and heads:
            problems += check_heads(weight, heads)
        calibration, arrays, cal_problems = read_calibration(path, manifest)
        problems += cal_problems
        problems += check_negatives(path, manifest, deep)
        parts.update(weight=weight, bias=bias, calibration=calibration, arrays=arrays)
        if deep:
            problems += check_graphs(path, manifest)
            problems += check_samples(path, manifest, weight, bias)
            # the checks' row reads mapped ~64 KiB around each row they read (the kernel's fault-around,
            # the files being in the page cache after hashing): fresh mappings hold none of it
            weight, bias, _ = open_head(path, manifest)
            parts.update(weight=weight, bias=bias, heads=open_heads(path, manifest)[0])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        problems.append(f"{MANIFEST}: {e}")
    # one line per problem, deduplicated, in order
    return list(dict.fromkeys(problems)), parts
