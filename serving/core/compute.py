"""The passes over all D classes (softmax, exact top-k, all logits) behind one interface, `HeadPass`,
whose strategy is chosen at warm-up by timing each one the settings and the bundle allow:

numpy / ort     one GEMM per class chunk over the memory-mapped rows (numpy's BLAS or onnxruntime's)
ort_pair        two one-thread onnxruntime GEMMs taking class chunks in turn
packed_pair     the same over pre-packed chunk sessions (serving/core/packed_head.py: a second copy)
onnx            full.onnx: the backbone and the head in one session (a second copy of the head)
int8 / bf16     the quantized head (SLC_HEAD_PRECISION), each answer finished on the float32 rows
device          the head (float32, or the int8 / bf16 one) resident on the execution device (device_head.py): with
                --device cuda a candidate, and the one that reads no row on the host; on the CPU only
                when named (SLC_SOFTMAX_IMPL=device), which is how make test checks its graphs

Every pass feeds per-request accumulators (serving/core/head_scan.py): never a [batch, D] matrix
unless a job answers with one. Runs in the batcher's worker thread, one pass at a time.
"""
from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import numpy as np

from serving.core import device_head, head_scan, quantized_head
from serving.core.device_memory import check_fits
from serving.errors import Kind, SlcError
from serving.core.packed_head import PackedHead

log = logging.getLogger(__name__)

