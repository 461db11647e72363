"""Quantized copies of the class head: fewer bytes per class for the passes that read all D rows
(docs/bundle-format.md, "Quantized heads"). The float32 head stays the reference: detect, the
final top-k and the softmax probability of the asked class are re-scored on it.

- `int8`: per-row symmetric, w ≈ scale_j · q with q in [-127, 127], scale_j = max|w_j| / 127
  (the weight layout of onnxruntime's DynamicQuantizeMatMul with per-column scales); error per
  weight at most scale_j / 2. head_int8.npy [D, d] int8, head_int8_scale.npy [D] float32.
- `bf16`: the top 16 bits of each float32 after rounding to nearest even (bfloat16), stored as
  uint16; relative error per weight at most 2⁻⁹. head_bf16.npy [D, d] uint16.

Written a block of rows at a time (a 10⁷-class head is never in memory twice), hashed into the
manifest like every other file, checked by `slc verify`.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

PRECISIONS = ("int8", "bf16")
FILES = {"int8": {"weight": "head_int8.npy", "scale": "head_int8_scale.npy"}, "bf16": {"weight": "head_bf16.npy"}}
SCHEMES = {"int8": "per-row symmetric: w = scale[j] * q, q int8 in [-127, 127], scale[j] = max|w[j]| / 127",
           "bf16": "bfloat16 bits as uint16 (float32 rounded to nearest even, low 16 bits dropped)"}
BLOCK_ROWS = 1 << 16  # rows quantized at a time
CHECK_ROWS = 4096  # rows `check_heads` compares with the float32 head (spread over all D)


def int8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [n, d] float -> (q int8 [n, d], scale float32 [n]); an all-zero row gets scale 0, q 0."""
    w = np.asarray(w, dtype=np.float32)
    scale = (np.abs(w).max(axis=1) / np.float32(127)).astype(np.float32)  # [n]
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.rint(w / safe[:, None]), -127, 127).astype(np.int8)  # [n, d]
    return q, scale


def bf16_bits(w: np.ndarray) -> np.ndarray:
    """w float32 -> uint16 bfloat16 bits, rounded to nearest even (finite inputs)."""
    u = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + np.uint32(0x7FFF)
    return ((u + rounding) >> 16).astype(np.uint16)


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bits -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def write_heads(bundle: Path, weight: np.ndarray, precisions: tuple[str, ...], progress: bool = False) -> dict:
    """Write the quantized heads of `weight` [D, d] into the bundle directory; the manifest's
    `heads` entry ({precision: {file role: name, "scheme": ...}}) for them."""
    from tqdm.auto import tqdm

    if bad := [p for p in precisions if p not in PRECISIONS]:
        raise ValueError(f"unknown head precision {bad[0]!r}; known: {', '.join(PRECISIONS)}")
    n, d = weight.shape
    out = {}
    files = {p: {role: np.lib.format.open_memmap(Path(bundle) / name, mode="w+", shape=(n, d) if role == "weight" else (n,),
                                                dtype={"int8": np.int8, "bf16": np.uint16, "scale": np.float32}[
                                                    p if role == "weight" else "scale"])
                 for role, name in FILES[p].items()} for p in precisions}
    with tqdm(total=n, desc="quantizing head", unit="class", disable=None if progress else True) as bar:
        for start in range(0, n, BLOCK_ROWS):
            w = np.asarray(weight[start:start + BLOCK_ROWS], dtype=np.float32)  # [b, d]
            if "int8" in files:
                files["int8"]["weight"][start:start + len(w)], files["int8"]["scale"][start:start + len(w)] = int8_rows(w)
            if "bf16" in files:
                files["bf16"]["weight"][start:start + len(w)] = bf16_bits(w)
            bar.update(len(w))
    for p, arrays in files.items():
        for arr in arrays.values():
            arr.flush()
        out[p] = {**FILES[p], "scheme": SCHEMES[p]}
    return out


def open_heads(path: Path, manifest: dict) -> tuple[dict[str, dict[str, np.ndarray]], list[str]]:
    """{precision: {"weight": [D, d], "scale": [D]}} memory-mapped, for the heads the manifest lists."""
    from serving.bundle.npy import check_npy_header

    heads = manifest.get("heads") or {}
    if not isinstance(heads, dict):
        return {}, ["manifest.json: 'heads' must be an object"]
    D, d = int(manifest["num_classes"]), int(manifest["embed_dim"])
    want = {"int8": {"weight": (np.int8, (D, d)), "scale": (np.float32, (D,))}, "bf16": {"weight": (np.uint16, (D, d))}}
    out, problems = {}, []
    for precision, entry in heads.items():
        if precision not in want or not isinstance(entry, dict):
            problems.append(f"manifest.json: unknown head precision {precision!r} (known: {', '.join(PRECISIONS)})")
            continue
        arrays = {}
        for role, (dtype, shape) in want[precision].items():
            name = entry.get(role)
            if name != FILES[precision][role]:
                problems.append(f"manifest.json: heads.{precision}.{role} must be {FILES[precision][role]!r}")
                continue
            try:
                check_npy_header(Path(path) / name)
                arr = np.load(Path(path) / name, mmap_mode="r", allow_pickle=False)
            except Exception as e:  # noqa: BLE001
                problems.append(f"{name}: cannot be read as .npy ({str(e)[:200]})")
                continue
            if arr.dtype != dtype or arr.shape != shape or not arr.flags.c_contiguous:
                problems.append(f"{name}: expected {np.dtype(dtype)} {list(shape)} C order, got {arr.dtype} {list(arr.shape)}")
                continue
            arrays[role] = arr
        if len(arrays) == len(want[precision]):
            out[precision] = arrays
    return out, problems


def check_heads(weight: np.ndarray, heads: dict[str, dict[str, np.ndarray]], rows: int = CHECK_ROWS) -> list[str]:
    """Each quantized head against the float32 head on `rows` rows spread over all D: within its
    scheme's rounding error (a head quantized from other weights, or tampered before hashing)."""
    problems = []
    ids = np.unique(np.linspace(0, len(weight) - 1, min(rows, len(weight))).astype(np.int64))
    w = np.asarray(weight[ids], dtype=np.float64)  # [r, d]
    if "int8" in heads:
        scale = np.asarray(heads["int8"]["scale"][ids], dtype=np.float64)  # [r]
        back = scale[:, None] * np.asarray(heads["int8"]["weight"][ids], dtype=np.float64)
        if not np.isfinite(scale).all() or (scale < 0).any() or \
                (np.abs(back - w) > scale[:, None] * 0.5 * (1 + 1e-3) + 1e-12).any():
            problems.append("head_int8.npy: does not dequantize to head_weight.npy within scale/2 per weight")
    if "bf16" in heads:
        back = bf16_to_float32(np.asarray(heads["bf16"]["weight"][ids])).astype(np.float64)
        if (np.abs(back - w) > np.abs(w) * 2.0 ** -8 + 1e-38).any():
            problems.append("head_bf16.npy: is not head_weight.npy rounded to bfloat16")
    return problems
