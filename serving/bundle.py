"""The model bundle (DESIGN.md §6): load, verify, and the format helpers writers share.

No torch here, ever: a serving image has numpy, onnx and onnxruntime only.

`verify_bundle(path)` (`slc verify`) and `load_bundle(path, verify=True)` run the same checks:
manifest (format, header, its own content hash), sha256 and size of every listed file
(streamed in 1 MiB chunks), head_weight.npy / head_bias.npy float32 shapes, calibration.json
(strict JSON so every number is finite, one entry per class), `onnx.checker` with
full_check on each graph *by path* (external data is never loaded by the checker), I/O names
and a plain Gather in single.onnx, and samples.npz re-run through all three graphs with
onnxruntime, plus the single logits recomputed from the .npy rows.

The full checker stays in load_bundle because it is cheap: on a synthetic bundle with
D = 1,000,000, d = 256 (1 GB of rows, external data) it took 0.1 s; hashing took 2 s,
parsing calibration.json 4 s, the samples (one onnxruntime session each for full and single,
over the memory-mapped external data, prepacking off so no copy of the head; freed at once)
2 s: load_bundle(verify=True) 12 s, verify=False 4.4 s, on two shared cores. `load_bundle(verify=False)` checks manifest, head shapes and calibration only.
The head is memory-mapped, never copied.

Memory at large D (the head is the only thing allowed to scale with D): calibration.json is
parsed once and turned into float32 arrays (threshold, Platt a/b, precision, recall) before the
million per-class dicts are dropped; `Bundle.calibration["per_class"]` is a read-only view that
rebuilds an entry on demand. Class names "0".."D-1" (synthetic bundles) are kept as `IdNames`, a
sequence that stores nothing. `release_memory()` hands the freed heap back to the OS after start-up.
"""
from __future__ import annotations

import gc
import hashlib
import json
import re
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Union

import numpy as np
import orjson

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
SAMPLE_RTOL = 1e-4
SAMPLE_ATOL = 1e-4
_CHUNK = 1 << 20


_DECIMAL_ID = re.compile(r"-?[0-9]{1,18}")  # ASCII only: str.isdigit() also accepts "²"


class BundleError(Exception):
    """A bundle that cannot be used; the message names the bad file."""


# ---------------------------------------------------------------- format helpers (writers too)


