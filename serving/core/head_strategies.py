"""The strategies of a pass over the head, registered by name (`@register`, as timm registers models):
each owns what it reads and keeps (chunk buffers, sessions, copies of the head), says when it is a
candidate (`offered`), and frees its state when not chosen (`release`). HeadPass (compute.py) times
the candidates at warm-up and runs the chosen one; the device's strategy is serving/core/device/head_pass.py.

numpy / ort     one GEMM per class chunk over the memory-mapped rows (numpy's BLAS or onnxruntime's)
ort_pair        two one-thread onnxruntime GEMMs taking class chunks in turn
packed_pair     the same over pre-packed chunk sessions (serving/core/packed_head.py: a second copy)
onnx            full.onnx: the backbone and the head in one session (a second copy of the head)
int8 / bf16     the quantized head (SLC_HEAD_PRECISION), each answer finished on the float32 rows
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from serving.core import head_scan, quantized_head
from serving.core.packed_head import PackedHead

# full.onnx and the packed head hold their own (packed) copy of the head in RAM; past this many
# weights (256 MB of float32) the softmax baseline only reads the memory-mapped rows.
ONNX_HEAD_MAX_VALUES = 64 * 1024 * 1024

STRATEGIES: dict[str, type["Strategy"]] = {}  # name -> class, in registration order (the timing order)
Parts = list  # [(slice of the pass's rows, accumulator)]


def register(cls: type["Strategy"]) -> type["Strategy"]:
    """Class decorator: the strategy under its `name`."""
    STRATEGIES[cls.name] = cls
    return cls


class Strategy:
    """One way of passing over the head. `ctx` is the HeadPass: bundle, runtime, settings, precision,
    the shared GEMMs and thread pool, and `rescore` for a quantized pass's answers."""

    name = ""
    precisions: tuple[str, ...] = ("float32",)  # head precisions it reads
    needs_embedding = True  # False: it embeds the inputs itself (onnx)
    healthy = True  # False after a failed pass on a device (readiness probes it)

    def __init__(self, ctx):
        self.ctx = ctx

    @classmethod
    def offered(cls, ctx, wanted: str) -> bool:
        """A candidate under SLC_SOFTMAX_IMPL=`wanted` (auto or a name) for this bundle and machine."""
        return wanted in ("auto", cls.name)

    @classmethod
    def admit(cls, ctx) -> None:
        """Checks at construction of a HeadPass that offers it (the device: does the head fit)."""

    def run(self, x: np.ndarray, h: Optional[np.ndarray], parts: Parts) -> None:
        raise NotImplementedError

    def probe(self) -> bool:
        """Whether a pass works now (asked by readiness while it is not healthy)."""
        return True

    def chosen(self) -> None:
        """Called once the warm-up chose it."""

    def release(self) -> None:
        """Called when another was chosen: let go of what it holds."""

    def info(self) -> dict:
        """Where it reads the rows (GET /v1/model `head_device`)."""
        return {"resident": "host", "healthy": True}


def fits_twice(ctx) -> bool:
    """Whether a second copy of the head (full.onnx, the packed head) is small enough to hold."""
    return ctx.num_classes * ctx.embed_dim <= ONNX_HEAD_MAX_VALUES


