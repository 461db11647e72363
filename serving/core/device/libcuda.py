"""The one probe of the CUDA driver (libcuda, through ctypes): how many GPUs, and a GPU's free memory.
Asked of the driver directly, so no torch and no CUDA runtime library are needed to ask."""
from __future__ import annotations

import ctypes
from typing import Optional


def _driver():
    """libcuda, initialised; None without a driver (a CPU machine)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return cuda if cuda.cuInit(0) == 0 else None


def cuda_device_count() -> int:
    """GPUs the CUDA driver sees (0 without a driver)."""
    cuda = _driver()
    count = ctypes.c_int(0)
    if cuda is None or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return int(count.value)


def cuda_memory(device_id: int = 0) -> Optional[tuple[int, int]]:
    """(free, total) bytes of GPU `device_id` on its primary context (the one onnxruntime's CUDA provider
    uses), or None without a driver or device."""
    cuda = _driver()
    dev, ctx = ctypes.c_int(0), ctypes.c_void_p()
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    if cuda is None or cuda.cuDeviceGet(ctypes.byref(dev), device_id) != 0:
        return None
    if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:
        return None
    try:
        if cuda.cuCtxPushCurrent_v2(ctx) != 0:
            return None
        ok = cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
        cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        return (int(free.value), int(total.value)) if ok else None
    finally:
        cuda.cuDevicePrimaryCtxRelease_v2(dev)
