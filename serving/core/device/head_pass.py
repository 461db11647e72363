"""The `device` strategy of a pass over the head: the head (float32, or the int8 / bf16 one) resident
on the execution device (head.py). With --device cuda a candidate, and the one that reads no row on
the host; on the CPU only when named (SLC_SOFTMAX_IMPL=device), which is how make test checks its graphs."""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from serving.core import head_scan
from serving.core.device import backend
from serving.core.device.head import PRECISIONS, DeviceHead
from serving.core.device.memory import check_fits
from serving.core.head_strategies import Strategy, register
from serving.errors import Kind, SlcError

log = logging.getLogger(__name__)


@register
class DevicePass(Strategy):
    """The head uploaded on first use; a device error in a pass is 503 and marks it unhealthy (the
    server stays up, readiness probes it again)."""

    name = "device"
    precisions = PRECISIONS

    def __init__(self, ctx):
        super().__init__(ctx)
        self.head: Optional[DeviceHead] = None
        self.healthy = True  # False after a device error in a pass (readiness reports it)

    @classmethod
    def offered(cls, ctx, wanted):
        return backend.head_pass_on_device(wanted, ctx.runtime)

    @classmethod
    def admit(cls, ctx) -> None:
        """Before any other work: a head too large for the GPU is one line (DeviceMemoryError)."""
        check_fits(backend.kind(ctx.runtime), ctx.num_classes, ctx.embed_dim, ctx.settings.max_batch,
                   ctx.settings.max_topk + ctx.topk_extra, precision=ctx.precision)

    def resident(self) -> DeviceHead:
        """The head (of the settings' precision) on the runtime's device, uploaded on first use."""
        if self.head is None:
            ctx = self.ctx
            where, max_k = backend.kind(ctx.runtime), ctx.settings.max_topk + ctx.topk_extra
            rows, scale = ctx.bundle.weight, None
            if ctx.precision != "float32":
                rows, scale = ctx.bundle.heads[ctx.precision]["weight"], ctx.bundle.heads[ctx.precision].get("scale")
            self.head = DeviceHead(rows, ctx.bundle.bias, where, max_k=max_k, threads=ctx.runtime.threads,
                                   precision=ctx.precision, scale=scale)
            log.info("head resident on %s: %.1f MB of %s rows (providers %s)", where,
                     self.head.resident_bytes / 1e6, ctx.precision, self.head.providers)
        return self.head

    def run(self, x, h, parts):
        head = self.resident()
        try:
            head.run(h, parts)
            if self.ctx.precision != "float32":
                self.ctx.rescore(h, parts)
        except (RuntimeError, OSError) as exc:  # onnxruntime's Fail / RuntimeException, the device's errors among them
            self.healthy = False
            log.error("device pass failed: %s", exc)
            raise SlcError(f"the {head.device} pass over the head failed ({str(exc).splitlines()[0][:160]}); retry",
                           kind=Kind.UNAVAILABLE, code="device_error", retry_after=1) from None
        self.healthy = True

    def probe(self) -> bool:
        """One lone input through the pass (readiness after a device error): whether it works now."""
        try:
            self.run(None, np.zeros((1, self.ctx.embed_dim), np.float32), [(slice(0, 1), head_scan.SoftmaxStats(1, 0))])
        except SlcError:
            return False
        return True

    def info(self) -> dict:
        if self.head is None:
            return super().info()
        return {"resident": self.head.device, "precision": self.ctx.precision, "bytes": self.head.resident_bytes,
                "blocks": self.head.blocks, "block_width": self.head.width, "healthy": self.healthy}

    def chosen(self) -> None:
        """The warm-up's CPU passes read every float32 row, the upload every quantized one: not needed now."""
        ctx = self.ctx
        drop_host_pages(ctx.bundle.weight)
        if ctx.precision != "float32":
            drop_host_pages(ctx.bundle.heads[ctx.precision]["weight"])

    def release(self) -> None:
        self.head = None


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