def sha256_file(path: Path | str) -> tuple[str, int]:
    """(hex digest, bytes) streamed in 1 MiB chunks: never holds a big file in memory."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def canonical_manifest_hash(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != SELF_HASH_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


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
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, out / MANIFEST)
    return out / MANIFEST


def _json_load(data: bytes) -> Any:
    """Strict JSON: orjson rejects NaN, Infinity and overflowing numbers (a bundle holds finite numbers);
    ~10x faster than json on a 1M-class calibration.json."""
    return orjson.loads(data)


# ---------------------------------------------------------------- compact per-class containers


class IdNames(Sequence):
    """Class names that are just the ids "0".."D-1": a sequence of str that stores only D.

    Equal to any sequence holding the same strings, so code written for a list keeps working.
    """

    __slots__ = ("_n",)

    def __init__(self, n: int):
        self._n = int(n)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, j):
        if isinstance(j, slice):
            return [str(i) for i in range(*j.indices(self._n))]
        j = int(j)  # np.integer too; TypeError for anything that is not an index
        if j < 0:
            j += self._n
        if not 0 <= j < self._n:
            raise IndexError(f"class index {j} out of range 0..{self._n - 1}")
        return str(j)

    def __iter__(self) -> Iterator[str]:
        return map(str, range(self._n))

    def id_of(self, name: Any) -> int | None:
        """The id whose name is exactly `name`, else None (no dict needed: the name is the id)."""
        if (type(name) is not str or not name.isascii() or not name.isdigit() or len(name) > 18
                or (len(name) > 1 and name[0] == "0")):
            return None
        j = int(name)
        return j if j < self._n else None

    def __contains__(self, name: object) -> bool:
        return self.id_of(name) is not None

    def index(self, name: Any, start: int = 0, stop: int | None = None) -> int:
        j = self.id_of(name)
        if j is None or not start <= j < (self._n if stop is None else stop):
            raise ValueError(f"{name!r} is not a class name")
        return j

    def count(self, name: Any) -> int:
        return int(self.id_of(name) is not None)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, IdNames):
            return self._n == other._n
        if isinstance(other, (list, tuple, Sequence)) and not isinstance(other, (str, bytes)):
            return len(other) == self._n and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # like a list

    def __repr__(self) -> str:
        return f"IdNames({self._n})"


def compact_names(raw: Sequence) -> Union[IdNames, list[str]]:
    """Manifest class names as str; IdNames when they are exactly "0".."D-1" (1M strings ≈ 60 MB saved)."""
    names = [c if type(c) is str else str(c) for c in raw]
    n = len(names)
    if n and names[0] == "0" and names[-1] == str(n - 1) and names == list(map(str, range(n))):
        return IdNames(n)
    return names


# per_class fields kept as float32 arrays [D]: name -> path inside one calibration.json entry
_PER_CLASS_REQUIRED = {"threshold": ("threshold",), "a": ("platt", "a"), "b": ("platt", "b")}
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
            text = ref.strip()
            if _DECIMAL_ID.fullmatch(text) and 0 <= int(text) < self.num_classes:
                return int(text)
        raise KeyError(f"unknown class {ref!r}")


def load_bundle(path: Path | str, verify: bool = True) -> Bundle:
    """Open a bundle directory (head memory-mapped); with verify, every check of verify_bundle first."""
    path = Path(path)
    problems, parts = _inspect(path, deep=verify)
    if problems:
        raise BundleError("; ".join(problems))
    manifest, calibration, arrays = parts["manifest"], parts["calibration"], parts["arrays"]
    weight, bias, manifest_bytes = parts["weight"], parts["bias"], parts["manifest_bytes"]
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
    )


def verify_bundle(path: Path | str) -> list[str]:
    """Every problem found, each naming its file; [] when the bundle is sound."""
    return _inspect(Path(path), deep=True)[0]


# ---------------------------------------------------------------- checks


def _read_manifest(path: Path) -> tuple[dict | None, bytes, list[str]]:
    mpath = path / MANIFEST
    if not path.is_dir():
        return None, b"", [f"{path}: not a bundle directory"]
    if not mpath.is_file():
        return None, b"", [f"{MANIFEST}: missing"]
    data = mpath.read_bytes()
    try:
        manifest = _json_load(data)
    except Exception as e:  # noqa: BLE001 - any parse failure is the file's fault
        return None, data, [f"{MANIFEST}: not valid JSON ({e})"]
    if not isinstance(manifest, dict):
        return None, data, [f"{MANIFEST}: not a JSON object"]
    problems = []
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        problems.append(f"{MANIFEST}: format must be {FORMAT!r} version {FORMAT_VERSION}, "
                        f"got {manifest.get('format')!r} version {manifest.get('format_version')!r}")
    for key in ("name", "input", "embed_dim", "num_classes", "classes", "files"):
        if key not in manifest:
            problems.append(f"{MANIFEST}: missing key {key!r}")
    if problems:
        return None, data, problems
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
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        problems.append(f"{MANIFEST}: bad header field ({e})")
    return manifest, data, problems  # with problems, so the caller can still report the other files


def _check_files(path: Path, manifest: dict) -> list[str]:
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


def _open_head(path: Path, manifest: dict) -> tuple[np.ndarray | None, np.ndarray | None, list[str]]:
    D, d = int(manifest["num_classes"]), int(manifest["embed_dim"])
    arrays, problems = [], []
    for name, shape in (("head_weight.npy", (D, d)), ("head_bias.npy", (D,))):
        try:
            _check_npy_header(path / name)
            arr = np.load(path / name, mmap_mode="r", allow_pickle=False)
        except Exception as e:  # noqa: BLE001
            problems.append(f"{name}: cannot be read as .npy ({str(e)[:200]})")
            arrays.append(None)
            continue
        if arr.dtype != np.float32 or arr.shape != shape or not arr.flags.c_contiguous:
            problems.append(f"{name}: expected float32 {list(shape)} C order, got {arr.dtype} {list(arr.shape)}"
                            f"{'' if arr.flags.c_contiguous else ' Fortran order'}")
        arrays.append(arr)
    return arrays[0], arrays[1], problems


def _check_npy_header(p: Path) -> None:
    """Parse the .npy header ourselves first: numpy's fallback parser takes seconds on a damaged one."""
    import ast

    with open(p, "rb") as f:
        head = f.read(12)
        if len(head) < 10 or head[:6] != b"\x93NUMPY" or head[6] not in (1, 2, 3):
            raise ValueError("not a .npy file (bad magic)")
        if head[6] == 1:
            length, start = int.from_bytes(head[8:10], "little"), 10
        else:
            length, start = int.from_bytes(head[8:12], "little"), 12
        if length > 1 << 16:
            raise ValueError(f"header of {length} bytes is too long")
        f.seek(start)
        text = f.read(length).decode("latin1")
    header = ast.literal_eval(text)
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise ValueError("header is not {descr, fortran_order, shape}")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


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
            bad |= ~np.isfinite(v)
    except (KeyError, TypeError, ValueError):
        bad = None
    if bad is None or bad.any():
        # slow path only to name the first bad entry
        for j, e in enumerate(per):
            ok = (isinstance(e, dict) and e.get("class_id") == j and _is_number(e.get("threshold"))
                  and isinstance(e.get("platt"), dict) and _is_number(e["platt"].get("a"))
                  and _is_number(e["platt"].get("b")))
            if not ok:
                raise ValueError(f"per_class[{j}] needs class_id {j}, a finite threshold and platt {{a, b}}")
        raise ValueError("per_class entries are not numbers")  # pragma: no cover
    for key, where in _PER_CLASS_OPTIONAL.items():
        values = _optional_field(per, where, num_classes)
        if values is not None:
            out[key] = values
    return {k: v.astype(np.float32) for k, v in out.items()}


