"""Whether the head fits the GPU, asked before anything is uploaded: a head that does not fit is one
line at load naming the bytes needed and free, never an out-of-memory error under load.

Free memory comes from the CUDA driver (libcuda.py's cuda_memory), so no torch and no CUDA runtime
library are needed to ask.
"""
from __future__ import annotations

from typing import Callable, Optional

from serving.core.device.head import GROUP_VALUES, block_shape, resident_bytes
from serving.core.device.libcuda import cuda_memory

WORK_COPIES = 4  # [rows, D] intermediates of one run alive at once (z, padded z, z - max, exp)
CONTEXT_BYTES = 512 << 20  # the CUDA context, cuBLAS workspace and onnxruntime's arena slack


class DeviceMemoryError(RuntimeError):
    """The head does not fit the device's free memory."""


def needed_bytes(num_classes: int, embed_dim: int, max_batch: int, max_k: int,
                 precision: str = "float32") -> tuple[int, int]:
    """(bytes of the rows, biases and scales, bytes of one pass's work space) of a device head."""
    blocks, width = block_shape(num_classes, max_k)
    values = min(GROUP_VALUES, max(1, max_batch) * blocks * width)
    return resident_bytes(num_classes, embed_dim, precision), 4 * WORK_COPIES * values + CONTEXT_BYTES


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def check_fits(where: str, num_classes: int, embed_dim: int, max_batch: int, max_k: int,
               memory: Callable[[int], Optional[tuple[int, int]]] = cuda_memory, device_id: int = 0,
               precision: str = "float32") -> None:
    """DeviceMemoryError (one line) when a head of num_classes x embed_dim in `precision` would not fit
    the free memory of GPU device_id, naming the precisions that would; nothing on the CPU or when the
    driver cannot be asked."""
    if where != "cuda":
        return
    found = memory(device_id)
    if found is None:
        return
    free, total = found

    def need(p: str) -> tuple[int, int]:
        return needed_bytes(num_classes, embed_dim, max_batch, max_k, p)

    rows, work = need(precision)
    if rows + work <= free:
        return
    fitting = [f"SLC_HEAD_PRECISION={p} ({_gb(sum(need(p)))})" for p in ("bf16", "int8")
               if p != precision and sum(need(p)) <= free and need(p)[0] < rows]
    fix = (f"put a smaller head on the device with {' or '.join(fitting)}" if fitting else
           "no precision of the head fits it either")
    raise DeviceMemoryError(
        f"the {precision} head ({num_classes:,} x {embed_dim}) needs {_gb(rows + work)} on cuda:{device_id} "
        f"({_gb(rows)} of rows + {_gb(work)} of work space) and {_gb(free)} of {_gb(total)} is free; {fix}, "
        "serve on the CPU (--device cpu), or use a GPU with more free memory")