# full.onnx and the packed head hold their own (packed) copy of the head in RAM; past this many
# weights (256 MB of float32) the softmax baseline only reads the memory-mapped rows.
ONNX_HEAD_MAX_VALUES = 64 * 1024 * 1024
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
    the onnx strategy, which embeds too), each slice of rows into its accumulator."""

    def __init__(self, bundle, runtime, settings):
        self.bundle, self.runtime, self.settings = bundle, runtime, settings
        self.num_classes, self.embed_dim = int(bundle.num_classes), int(bundle.embed_dim)
        self._weight, self._bias = np.asarray(bundle.weight), np.asarray(bundle.bias)
        self.name = "numpy" if settings.softmax_impl == "auto" else settings.softmax_impl
        self.timing: dict[str, float] = {}  # seconds of a max_batch softmax batch per strategy (warm-up)
        self.timing_by_batch: dict[int, dict[str, float]] = {}  # {batch size: {strategy: seconds}}
        self.precision = settings.head_precision
        if self.precision != "float32" and self.precision not in bundle.heads:
            raise ValueError(f"head_precision={self.precision}: the bundle has no {self.precision} head "
                             f"(add one with: slc bundle quantize {bundle.path} --precision {self.precision})")
        # a quantized pass keeps a few more top-k candidates, re-scored exactly (TopK.rescore)
        self.topk_extra = quantized_head.TOPK_EXTRA if self.precision != "float32" else 0
        self._ort_gemm = head_scan.OrtGemm(self.embed_dim, threads=runtime.threads)
        self.logsumexp = head_scan.OrtLogSumExp()  # the softmax statistics of a chunk (MLAS)
        # a second thread for the pass's per-request statistics (the GEMM already uses intra_op_threads)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="slc-scan") if runtime.threads > 1 else None
        # ort_pair: two one-thread GEMMs (this thread and the pool's) taking class chunks in turn
        self._ort_pair = (tuple(head_scan.over_rows(head_scan.OrtGemm(self.embed_dim, threads=1),
                                                    bundle.weight, bundle.bias) for _ in range(2))
                          if self._pool is not None else None)
        if self.name in ("ort_pair", "packed_pair") and self._ort_pair is None:
            raise ValueError(f"softmax_impl={self.name} needs two or more intra-op threads (SLC_INTRA_OP_THREADS)")
        self._packed: Optional[PackedHead] = None  # packed_pair's chunk sessions (built at warm-up)
        self._quantized: Optional[Any] = None  # Int8Head / Bf16Head (serving/core/quantized_head.py)
        self._device: Optional[device_head.DeviceHead] = None  # the head on the execution device (device)
        self.device_healthy = True  # False after a device error in a pass (readiness reports it)
        if "device" in self._candidates():  # before any other work: a head too large for the GPU is one line
            check_fits(self._device_kind(), self.num_classes, self.embed_dim, settings.max_batch,
                       settings.max_topk + self.topk_extra, precision=self.precision)
        self._scan_buf: Optional[np.ndarray] = None  # chunk buffers, kept: no 8 MiB malloc per batch
        self._pair_bufs: Optional[tuple[np.ndarray, np.ndarray]] = None

    @property
    def needs_embedding(self) -> bool:
        """False for onnx: its session embeds the inputs itself."""
        return self.name != "onnx"

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ the pass
    def run(self, x: np.ndarray, h: Optional[np.ndarray], parts: Parts) -> None:
        self._strategy(self.name)(x, h, parts)

    def _strategy(self, name: str) -> Callable[[np.ndarray, Optional[np.ndarray], Parts], None]:
        if name == "device":
            return lambda x, h, parts: self._device_pass(h, parts)
        if self.precision != "float32":
            return lambda x, h, parts: self._quantized_pass(h, parts)
        if name in ("ort_pair", "packed_pair"):
            return lambda x, h, parts: self._pair_pass(h, parts, name)
        if name == "onnx":
            return lambda x, h, parts: head_scan.feed(self.runtime.full_logits(x), parts, pool=self._pool)
        gemm = self._ort_gemm if name == "ort" else head_scan.numpy_gemm
        return lambda x, h, parts: head_scan.scan(self.bundle.weight, self.bundle.bias, h, parts, gemm=gemm,
                                                  buf=self._chunk_buffer(len(h)), pool=self._pool)

    @property
    def small_gemm(self) -> head_scan.Gemm:
        """The GEMM of short scans beside the pass (the enrolled rows): onnxruntime's unless the pass
        itself is numpy's. OpenBLAS threads spin for a while after a call, and on two cores that
        halved the next pass's onnxruntime GEMM."""
        return head_scan.numpy_gemm if self.name == "numpy" else self._ort_gemm

    def device_head(self) -> device_head.DeviceHead:
        """The head (of the settings' precision) on the runtime's device, uploaded on first use."""
        if self._device is None:
            where, max_k = self._device_kind(), self.settings.max_topk + self.topk_extra
            rows, scale = self.bundle.weight, None
            if self.precision != "float32":
                rows, scale = self.bundle.heads[self.precision]["weight"], self.bundle.heads[self.precision].get("scale")
            self._device = device_head.DeviceHead(rows, self.bundle.bias, where, max_k=max_k, threads=self.runtime.threads,
                                                  precision=self.precision, scale=scale)
            log.info("head resident on %s: %.1f MB of %s rows (providers %s)", where,
                     self._device.resident_bytes / 1e6, self.precision, self._device.providers)
        return self._device

    def device_info(self) -> dict:
        """Where the passes over the head read the rows (GET /v1/model `head_device`)."""
        if self.name != "device" or self._device is None:
            return {"resident": "host", "healthy": True}
        return {"resident": self._device.device, "precision": self.precision, "bytes": self._device.resident_bytes,
                "blocks": self._device.blocks, "block_width": self._device.width, "healthy": self.device_healthy}

    def _device_kind(self) -> str:
        return "cuda" if self.runtime.uses_cuda else "cpu"

    def probe(self) -> bool:
        """One lone input through the device pass (readiness after a device error): whether it works now."""
        try:
            self._device_pass(np.zeros((1, self.embed_dim), np.float32),
                              [(slice(0, 1), head_scan.SoftmaxStats(1, 0))])
        except SlcError:
            return False
        return True

    def _device_pass(self, h: np.ndarray, parts: Parts) -> None:
        """The pass on the device head; a device error is 503 (the server stays up, readiness says so)."""
        head = self.device_head()
        try:
            head.run(h, parts)
            if self.precision != "float32":
                self._rescore(h, parts)
        except (RuntimeError, OSError) as exc:  # onnxruntime's Fail / RuntimeException, CUDA errors among them
            self.device_healthy = False
            log.error("device pass failed: %s", exc)
            raise SlcError(f"the {head.device} pass over the head failed ({str(exc).splitlines()[0][:160]}); retry",
                           kind=Kind.UNAVAILABLE, code="device_error", retry_after=1) from None
        self.device_healthy = True

    def _chunk_buffer(self, m: int) -> np.ndarray:
        """The flat scratch array of a pass over m inputs, grown when needed and then kept."""
        need = m * head_scan.chunk_rows(m, self.num_classes)
        if self._scan_buf is None or self._scan_buf.size < need:
            self._scan_buf = np.empty(need, dtype=np.float32)
        return self._scan_buf

    def _pair_buffers(self, m: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """The two chunk buffers of a two-thread pass for m inputs (one chunk each), grown when needed."""
        need = m * rows
        if self._pair_bufs is None or self._pair_bufs[0].size < need:
            self._pair_bufs = (np.empty(need, dtype=np.float32), np.empty(need, dtype=np.float32))
        return self._pair_bufs

    def _pair_pass(self, h: np.ndarray, parts: Parts, impl: str) -> None:
        """The pass on two threads taking chunks in turn: one-thread GEMMs over the mapped rows
        (ort_pair) or the packed head's chunk sessions (packed_pair)."""
        if impl == "packed_pair" and len(h) > self.settings.max_batch:
            impl = "ort_pair"  # a lone job above max_batch: chunks of max_batch x rows would grow with it
        gemms = (self._packed, self._packed) if impl == "packed_pair" else self._ort_pair
        rows = self._packed.rows if impl == "packed_pair" else head_scan.pair_rows(len(h), self.num_classes)
        head_scan.scan_two(self.num_classes, h, parts, gemms, self._pair_buffers(len(h), rows), self._pool, rows)

    def _quantized_head(self):
        """The int8 or bf16 ChunkGemm of the head (built once)."""
        if self._quantized is None:
            head = self.bundle.heads[self.precision]
            if self.precision == "int8":
                rows = quantized_head.int8_rows(self.num_classes,
                                                head_scan.pair_rows(self.settings.max_batch, self.num_classes))
                self._quantized = quantized_head.Int8Head(head["weight"], head["scale"], self.bundle.bias, rows)
            else:
                self._quantized = quantized_head.Bf16Head(head["weight"], self.bundle.bias)
        return self._quantized

    def _quantized_pass(self, h: np.ndarray, parts: Parts) -> None:
        """The pass on the quantized head (both threads when there are two), then each answer
        finished on the float32 rows: the top-k's candidates and the softmax's own logit re-scored."""
        gemm = self._quantized_head()
        rows = gemm.rows if self.precision == "int8" else head_scan.pair_rows(len(h), self.num_classes)
        head_scan.scan_two(self.num_classes, h, parts, (gemm, gemm), self._pair_buffers(len(h), rows), self._pool, rows)
        self._rescore(h, parts)

    def _rescore(self, h: np.ndarray, parts: Parts) -> None:
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

    def _small_head(self) -> bool:
        """A head too small for the strategies to differ (its GEMM is a sliver of a request's cost): no
        race, whose outcome there was noise from one start to the next."""
        return (self.settings.softmax_impl == "auto" and self.precision == "float32"
                and self.num_classes * self.embed_dim <= SMALL_HEAD_VALUES)

    def _time(self, name: str, x: np.ndarray, bound: float = math.inf) -> float:
        """Best of 3 of one softmax batch over x, one request per input (as under load); a path whose
        first timed batch already costs more than `bound` is not timed again (it cannot be chosen: at
        D = 10^7 on a GPU each CPU batch costs seconds of start-up)."""
        if name == "packed_pair" and self._packed is None:
            self._packed = PackedHead(self.bundle.weight, self.bundle.bias,
                                      head_scan.pair_rows(self.settings.max_batch, self.num_classes))
        run = self._strategy(name)

        def once():
            parts = [(slice(i, i + 1), head_scan.SoftmaxStats(1, 0, self.logsumexp)) for i in range(len(x))]
            run(x, self.runtime.embed(x) if name != "onnx" else None, parts)

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
        """The strategies the settings and the bundle allow."""
        wanted = self.settings.softmax_impl
        if self.precision != "float32":  # the passes read the quantized head: on the device, or the CPU's
            on_device = wanted == "device" or (wanted == "auto" and self.runtime.uses_cuda)
            return ["device"] if on_device else [self.precision]
        fits_twice = self.num_classes * self.embed_dim <= ONNX_HEAD_MAX_VALUES
        names = ["numpy", "ort"] + (["ort_pair"] if self._ort_pair is not None else [])
        if wanted == "device" or (wanted == "auto" and self.runtime.uses_cuda):
            names.append("device")
        if wanted == "onnx" or (wanted == "auto" and fits_twice):
            names.append("onnx")
        if self._ort_pair is not None and (wanted == "packed_pair" or (wanted == "auto" and fits_twice)):
            names.append("packed_pair")
        if wanted != "auto":
            return [n for n in names if n == wanted]
        if len(names) == 2:
            log.info("full-softmax head: numpy over the mmap rows (D*d = %d: full.onnx would hold a second copy)",
                     self.num_classes * self.embed_dim)
        return names

    def _drop_unused(self) -> None:
        """The copies of the head the chosen strategy does not read, freed."""
        if self.name != "onnx":
            self.runtime.drop_full()
        if self.name != "packed_pair":
            self._packed = None
        if self.name != "device":
            self._device = None
        else:  # the warm-up's CPU passes read every float32 row, the upload every quantized one: not needed now
            drop_host_pages(self.bundle.weight)
            if self.precision != "float32":
                drop_host_pages(self.bundle.heads[self.precision]["weight"])
        if self.name not in ("ort_pair", "packed_pair") and self.precision == "float32":
            self._pair_bufs = None


def drop_host_pages(rows: np.ndarray) -> None:
    """Let go of the resident pages of memory-mapped rows (madvise DONTNEED; the file stays in the page
    cache): with the head on the device, the host keeps only the pages detect reads, row by row."""
    import mmap

    m = getattr(rows, "_mmap", None) or getattr(getattr(rows, "base", None), "_mmap", None)
    if m is not None and hasattr(m, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        try:
            m.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):
            pass


def pick_strategy(times: dict[str, dict[int, float]]) -> str:
    """The strategy of least summed cost per input over the timed batch sizes ({name: {size: s}});
    among those within CHOICE_TIE of it, the first in PREFERENCE, so that a near tie (a small head,
    where every strategy costs alike) is not decided by noise from one start to the next."""
    cost = {name: sum(t / size for size, t in by_size.items()) for name, by_size in times.items()}
    best = min(cost.values())
    near = [name for name in cost if cost[name] <= max(best * (1 + CHOICE_TIE), best + CHOICE_TIE_S)]
    return min(near, key=lambda name: PREFERENCE.index(name) if name in PREFERENCE else len(PREFERENCE))
