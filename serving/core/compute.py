"""The passes over all D classes (softmax, exact top-k, all logits) behind one interface, `HeadPass`,
whose strategy is chosen at warm-up by timing each one the settings and the bundle allow. The
strategies are registered classes, each owning its state (serving/core/head_strategies.py: numpy,
ort, ort_pair, packed_pair, onnx, int8, bf16; serving/core/device/head_pass.py: device).

Every pass feeds per-request accumulators (serving/core/head_scan.py): never a [batch, D] matrix
unless a job answers with one. Runs in the batcher's worker thread, one pass at a time.
"""
from __future__ import annotations

import functools
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import numpy as np

from serving.core import head_scan, quantized_head
from serving.core.device import backend
from serving.core.device.head_pass import DevicePass
from serving.core.head_strategies import ONNX_HEAD_MAX_VALUES, STRATEGIES, Strategy

log = logging.getLogger(__name__)

__all__ = ["HeadPass", "ONNX_HEAD_MAX_VALUES", "pick_strategy"]
CHOICE_TIE = 0.10  # strategies within this share of the cheapest count as tied (PREFERENCE decides)
CHOICE_TIE_S = 2e-6  # ... or within this many seconds per input: a small head, where the rest of a request costs far more
# ties: onnx embeds and scans in one session call (the least work on the event loop's side), then the simplest
PREFERENCE = ("onnx", "numpy", "ort", "packed_pair", "ort_pair", "int8", "bf16", "device")
SMALL_HEAD_VALUES = 1 << 18  # D*d up to this (1 MiB of float32 rows): the preferred strategy, not raced
SMALL_BATCH = 8  # the warm-up choice also times this batch: a few clients' requests batched together
PRUNE = 4.0  # a path whose timed batch costs this many times the best so far is timed no further

Parts = list  # [(slice of the pass's rows, accumulator)]


