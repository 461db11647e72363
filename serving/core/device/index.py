"""The class index's device policy: which index `auto` opens on a GPU, and where a faiss index lives.

The install pins faiss-cpu (faiss-gpu on PyPI is built for another CUDA), so `place_index` finds no
faiss GPU and keeps the index on the CPU with one line saying why; the GPU branch is kept for a
faiss-gpu installed by hand. On CUDA the class index is rarely wanted anyway: `index_kind` makes
`auto` exact there, answered by the device head's exact top-k."""
from __future__ import annotations

import logging
from typing import Any, Optional

from serving.core.class_cells import HeadLists
from serving.core.device.backend import DEVICES

log = logging.getLogger(__name__)


def index_kind(class_index: str, softmax_impl: str, device: str) -> Optional[str]:
    """The class index to open (None: by D). On CUDA, `auto` with the head pass free to go on the device
    (any head precision) is exact: the device's exact top-k answers mode=index (faster than the CPU index,
    and exact), and nothing is built at start."""
    if class_index != "auto":
        return class_index
    if device == "cuda" and softmax_impl in ("auto", "device"):
        log.info("class index: none on CUDA (mode=index is the device's exact top-k)")
        return "exact"
    return None


def faiss_gpus() -> int:
    """GPUs faiss can use: 0 with the faiss-cpu build the install pins."""
    import faiss

    try:
        return faiss.get_num_gpus()
    except AttributeError:  # a CPU-only faiss build
        return 0


def place_index(index: Any, device: str, meta: Any = None) -> tuple[Any, str]:
    """(index, where): on GPU 0 when asked (cuda/auto) and faiss has one; HNSW has no GPU version and
    cells of class ids read the head in host memory: both stay on CPU. `meta`: the index's nprobe."""
    if device not in DEVICES:
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if device == "cpu" or isinstance(index, HeadLists):
        return index, "cpu"
    import faiss

    if isinstance(index, faiss.IndexHNSW):
        return index, "cpu"
    if faiss_gpus() == 0:
        if device == "cuda":
            log.warning("device cuda asked for but faiss sees no GPU (faiss GPU not installed: the install "
                        "pins faiss-cpu): class index on CPU")
        return index, "cpu"
    return _to_gpu(index, meta)


def _to_gpu(index: Any, meta: Any) -> tuple[Any, str]:
    import faiss

    try:
        res = faiss.StandardGpuResources()
        gpu_index = faiss.index_cpu_to_gpu(res, 0, index)
        gpu_index._slc_resources = res  # keep the resources alive as long as the index
        if meta is not None and meta.kind == "ivf" and meta.nprobe:
            faiss.GpuParameterSpace().set_index_parameter(gpu_index, "nprobe", meta.nprobe)
        return gpu_index, "cuda:0"
    except Exception as exc:  # noqa: BLE001 - any GPU failure falls back to the CPU index
        log.warning("cannot move the class index to GPU (%s): staying on CPU", exc)
        return index, "cpu"
