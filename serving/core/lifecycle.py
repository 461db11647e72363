"""The server's life, protocol-free: load -> sessions -> index -> gallery -> warm-up -> ready ->
drain. `Lifecycle.start()` loads in the background (fronts answer not-ready until then);
`Lifecycle.stop()` stops the fronts, then drains the batch queue and closes what was opened.

Fronts (HTTP, gRPC) are attached by serving/main.py as `Front`s: this module knows none of them.
A bundle that fails to load (e.g. a hash mismatch) means never ready; `on_fatal(exc)` is called
(under `slc serve` the process exits non-zero).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Optional, Protocol

import numpy as np

from serving.core.metrics import Metrics
from serving.errors import NotReady, SlcError
from serving.settings import Settings

log = logging.getLogger(__name__)


class Front(Protocol):
    """A protocol front the lifecycle starts before the model loads and stops first when draining."""

    async def start(self) -> None: ...

    async def stop(self, grace_s: float) -> None: ...


class ServerState:
    """What the fronts see: settings, metrics and, once loaded, the bundle and engine."""

    def __init__(self, settings: Settings, metrics: Metrics, on_fatal: Optional[Callable[[BaseException], None]]):
        self.settings = settings
        self.metrics = metrics
        self.on_fatal = on_fatal
        self.bundle = None
        self.engine = None
        self.runtime = None
        self.index = None
        self.gallery = None
        self.enrolled = None  # serving/core/enrolled.py: the enrolled classes and their store
        self.ready = False
        self.draining = False
        self.load_error: Optional[str] = None
        self.loader: Optional[asyncio.Task] = None

    @property
    def is_ready(self) -> bool:
        return self.ready and not self.draining

    def not_ready_reason(self) -> str:
        if self.draining:
            return "the server is shutting down"
        if self.load_error:
            return f"the model could not be loaded: {self.load_error}"
        return "the model is still loading"

    async def device_ready(self) -> bool:
        """False while the device has failed a pass over the head and a probe input still fails (a probe
        is run here, off the event loop, only after a failure): readiness then answers 503."""
        engine = self.engine
        if engine is None or engine.head_pass.device_healthy:
            return True
        return await asyncio.to_thread(engine.head_pass.probe)

    async def check_ready(self) -> None:
        """NotReady (503) unless the server is ready and its device healthy."""
        if not self.is_ready:
            raise NotReady(self.not_ready_reason())
        if not await self.device_ready():
            raise NotReady("the device failed a pass over the head and still fails a probe", code="device_error")

    def ready_engine(self):
        """The engine, or NotReady (503) while loading / after a failed load. A draining server
        still answers: requests already on their way finish."""
        if self.engine is None or not self.ready:
            raise NotReady(self.not_ready_reason())
        return self.engine

    def set_ready(self, value: bool) -> None:
        self.ready = value
        self.metrics.ready.set(1 if self.is_ready else 0)

    def start_draining(self) -> None:
        """Readiness -> 503 now; in-flight and queued requests still finish."""
        self.draining = True
        self.metrics.ready.set(0)

    def model_info(self) -> dict:
        b, engine = self.bundle, self.engine
        m, served = b.manifest, engine.calibration  # the calibration in use (swapped whole by a reload)
        summary = {k: m[k] for k in ("format", "format_version", "name", "version", "created", "input", "embed_dim",
                                     "num_classes", "loss", "backbone", "test_metrics", "calibration_metrics", "dataset",
                                     "content_sha256", "recalibration") if k in m}
        summary["classes_preview"] = list(b.classes[:10])
        cal = served.calibration
        thr = served.threshold[np.isfinite(served.threshold)]
        calibration = {k: cal[k] for k in cal if k != "per_class"}
        calibration["sha256"] = served.sha256
        calibration["per_class"] = {"count": len(cal.get("per_class", []))}
        if len(thr):
            calibration["per_class"].update(threshold_min=float(thr.min()), threshold_median=float(np.median(thr)),
                                            threshold_max=float(thr.max()))
        s = self.settings
        return {
            "name": b.name,
            "version": m.get("version"),
            "input": m.get("input", {"shape": list(b.input_shape), "dtype": "float32"}),
            "image": b.image,  # how an image body becomes one input; null: JSON only
            "embed_dim": b.embed_dim,
            "num_classes": b.num_classes,
            "digest": served.digest,
            "manifest": summary,
            "calibration": calibration,
            "providers": list(self.runtime.providers),
            "device": s.device,
            "head_device": engine.head_pass.device_info(),
            "softmax_impl": engine.softmax_impl,
            "softmax_timing_ms": {k: round(v * 1e3, 3) for k, v in engine.softmax_timing.items()},
            "softmax_timing_ms_by_batch": {str(n): {k: round(v * 1e3, 3) for k, v in t.items()}
                                           for n, t in engine.head_pass.timing_by_batch.items()},
            "index": self.index.info(),
            "gallery": {"index_kind": self.gallery.index_kind},
            "classes": engine.enrolled_info(),
            "batching": {"max_batch": s.max_batch, "max_delay_ms": s.max_delay_ms, "queue_size_inputs": s.queue_size,
                         "request_timeout_s": s.request_timeout_s, "max_inputs": s.max_inputs,
                         "intra_op_threads": s.intra_op_threads, "inline_max_ms": s.inline_max_ms,
                         "one_thread_backbone_max_batch": self.runtime.small_batch_max,
                         "small_batch_backbone": self.runtime.small_batch_device,
                         "concurrent_batches": engine.batcher.lanes},
        }


async def _open_bundle(state: ServerState):
    """The bundle (the default model built first when none is named), verified."""
    from serving.bundle import load_bundle

    s = state.settings
    path = s.bundle
    if path is None:
        from serving.default_model import ensure_default_bundle

        path = await asyncio.to_thread(ensure_default_bundle, s.home)
    log.info("loading bundle %s (verify=%s)", path, s.verify)
    return await asyncio.to_thread(load_bundle, path, s.verify)


async def _open_stores(state: ServerState) -> None:
    """Sessions, the class index and the gallery of the loaded bundle."""
    from serving.core.class_index import ClassIndex
    from serving.core.device import backend
    from serving.core.sessions import Runtime
    from serving.gallery import open_gallery

    s, bundle = state.settings, state.bundle
    state.runtime = await asyncio.to_thread(Runtime, bundle, s.device, s.intra_op_threads)
    device = backend.kind(state.runtime)
    s.data_dir.mkdir(parents=True, exist_ok=True)
    state.index = await asyncio.to_thread(ClassIndex.open, bundle, s.data_dir / "index-cache", device,
                                          index_kind(s, device))
    state.gallery = await asyncio.to_thread(open_gallery, s.gallery_url, s.data_dir, bundle.digest,
                                            bundle.embed_dim, s.gallery_max_bytes)
    state.enrolled = await asyncio.to_thread(_open_enrolled, s, bundle)


def index_kind(s: Settings, device: str) -> str | None:
    """The class index to open (None: by D): the device's policy (serving/core/device/index.py)."""
    from serving.core.device.index import index_kind as device_index_kind

    return device_index_kind(s.class_index, s.softmax_impl, device)