class HeadPass:
    """`run(x, h, parts)`: ONE pass over the head for the rows of h [M, d] (or of the inputs x, for
    the onnx strategy, which embeds too), each slice of rows into its accumulator. The state the
    strategies share (the bundle, the GEMMs, the statistics thread) lives here; their own in them."""

    def __init__(self, bundle, runtime, settings, precision: Optional[str] = None):
        """`precision`: the head it reads (default SLC_HEAD_PRECISION; under `auto` the warm-up builds one
        HeadPass per precision the bundle carries, serving/core/head_precision.py)."""
        self.bundle, self.runtime, self.settings = bundle, runtime, settings
        self.num_classes, self.embed_dim = int(bundle.num_classes), int(bundle.embed_dim)
        self._weight, self._bias = np.asarray(bundle.weight), np.asarray(bundle.bias)
        self.name = "numpy" if settings.softmax_impl == "auto" else settings.softmax_impl
        self.timing: dict[str, float] = {}  # seconds of a max_batch softmax batch per strategy (warm-up)
        self.timing_by_batch: dict[int, dict[str, float]] = {}  # {batch size: {strategy: seconds}}
        self.precision = precision or settings.head_precision
        if self.precision != "float32" and self.precision not in bundle.heads:
            raise ValueError(f"head_precision={self.precision}: the bundle has no {self.precision} head "
                             f"(add one with: slc bundle quantize {bundle.path} --precision {self.precision})")
        # a quantized pass keeps a few more top-k candidates, re-scored exactly (TopK.rescore)
        self.topk_extra = quantized_head.TOPK_EXTRA if self.precision != "float32" else 0
        self.ort_gemm = shared_gemm(self.embed_dim, runtime.threads)
        self.logsumexp = shared_logsumexp()  # the softmax statistics of a chunk (MLAS)
        # a second thread for the pass's per-request statistics (the GEMM already uses intra_op_threads)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="slc-scan") if runtime.threads > 1 else None
        # the pair strategies: two one-thread GEMMs (this thread and the pool's) taking class chunks in turn
        self.ort_pair = (tuple(head_scan.over_rows(shared_gemm(self.embed_dim, 1, half), bundle.weight, bundle.bias)
                               for half in range(2))
                         if self.pool is not None else None)
        if self.name in ("ort_pair", "packed_pair") and self.ort_pair is None:
            raise ValueError(f"softmax_impl={self.name} needs two or more intra-op threads (SLC_INTRA_OP_THREADS)")
        self._impls: dict[str, Strategy] = {}  # the strategies built so far (the chosen one after warm-up)
        for name in self._candidates():  # before any other work: e.g. a head too large for the GPU is one line
            STRATEGIES[name].admit(self)

    @property
    def needs_embedding(self) -> bool:
        """False for onnx: its session embeds the inputs itself."""
        cls = STRATEGIES.get(self.name)
        return cls.needs_embedding if cls is not None else True

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    # ------------------------------------------------------------------ the pass
    def run(self, x: np.ndarray, h: Optional[np.ndarray], parts: Parts) -> None:
        self._strategy(self.name)(x, h, parts)

    def _impl(self, name: str) -> Strategy:
        """The strategy `name` reading this head's precision (a float32 one's name under a quantized head
        is the quantized pass), built on first use."""
        if self.precision not in STRATEGIES[name].precisions:
            name = self.precision
        if name not in self._impls:
            self._impls[name] = STRATEGIES[name](self)
        return self._impls[name]

    def _strategy(self, name: str) -> Callable[[np.ndarray, Optional[np.ndarray], Parts], None]:
        return self._impl(name).run

    @property
    def small_gemm(self) -> head_scan.Gemm:
        """The GEMM of short scans beside the pass (the enrolled rows): onnxruntime's unless the pass
        itself is numpy's. OpenBLAS threads spin for a while after a call, and on two cores that
        halved the next pass's onnxruntime GEMM."""
        return head_scan.numpy_gemm if self.name == "numpy" else self.ort_gemm

    def device_offered(self, wanted: str) -> bool:
        """Whether the device pass is a candidate under `wanted` (the backend's rule)."""
        return backend.head_pass_on_device(wanted, self.runtime)

    def device_head(self):
        """The head on the runtime's device, uploaded on first use (the device strategy's)."""
        return self._impl(DevicePass.name).resident()

    def device_info(self) -> dict:
        """Where the passes over the head read the rows (GET /v1/model `head_device`)."""
        impl = self._impls.get(self.name)
        return impl.info() if impl is not None else {"resident": "host", "healthy": True}

    @property
    def device_healthy(self) -> bool:
        """False after a device error in a pass, until a pass or a probe works again."""
        return all(impl.healthy for impl in self._impls.values())

    def probe(self) -> bool:
        """One lone input through each unhealthy pass (readiness after a device error): whether they work now."""
        return all(impl.probe() for impl in list(self._impls.values()) if not impl.healthy)

    def rescore(self, h: np.ndarray, parts: Parts) -> None:
        """A quantized pass's answers finished on the float32 rows: the top-k's candidates (k of the
        k + TOPK_EXTRA kept) and the softmax's own logit."""
        for sl, acc in parts:
            if isinstance(acc, head_scan.TopK):
                acc.rescore(h[sl], self._weight, self._bias, keep=acc.k - quantized_head.TOPK_EXTRA)
            elif isinstance(acc, head_scan.SoftmaxStats):
                acc.rescore(h[sl], self._weight, self._bias)

    # ------------------------------------------------------------------ the choice (warm-up)
    def choose(self) -> None:
        """Time softmax batches through each strategy the settings allow and keep the cheapest (or time
        only the one the settings name, or the quantized head's: its time sets the batch's patience).

        Timed at two sizes, a few clients' batch and the largest, and chosen by the summed cost per
        input (pick_strategy): at the largest alone the strategies are close enough for a busy moment
        to pick one that is much slower at the batches most loads make (exact top-k moved by 1.7x
        between two starts of the same code)."""
        n = self.settings.max_batch
        x = np.random.default_rng(0).standard_normal((n,) + tuple(self.bundle.input_shape)).astype(np.float32)
        sizes = sorted({min(SMALL_BATCH, n), n})
        candidates, race = self._candidates(), not self._small_head()
        if not race:  # every strategy costs alike here: the preferred one that runs, timed for the patience
            candidates.sort(key=lambda name: PREFERENCE.index(name) if name in PREFERENCE else len(PREFERENCE))
        if race and "device" in candidates:  # on a GPU the likely winner: timed first, so slower paths stop early
            candidates.remove("device")
            candidates.insert(0, "device")
        times: dict[str, dict[int, float]] = {}
        for name in candidates:
            try:
                times[name] = {size: self._time(name, x[:size], bound=PRUNE * min(
                    (t[size] for t in times.values()), default=math.inf)) for size in sizes}
            except Exception as exc:  # e.g. no full.onnx in a bundle: numpy always works
                if self.precision != "float32":
                    raise
                log.warning("softmax path %s unavailable: %s", name, exc)
                continue
            if not race:
                break
        if not times:
            raise RuntimeError(f"softmax_impl={self.settings.softmax_impl}: that path cannot run on this bundle")
        self.name = pick_strategy(times)
        self.timing = {name: t[n] for name, t in times.items()}  # the full batch: sets the scan's patience
        self.timing_by_batch = {size: {name: t[size] for name, t in times.items()} for size in sizes}
        self._drop_unused()

    def cost(self) -> float:
        """Seconds per input of the chosen strategy, summed over the timed batch sizes (pick_strategy's
        measure; after choose)."""
        return sum(t[self.name] / size for size, t in self.timing_by_batch.items() if self.name in t)

    def release_all(self) -> None:
        """A HeadPass not served (another precision was chosen): every strategy lets go of what it holds."""
        for impl in self._impls.values():
            impl.release()
        self._impls = {}
        self.close()

    def _small_head(self) -> bool:
        """A head too small for the strategies to differ (its GEMM is a sliver of a request's cost): no
        race, whose outcome there was noise from one start to the next."""
        return (self.settings.softmax_impl == "auto" and self.precision == "float32"
                and self.num_classes * self.embed_dim <= SMALL_HEAD_VALUES)

    def _time(self, name: str, x: np.ndarray, bound: float = math.inf) -> float:
        """Best of 3 of one softmax batch over x, one request per input (as under load); a path whose
        first timed batch already costs more than `bound` is not timed again (it cannot be chosen: at
        D = 10^7 on a GPU each CPU batch costs seconds of start-up)."""
        run = self._strategy(name)
        embeds = STRATEGIES[name].needs_embedding if name in STRATEGIES else True

        def once():
            parts = [(slice(i, i + 1), head_scan.SoftmaxStats(1, 0, self.logsumexp)) for i in range(len(x))]
            run(x, self.runtime.embed(x) if embeds else None, parts)

        once()  # the first call pays loading and page faults
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            once()
            best = min(best, time.perf_counter() - t0)
            if best > bound:
                break
        return best

    def _candidates(self) -> list[str]:
        """The strategies the settings and the bundle allow, in registration order: those reading the
        head's precision that offer themselves under SLC_SOFTMAX_IMPL."""
        wanted = self.settings.softmax_impl
        names = [name for name, cls in STRATEGIES.items()
                 if self.precision in cls.precisions and cls.offered(self, wanted)]
        if wanted == "auto" and self.precision == "float32" and len(names) == 2:
            log.info("full-softmax head: numpy over the mmap rows (D*d = %d: full.onnx would hold a second copy)",
                     self.num_classes * self.embed_dim)
        return names

    def _drop_unused(self) -> None:
        """The strategies not chosen let go of what they hold (copies of the head, buffers); the chosen
        one is told (the device's lets go of the host's pages)."""
        chosen = self._impl(self.name)
        for impl in self._impls.values():
            if impl is not chosen:
                impl.release()
        self._impls = {chosen.name: chosen}
        chosen.chosen()


