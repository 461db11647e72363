""".npy files of the head: written as a stream (hashed on the way, header padded so the data is
page aligned and can be ONNX external data), read memory-mapped with a strict header check."""
from __future__ import annotations

import ast
import hashlib
from pathlib import Path

import numpy as np

NPY_ALIGN = 4096


def npy_header(shape: tuple[int, ...], dtype=np.float32, align: int = NPY_ALIGN) -> bytes:
    """A version 1.0 .npy header padded so the data starts at a multiple of `align`.

    np.load accepts any header length that ends in a newline; the padding is spaces.
    """
    descr = np.lib.format.dtype_to_descr(np.dtype(dtype))
    text = "{'descr': %r, 'fortran_order': False, 'shape': %r, }" % (descr, tuple(int(s) for s in shape))
    prefix = 10  # magic (6) + version (2) + uint16 header length (2)
    total = -(-(prefix + len(text) + 1) // align) * align
    if total - prefix > 0xFFFF:
        raise ValueError("npy header too long for format 1.0")
    body = text + " " * (total - prefix - len(text) - 1) + "\n"
    return b"\x93NUMPY\x01\x00" + (total - prefix).to_bytes(2, "little") + body.encode("latin1")


class NpyStream:
    """Append rows of a C-order float32 array to a .npy file while hashing it."""

    def __init__(self, path: Path, shape: tuple[int, ...]):
        self.path, self.shape = Path(path), tuple(shape)
        self.header = npy_header(self.shape)
        self._f = open(self.path, "wb")
        self._hash = hashlib.sha256(self.header)
        self._f.write(self.header)
        self._rows = 0

    @property
    def offset(self) -> int:
        return len(self.header)

    def write(self, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        if rows.shape[1:] != self.shape[1:]:
            raise ValueError(f"rows {rows.shape} do not fit {self.shape}")
        data = rows.data.cast("B")  # no copy
        self._f.write(data)
        self._hash.update(data)
        self._rows += rows.shape[0]

    def close(self) -> tuple[str, int]:
        self._f.close()
        if self._rows != self.shape[0]:
            raise ValueError(f"{self.path.name}: wrote {self._rows} rows, expected {self.shape[0]}")
        return self._hash.hexdigest(), self.path.stat().st_size


BLOCK_ROWS = 65_536  # rows of the head streamed at a time


def write_head(folder: Path, parts: list, bias: np.ndarray) -> dict[str, int]:
    """head_weight.npy [D, d], the rows of `parts` one after the other (each [n_i, d]: an array, a memory
    map, or anything sliced like one; streamed BLOCK_ROWS rows at a time as float32), and head_bias.npy
    [D] into `folder`; the data offsets of both files (graphs' external data points there)."""
    weight = NpyStream(Path(folder) / "head_weight.npy", (sum(p.shape[0] for p in parts), parts[0].shape[1]))
    for part in parts:
        for start in range(0, part.shape[0], BLOCK_ROWS):
            weight.write(np.asarray(part[start:start + BLOCK_ROWS], dtype=np.float32))
    weight.close()
    stream = NpyStream(Path(folder) / "head_bias.npy", (weight.shape[0],))
    stream.write(np.asarray(bias, dtype=np.float32))
    stream.close()
    return {"weight": weight.offset, "bias": stream.offset}


# ---------------------------------------------------------------- reading


def check_npy_header(p: Path) -> None:
    """Parse the .npy header ourselves first: numpy's fallback parser takes seconds on a damaged one."""
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


def open_head(path: Path, manifest: dict) -> tuple[np.ndarray | None, np.ndarray | None, list[str]]:
    """head_weight.npy [D, d] and head_bias.npy [D], memory-mapped read-only; problems name the file."""
    D, d = int(manifest["num_classes"]), int(manifest["embed_dim"])
    arrays, problems = [], []
    for name, shape in (("head_weight.npy", (D, d)), ("head_bias.npy", (D,))):
        try:
            check_npy_header(path / name)
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
