"""onnxruntime sessions of a bundle: the backbone (every query) and, lazily, full.onnx.

The providers come from the device setting through the device backend (serving/core/device/backend.py:
with `auto` CUDA is tried when this onnxruntime build lists it and the driver sees a GPU); what the
session really uses (session.get_providers(), CPU when no GPU is usable) is what gets logged and
reported by /v1/model.
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
from serving.core.device import backend

log = logging.getLogger(__name__)


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
        backend.require(device, self.providers, "the backbone session")
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
        return backend.is_cuda(self.providers)

    def _session(self, path: Path) -> ort.InferenceSession:
        # No spin-waiting between runs: a spinning worker burns the cores the event loop and the
        # JSON work need.
        return backend.session(path, self.device, threads=self.threads, spin=False)

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
        if not backend.small_session_pays(self.threads, self.providers) or path.stat().st_size > SMALL_SESSION_MAX_BYTES:
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