@functools.lru_cache(maxsize=None)
def shared_gemm(embed_dim: int, threads: int, half: int = 0) -> head_scan.OrtGemm:
    """The GEMM session of a width and thread count (`half`: the pair's two), one per process: the head
    rows are its input, so every model's pass shares it (each session held about 0.1 MiB per model)."""
    return head_scan.OrtGemm(embed_dim, threads=threads)


@functools.lru_cache(maxsize=None)
def shared_logsumexp() -> head_scan.OrtLogSumExp:
    """The softmax statistics' session, one per process (it serves several threads at once)."""
    return head_scan.OrtLogSumExp()


def pick_strategy(times: dict[str, dict[int, float]]) -> str:
    """The strategy of least summed cost per input over the timed batch sizes ({name: {size: s}});
    among those within CHOICE_TIE of it, the first in PREFERENCE, so that a near tie (a small head,
    where every strategy costs alike) is not decided by noise from one start to the next."""
    cost = {name: sum(t / size for size, t in by_size.items()) for name, by_size in times.items()}
    best = min(cost.values())
    near = [name for name in cost if cost[name] <= max(best * (1 + CHOICE_TIE), best + CHOICE_TIE_S)]
    return min(near, key=lambda name: PREFERENCE.index(name) if name in PREFERENCE else len(PREFERENCE))