def _optional_field(per: list, where: tuple[str, ...], num_classes: int) -> np.ndarray | None:
    """The number at `where` in every entry as float64 [D], or None when any entry lacks a finite one."""
    def get(e):
        for key in where:
            e = e[key]
        if not _is_number(e):
            raise TypeError
        return e

    try:
        return np.fromiter((get(e) for e in per), dtype=np.float64, count=num_classes)
    except (KeyError, TypeError, ValueError):
        return None


def _read_calibration(path: Path, manifest: dict) -> tuple[dict | None, dict | None, list[str]]:
    """(calibration, arrays, problems); strict JSON, so every number in it is finite."""
    name = "calibration.json"
    try:
        cal = _json_load((path / name).read_bytes())
    except FileNotFoundError:
        return None, None, [f"{name}: missing"]
    except Exception as e:  # noqa: BLE001
        return None, None, [f"{name}: not valid JSON ({e})"]
    problems = []
    if not isinstance(cal, dict):
        return None, None, [f"{name}: not a JSON object"]
    target = cal.get("target")
    if not (isinstance(target, dict) and len(target) == 1 and next(iter(target)) in ("precision", "recall", "quantile")
            and _is_number(next(iter(target.values())))):
        problems.append(f"{name}: 'target' must be {{'precision'|'recall': number}}")
    g = cal.get("global")
    if not (isinstance(g, dict) and _is_number(g.get("threshold"))):
        problems.append(f"{name}: 'global' needs a finite threshold")
    try:
        arrays = calibration_arrays(cal, int(manifest["num_classes"]))
    except ValueError as e:
        problems.append(f"{name}: {e}")
        arrays = None
    if problems:
        return None, arrays, problems
    cal["per_class"] = PerClassCalibration(arrays)  # the D dicts are freed here
    return cal, arrays, problems


