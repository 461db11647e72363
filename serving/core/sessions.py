"""onnxruntime sessions of a bundle: the backbone (every query) and, lazily, full.onnx.

The providers come from the device setting; with `auto` CUDA is tried when this onnxruntime
build lists it, and what the session really uses (session.get_providers(), which falls back to
CPU when no GPU is usable) is what gets logged and reported by /v1/model.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np
import onnxruntime as ort

from serving.bundle.session import CPU, ort_session

log = logging.getLogger(__name__)


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


# TF32 off: a float32 MatMul or Conv in TF32 moves an embedding by about 1e-3 relative, enough to
# move a logit across its calibrated threshold (onnxruntime's CUDA provider turns it on by default).
# cuDNN's convolution algorithm by heuristics, not onnxruntime's default exhaustive search: the
# search runs again for every new input shape, so each batch size the batcher forms would pay it on
# its first call, and the start-up's timings (many batch sizes) all of them.
CUDA = [("CUDAExecutionProvider", {"use_tf32": "0", "cudnn_conv_algo_search": "HEURISTIC"}), *CPU]
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


def _providers_for(device: str) -> list:
    available = ort.get_available_providers()
    if device == "cpu":
        return CPU
    if device == "cuda":
        if "CUDAExecutionProvider" not in available:
            raise RuntimeError(f"device=cuda but this onnxruntime has no CUDAExecutionProvider (has {available})")
        preload_cuda()
        return CUDA
    # auto: only try CUDA when this build has it and a GPU is there (else ORT prints a failed probe)
    if "CUDAExecutionProvider" in available and cuda_device_count() > 0:
        preload_cuda()
        return CUDA
    return CPU


SMALL_SESSION_MAX_BYTES = 64 << 20  # a second, one-thread backbone session only below this graph size
SMALL_BATCH_TIE = 0.10  # the pool must be this much faster to take a batch size from the one-thread session


def _best_time(session, output: str, feed: dict, runs: int = 5) -> float:
    session.run([output], feed)  # first run allocates
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        session.run([output], feed)
        times.append(time.perf_counter() - t0)
    return min(times)


class Runtime:
    """ORT sessions sized to the machine: intra-op threads = `threads`, one inter-op thread.

    A pass over the head owns the intra-op pool; a backbone-only batch computing beside it (the
    batcher's second lane) asks for the one-thread session, so that the two share the cores
    without waiting for each other's threads.
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
        self._small: Optional[ort.InferenceSession] = None  # one thread, for small batches (choose_small_batches)
        self.small_batch_max = 0
        self._backbone_in = self.backbone.get_inputs()[0].name
        self._backbone_out = self.backbone.get_outputs()[0].name
        log.info("onnxruntime %s: providers in use %s (device=%s, intra-op threads=%d)",
                 ort.__version__, self.providers, device, threads)

    @property
    def small_batch_device(self) -> str:
        """Where batches of up to small_batch_max inputs run their backbone (GET /v1/model)."""
        return "cpu (one thread)" if self._small is not None and self.small_batch_max else self.providers[0]

    @property
    def uses_cuda(self) -> bool:
        return "CUDAExecutionProvider" in self.providers

    def _session(self, path: Path) -> ort.InferenceSession:
        # No spin-waiting between runs: a spinning worker burns the cores the event loop and the
        # JSON work need.
        wanted = _providers_for(self.device)
        try:
            return ort_session(path, threads=self.threads, providers=wanted, spin=False)
        except Exception as exc:  # CUDA listed but unusable (no driver / no GPU): CPU under `auto`
            if self.device != "auto" or wanted == CPU:
                raise
            log.warning("CUDA session for %s failed (%s); using CPU", Path(path).name, exc)
            return ort_session(path, threads=self.threads, providers=CPU, spin=False)

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

    def embed(self, x: np.ndarray, one_thread: bool = False) -> np.ndarray:
        """x [N, *input_shape] float32 -> h [N, d] float32; `one_thread`: on the one-thread session
        where there is one, whatever the batch size."""
        small = x.shape[0] <= self.small_batch_max or one_thread
        session = self._small if small and self._small is not None else self.backbone
        (h,) = session.run([self._backbone_out], {self._backbone_in: x})
        return h

    def choose_small_batches(self, sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32), timer=None, rounds: int = 5,
                             pinned: Optional[int] = None) -> int:
        """Keep a one-thread backbone session for the batch sizes it runs faster than the pool does
        (waking the other threads costs more than a small batch's work), timed here: the best of
        `rounds` rounds of 5 runs, the two sessions' rounds interleaved so that a busy moment of a
        shared machine hits both (one noisy round used to cut the one-thread range from 32 to 4).
        `pinned` (SLC_ONE_THREAD_MAX_BATCH): that range, untimed, so that replicas behave alike.
        With CUDA the same choice is between the GPU session and a one-thread CPU session: at a few inputs
        the copies and kernel launches of a GPU call cost more than the CPU's work (detect at batch 1).
        Only for a backbone small enough to hold twice; on the CPU only with more than one thread."""
        path = Path(self.bundle.graph_path("backbone"))
        if (self.threads == 1 and not self.uses_cuda) or path.stat().st_size > SMALL_SESSION_MAX_BYTES:
            return 0
        small = ort_session(path, threads=1, providers=CPU, spin=False)
        best = pinned if pinned is not None else self._time_small_batches(small, sizes, timer or _best_time, rounds)
        # kept even where the pool wins for every size: a backbone batch beside a pass over the head
        # (the batcher's second lane) runs on it, so that the two do not fight over the same threads
        self._small, self.small_batch_max = small, best
        return best

    def _time_small_batches(self, small: ort.InferenceSession, sizes: tuple[int, ...], timer, rounds: int) -> int:
        """The largest of `sizes` up to which the one-thread session is no slower than the pool (within
        SMALL_BATCH_TIE), 0 if none. Without the margin, sizes where the two tie decided by noise: the
        range flipped between 0 and 32 from one start to the next."""
        best = 0
        for n in sizes:
            x = {self._backbone_in: np.zeros((n, *self.bundle.input_shape), np.float32)}
            one = pool = math.inf
            for _ in range(rounds):
                one = min(one, timer(small, self._backbone_out, x))
                pool = min(pool, timer(self.backbone, self._backbone_out, x))
            if one > pool * (1 + SMALL_BATCH_TIE):  # a near tie goes to the one thread (no wake-ups)
                break
            best = n
        return best

    def full_logits(self, x: np.ndarray) -> np.ndarray:
        """x [N, *input_shape] float32 -> logits [N, D] float32 through full.onnx."""
        sess = self.full
        (z,) = sess.run([sess.get_outputs()[0].name], {sess.get_inputs()[0].name: x})
        return z


def usable_providers() -> list[str]:
    """The providers a session really gets here (a one-node graph opened with CUDA first where this
    onnxruntime lists it): make setup prints it, since a listed provider may fail to load its libraries."""
    from onnx import TensorProto, helper

    node = helper.make_node("Identity", ["x"], ["y"])
    graph = helper.make_graph([node], "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    wanted = _providers_for("auto")
    try:
        return list(ort_session(model.SerializeToString(), providers=wanted).get_providers())
    except Exception:  # noqa: BLE001 - CUDA listed but unusable: the CPU's
        return list(ort_session(model.SerializeToString(), providers=CPU).get_providers())
