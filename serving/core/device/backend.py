"""The device backend: which onnxruntime providers a device setting gets, sessions opened on them (CPU
when CUDA is listed but unusable under `auto`), and the policies that depend on the device: lanes of
the batcher, the one-thread backbone session, the head pass on the device. Callers ask here and never
test for CUDA themselves (tests/test_layout.py)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import onnxruntime as ort

from serving.bundle.session import CPU, ort_session
from serving.core.device.libcuda import cuda_device_count

log = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")  # the --device / SLC_DEVICE values
GPU = "CUDAExecutionProvider"
# TF32 off: a float32 MatMul or Conv in TF32 moves an embedding by about 1e-3 relative, enough to
# move a logit across its calibrated threshold (onnxruntime's CUDA provider turns it on by default).
TF32_OFF = {"use_tf32": "0"}
# cuDNN's convolution algorithm by heuristics, not onnxruntime's default exhaustive search: the
# search runs again for every new input shape, so each batch size the batcher forms would pay it on
# its first call, and the start-up's timings (many batch sizes) all of them.
CUDA = [(GPU, {**TF32_OFF, "cudnn_conv_algo_search": "HEURISTIC"}), *CPU]
_preloaded = False


def preload_cuda() -> None:
    """Load the CUDA and cuDNN libraries of the nvidia-* wheels (the ones torch brings) before the first
    CUDA session, so that no LD_LIBRARY_PATH is needed; once, and quietly where there are none."""
    global _preloaded
    if _preloaded or not hasattr(ort, "preload_dlls"):
        return
    _preloaded = True
    try:
        ort.preload_dlls(msvc=False, directory="")
    except Exception as exc:  # noqa: BLE001 - the default library path may still hold them
        log.info("onnxruntime.preload_dlls: %s", exc)


def providers(device: str) -> list:
    """The backbone's providers for a device setting (cpu, cuda or auto)."""
    available = ort.get_available_providers()
    if device == "cpu":
        return CPU
    if device == "cuda":
        if GPU not in available:
            raise RuntimeError(f"device=cuda but this onnxruntime has no {GPU} (has {available})")
        preload_cuda()
        return CUDA
    # auto: only try CUDA when this build has it and a GPU is there (else ORT prints a failed probe)
    if GPU in available and cuda_device_count() > 0:
        preload_cuda()
        return CUDA
    return CPU


def head_providers(device: str, device_id: int = 0) -> list:
    """The providers of the device head's sessions: CUDA with TF32 off on `device_id`, or the CPU."""
    if device == "cuda":
        return [(GPU, {"device_id": str(device_id), **TF32_OFF}), *CPU]
    return list(CPU)


def session(path: Path | str | bytes, device: str, threads: int = 1, spin: bool = False):
    """A session on the device setting's providers; under `auto`, CUDA listed but unusable (no driver,
    no GPU) falls back to the CPU."""
    wanted = providers(device)
    try:
        return ort_session(path, threads=threads, providers=wanted, spin=spin)
    except Exception as exc:  # noqa: BLE001 - CUDA listed but unusable: CPU under `auto`
        if device != "auto" or wanted == CPU:
            raise
        name = "a graph" if isinstance(path, bytes) else Path(path).name
        log.warning("CUDA session for %s failed (%s); using CPU", name, exc)
        return ort_session(path, threads=threads, providers=CPU, spin=spin)


def require(device: str, in_use: Sequence[str], what: str) -> None:
    """RuntimeError when `device` is cuda and the session (`in_use`: its providers) fell back to the CPU."""
    if device == "cuda" and GPU not in in_use:
        raise RuntimeError(f"device=cuda but onnxruntime could not use CUDA ({what} runs on {list(in_use)}); "
                           "check the CUDA/cuDNN libraries or use --device auto")


def is_cuda(in_use: Sequence[str]) -> bool:
    """Whether sessions with these providers in use run on a GPU."""
    return GPU in in_use


def kind(runtime) -> str:
    """The device a runtime's sessions run on: cuda or cpu."""
    return "cuda" if is_cuda(runtime.providers) else "cpu"


def lanes(concurrent_batches: int, runtime) -> int:
    """Batches computed at once: a second lane only where there are threads to share (not on a GPU)."""
    return concurrent_batches if runtime.threads > 1 and not is_cuda(runtime.providers) else 1


def small_session_pays(threads: int, in_use: Sequence[str]) -> bool:
    """Whether a one-thread CPU backbone session may beat the main one at small batches: on a GPU (a
    GPU call's copies and launches cost more than a few inputs' work), on the CPU only with threads."""
    return threads != 1 or is_cuda(in_use)


def head_pass_on_device(wanted: str, runtime) -> bool:
    """Whether the device head pass is a candidate: when named (SLC_SOFTMAX_IMPL=device, the CPU's
    check of its graphs), or under auto on a GPU."""
    return wanted == "device" or (wanted == "auto" and is_cuda(runtime.providers))


def usable_providers() -> list[str]:
    """The providers a session really gets here (a one-node graph opened as `auto` would): make setup
    prints it, since a listed provider may fail to load its libraries."""
    from onnx import TensorProto, helper

    node = helper.make_node("Identity", ["x"], ["y"])
    graph = helper.make_graph([node], "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return list(session(model.SerializeToString(), "auto", spin=True).get_providers())