def graph_problems(p: Path, kind: str) -> tuple[list[str], Any]:
    """onnx.checker (full) by path, I/O names of DESIGN.md §6, and a plain Gather in single.onnx.

    Shared by `slc export` (before a bundle is written) and verify; returns (problems, the
    graph without its external data, or None when the checker failed)."""
    import onnx

    name = p.name
    try:
        onnx.checker.check_model(str(p), full_check=True)
        model = onnx.load(str(p), load_external_data=False)
    except Exception as e:  # noqa: BLE001
        return [f"{name}: onnx checker failed ({str(e).splitlines()[0][:300]})"], None
    problems = []
    inits = {i.name for i in model.graph.initializer}
    ins = [i.name for i in model.graph.input if i.name not in inits]
    outs = [o.name for o in model.graph.output]
    want_in, want_out = GRAPH_IO[kind]
    if ins != want_in or outs != want_out:
        problems.append(f"{name}: inputs {ins} -> outputs {outs}, expected {want_in} -> {want_out}")
    if kind == "single":
        ops = {n.op_type for n in model.graph.node}
        if "Gather" not in ops or "GatherND" in ops:
            problems.append(f"{name}: must gather class rows with a plain Gather (ops: {sorted(ops)})")
    return problems, model


def _check_graphs(path: Path, manifest: dict) -> list[str]:
    """Every graph's own checks, plus: external data only in files the manifest lists."""
    problems = []
    for kind in GRAPH_KINDS:
        p = path / f"{kind}.onnx"
        if not p.is_file():
            continue  # reported by the file check
        found, model = graph_problems(p, kind)
        problems += found
        for loc in _external_locations(model) if model is not None else ():
            if "/" in loc or "\\" in loc or loc not in manifest.get("files", {}):
                problems.append(f"{p.name}: external data {loc!r} is not a file listed in {MANIFEST}")
    return problems


def _external_locations(model) -> set[str]:
    from onnx import TensorProto

    locs = set()
    for t in model.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            for e in t.external_data:
                if e.key == "location":
                    locs.add(e.value)
    return locs


def _session(p: Path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 1
    # run once on a few samples: no pre-packed copy of the head (1 GB at D=1e6, d=256), the
    # Gemm reads the memory-mapped external data as it is (peak RSS of verify halves)
    opts.add_session_config_entry("session.disable_prepacking", "1")
    return ort.InferenceSession(str(p), sess_options=opts, providers=["CPUExecutionProvider"])


def _close(got: np.ndarray, want: np.ndarray) -> bool:
    if got.shape != want.shape or not np.all(np.isfinite(got)):
        return False
    scale = max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
    return bool(np.allclose(got, want, rtol=SAMPLE_RTOL, atol=SAMPLE_ATOL * scale))


def _check_samples(path: Path, manifest: dict, weight: np.ndarray | None, bias: np.ndarray | None) -> list[str]:
    """samples.npz through each graph vs the stored outputs; single logits vs the npy head rows."""
    name = "samples.npz"
    problems = []
    try:
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
            sess = _session(path / gname)
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


def _inspect(path: Path, deep: bool) -> tuple[list[str], dict]:
    """Problems and the parsed parts. Always: manifest, head shapes, calibration. Deep: + hashes,
    onnx checker, samples through the graphs."""
    manifest, manifest_bytes, problems = _read_manifest(path)
    parts: dict[str, Any] = {"manifest": manifest, "manifest_bytes": manifest_bytes}
    if manifest is None:
        return problems, parts
    if deep:
        problems += _check_files(path, manifest)
    try:
        weight, bias, head_problems = _open_head(path, manifest)
        problems += head_problems
        calibration, arrays, cal_problems = _read_calibration(path, manifest)
        problems += cal_problems
        parts.update(weight=weight, bias=bias, calibration=calibration, arrays=arrays)
        if deep:
            problems += _check_graphs(path, manifest)
            problems += _check_samples(path, manifest, weight, bias)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        problems.append(f"{MANIFEST}: {e}")
    # one line per problem, deduplicated, in order
    return list(dict.fromkeys(problems)), parts
