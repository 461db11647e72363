"""onnxruntime sessions of a bundle: the backbone (every query) and, lazily, full.onnx.

The providers come from the device setting; with `auto` CUDA is tried when this onnxruntime
build lists it, and what the session really uses (session.get_providers(), which falls back to
CPU when no GPU is usable) is what gets logged and reported by /v1/model.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Optional

import numpy as np
import onnxruntime as ort

log = logging.getLogger("slc.serving")


def cuda_device_count() -> int:
    """GPUs the CUDA driver sees (0 without a driver), asked of libcuda directly: no torch needed."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return int(count.value)


def _providers_for(device: str) -> list[str]:
    available = ort.get_available_providers()
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if device == "cuda":
        if "CUDAExecutionProvider" not in available:
            raise RuntimeError(f"device=cuda but this onnxruntime has no CUDAExecutionProvider (has {available})")
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    # auto: only try CUDA when this build has it and a GPU is there (else ORT prints a failed probe)
    if "CUDAExecutionProvider" in available and cuda_device_count() > 0:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


class Runtime:
    """ORT sessions sized to the machine: intra-op threads = `threads`, one inter-op thread.

    Calls are made from one worker thread at a time (the batcher's), so the intra-op pool
    owns the cores while a batch runs.
    """

    def __init__(self, bundle, device: str = "auto", threads: int = 1):
        self.bundle = bundle
        self.device = device
        self.threads = threads
        self._lock = threading.Lock()
        self.backbone = self._session(bundle.graph_path("backbone"))
        self.providers: list[str] = list(self.backbone.get_providers())
        if device == "cuda" and "CUDAExecutionProvider" not in self.providers:
            raise RuntimeError(f"device=cuda but onnxruntime could not use CUDA (session runs on {self.providers}); "
                               "check the CUDA/cuDNN libraries or use --device auto")
        self._full: Optional[ort.InferenceSession] = None
        self._backbone_in = self.backbone.get_inputs()[0].name
        self._backbone_out = self.backbone.get_outputs()[0].name
        log.info("onnxruntime %s: providers in use %s (device=%s, intra-op threads=%d)",
                 ort.__version__, self.providers, device, threads)

    @property
    def uses_cuda(self) -> bool:
        return "CUDAExecutionProvider" in self.providers

    def _session(self, path: Path) -> ort.InferenceSession:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.threads
        opts.inter_op_num_threads = 1
        # No spin-waiting between runs: a spinning worker burns the cores the event loop and
        # the JSON work need (300-500 us of CPU per detect request on 2 cores, docs/results/detect-path.md).
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.log_severity_level = 3  # a failed CUDA probe under `auto` is expected, not an error to print
        wanted = _providers_for(self.device)
        try:
            return ort.InferenceSession(str(path), sess_options=opts, providers=wanted)
        except Exception as exc:  # CUDA listed but unusable (no driver / no GPU): CPU under `auto`
            if self.device != "auto" or wanted == ["CPUExecutionProvider"]:
                raise
            log.warning("CUDA session for %s failed (%s); using CPU", Path(path).name, exc)
            return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])

    @property
    def full(self) -> ort.InferenceSession:
        """full.onnx, loaded on first use (it holds a second copy of the head)."""
        with self._lock:
            if self._full is None:
                self._full = self._session(self.bundle.graph_path("full"))
            return self._full

    def drop_full(self) -> None:
        with self._lock:
            self._full = None

    def embed(self, x: np.ndarray) -> np.ndarray:
        """x [N, *input_shape] float32 -> h [N, d] float32."""
        (h,) = self.backbone.run([self._backbone_out], {self._backbone_in: x})
        return h

    def full_logits(self, x: np.ndarray) -> np.ndarray:
        """x [N, *input_shape] float32 -> logits [N, D] float32 through full.onnx."""
        sess = self.full
        (z,) = sess.run([sess.get_outputs()[0].name], {sess.get_inputs()[0].name: x})
        return z