class PairBuffers:
    """The two chunk buffers of a two-thread pass, grown when needed and then kept."""

    def __init__(self):
        self.bufs: Optional[tuple[np.ndarray, np.ndarray]] = None

    def get(self, m: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        need = m * rows
        if self.bufs is None or self.bufs[0].size < need:
            self.bufs = (np.empty(need, dtype=np.float32), np.empty(need, dtype=np.float32))
        return self.bufs


@register
class NumpyScan(Strategy):
    name = "numpy"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.buf: Optional[np.ndarray] = None  # the chunk buffer, kept: no 8 MiB malloc per batch

    def gemm(self) -> head_scan.Gemm:
        return head_scan.numpy_gemm

    def run(self, x, h, parts):
        ctx = self.ctx
        need = len(h) * head_scan.chunk_rows(len(h), ctx.num_classes)
        if self.buf is None or self.buf.size < need:
            self.buf = np.empty(need, dtype=np.float32)
        head_scan.scan(ctx.bundle.weight, ctx.bundle.bias, h, parts, gemm=self.gemm(), buf=self.buf, pool=ctx.pool)


@register
class OrtScan(NumpyScan):
    name = "ort"

    def gemm(self) -> head_scan.Gemm:
        return self.ctx.ort_gemm


@register
class OrtPair(Strategy):
    name = "ort_pair"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.buffers = PairBuffers()

    @classmethod
    def offered(cls, ctx, wanted):
        return ctx.ort_pair is not None and wanted in ("auto", cls.name)

    def run(self, x, h, parts):
        ctx = self.ctx
        rows = head_scan.pair_rows(len(h), ctx.num_classes)
        head_scan.scan_two(ctx.num_classes, h, parts, ctx.ort_pair, self.buffers.get(len(h), rows), ctx.pool, rows)


@register
class OnnxFull(Strategy):
    name = "onnx"
    needs_embedding = False

    @classmethod
    def offered(cls, ctx, wanted):
        return wanted == cls.name or (wanted == "auto" and fits_twice(ctx))

    def run(self, x, h, parts):
        head_scan.feed(self.ctx.runtime.full_logits(x), parts, pool=self.ctx.pool)

    def release(self):
        self.ctx.runtime.drop_full()


@register
class PackedPair(OrtPair):
    name = "packed_pair"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.packed: Optional[PackedHead] = PackedHead(ctx.bundle.weight, ctx.bundle.bias,
                                                       head_scan.pair_rows(ctx.settings.max_batch, ctx.num_classes))

    @classmethod
    def offered(cls, ctx, wanted):
        return ctx.ort_pair is not None and (wanted == cls.name or (wanted == "auto" and fits_twice(ctx)))

    def run(self, x, h, parts):
        ctx = self.ctx
        if len(h) > ctx.settings.max_batch:  # a lone job above max_batch: chunks of max_batch x rows would grow with it
            return super().run(x, h, parts)
        rows = self.packed.rows
        head_scan.scan_two(ctx.num_classes, h, parts, (self.packed, self.packed), self.buffers.get(len(h), rows),
                           ctx.pool, rows)

    def release(self):
        self.packed = None


@register
class Int8Pass(Strategy):
    """The pass on the quantized head (both threads when there are two), then each answer finished on
    the float32 rows: the top-k's candidates and the softmax's own logit re-scored."""

    name = "int8"
    precisions = ("int8",)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.buffers = PairBuffers()
        self.head: Optional[Any] = None  # Int8Head / Bf16Head (serving/core/quantized_head.py), built once

    @classmethod
    def offered(cls, ctx, wanted):
        return not ctx.device_offered(wanted)  # the passes read the quantized head: on the device, or the CPU's

    def build(self):
        ctx, head = self.ctx, self.ctx.bundle.heads[self.name]
        rows = quantized_head.int8_rows(ctx.num_classes, head_scan.pair_rows(ctx.settings.max_batch, ctx.num_classes))
        return quantized_head.Int8Head(head["weight"], head["scale"], ctx.bundle.bias, rows)

    def rows(self, m: int) -> int:
        return self.head.rows

    def run(self, x, h, parts):
        ctx = self.ctx
        if self.head is None:
            self.head = self.build()
        rows = self.rows(len(h))
        head_scan.scan_two(ctx.num_classes, h, parts, (self.head, self.head), self.buffers.get(len(h), rows),
                           ctx.pool, rows)
        ctx.rescore(h, parts)


@register
class Bf16Pass(Int8Pass):
    name = "bf16"
    precisions = ("bf16",)

    def build(self):
        return quantized_head.Bf16Head(self.ctx.bundle.heads[self.name]["weight"], self.ctx.bundle.bias)

    def rows(self, m: int) -> int:
        return head_scan.pair_rows(m, self.ctx.num_classes)