def _open_enrolled(s: Settings, bundle):
    """The enrolled classes of this bundle's model, replayed from the gallery's store (classes an older
    slc kept under this manifest's digest re-keyed first); what it holds and does not serve: WARNING."""
    from serving.core import enrolled_report
    from serving.core.enrolled import EnrolledClasses
    from serving.gallery.enrolled import open_for_bundle

    store, model, adopted = open_for_bundle(s.gallery_url, s.data_dir, bundle, s.gallery_max_bytes)
    try:
        enrolled = EnrolledClasses(store, bundle, s, model)
    except BaseException:
        store.close()
        raise
    enrolled_report.log_start(enrolled.snapshot.n, enrolled.elsewhere, adopted)
    return enrolled


async def load(state: ServerState) -> None:
    """Bundle -> sessions -> index -> gallery -> warm-up -> ready. Any failure: never ready."""
    from serving.bundle import release_memory
    from serving.codecs import image_decoder
    from serving.core.engine import Engine

    s = state.settings
    try:
        state.bundle = bundle = await _open_bundle(state)
        if bundle.image is not None:  # image bodies: decode processes, starting while the rest loads
            image_decoder.pool_for(s)
        await _open_stores(state)
        engine = Engine(bundle, state.runtime, s, index=state.index, gallery=state.gallery, metrics=state.metrics,
                        enrolled=state.enrolled)
        engine.start()
        state.engine = engine
        await asyncio.to_thread(_reembed_gallery, state.gallery, engine)
        if s.warmup:
            await engine.warm_up()
        # start-up garbage (1M calibration dicts, a trained-then-dropped class index) back to the OS
        await asyncio.to_thread(release_memory)
        if bundle.image is not None:
            await image_decoder.start(s)
        state.enrolled.start_following()  # other processes' enrollments, every enrolled_sync_s
        state.set_ready(True)
        log.info("ready: %s (D=%d, d=%d, input %s) providers=%s softmax=%s index=%s",
                 bundle.name, bundle.num_classes, bundle.embed_dim, list(bundle.input_shape), state.runtime.providers,
                 engine.softmax_impl, state.index.kind)
        _log_curl_hint(s, bundle)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # noqa: BLE001 - reported, and the process exits under `slc serve`
        state.load_error = f"{type(exc).__name__}: {exc}"
        log.error("cannot serve bundle %s: %s", s.bundle or "(default)", state.load_error)
        if state.on_fatal is not None:
            state.on_fatal(exc)


def _log_curl_hint(s: Settings, bundle) -> None:
    """A ready-to-paste curl for the served model: the default model's with its example 7, any other
    bundle's from its classes and input (serving/default_model.py)."""
    from serving.default_model import bundle_curl_hint, curl_hint

    hint = curl_hint(s.home, s.host, s.port) if s.bundle is None else None
    if s.http:
        log.info(hint or bundle_curl_hint(bundle, s.host, s.port))


def _reembed_gallery(gallery, engine) -> None:
    """Items stored under another bundle are re-embedded from their inputs with this backbone."""
    from serving.codecs.strict_json import examples

    stale = gallery.stale_count()
    if not stale:
        return

    def embed(inputs: list):
        try:
            return engine.runtime.embed(examples(inputs, engine.input_shape, engine.settings.max_inputs,
                                                 what="gallery inputs"))
        except SlcError as exc:  # the gallery expects ValueError for inputs this bundle cannot take
            raise ValueError(exc.message) from None

    log.info("gallery: re-embedding %d items stored under another bundle", stale)
    done = gallery.reembed(embed, batch_size=min(256, engine.settings.max_inputs))
    log.info("gallery: %d of %d items re-embedded", done, stale)


class Lifecycle:
    """Start and stop the core and the fronts attached to it (serving/main.py)."""

    def __init__(self, settings: Settings, on_fatal: Optional[Callable[[BaseException], None]] = None):
        self.state = ServerState(settings, Metrics(), on_fatal)
        self.fronts: list[Front] = []

    def attach(self, front: Front) -> None:
        self.fronts.append(front)

    async def start(self) -> None:
        """Fronts first (they answer not-ready while the model loads), then the load in the background."""
        for front in self.fronts:
            await front.start()
        self.state.loader = asyncio.create_task(load(self.state), name="slc-load")

    async def stop(self) -> None:
        """Readiness off, the fronts stopped (in-flight calls get the request timeout), the load
        cancelled if still running, the queue drained, decoders and gallery closed."""
        state = self.state
        state.start_draining()
        for front in self.fronts:
            await front.stop(state.settings.request_timeout_s)
        await _cancel(state.loader)
        if state.engine is not None:
            await state.engine.stop()  # finishes whatever is still queued
        from serving.codecs import image_decoder

        image_decoder.stop(state.settings)  # kills the decode processes
        if state.enrolled is not None:
            await asyncio.to_thread(state.enrolled.close)
        if state.gallery is not None:
            await asyncio.to_thread(state.gallery.close)
        log.info("stopped")


async def _cancel(task: Optional[Awaitable]) -> None:
    if task is not None and not task.done():
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
