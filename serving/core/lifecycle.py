"""The server's life, protocol-free: load -> sessions -> index -> gallery -> warm-up -> ready ->
drain, for each model it serves (serving/core/models.py: the default one first, which today's
routes serve; `open_model` / `close_model` are how the repository opens and closes one). `Lifecycle.start()` loads in the background (fronts answer not-ready until then);
`Lifecycle.stop()` stops the fronts, then drains the batch queue and closes what was opened.

Fronts (HTTP, gRPC) are attached by serving/main.py as `Front`s: this module knows none of them.
A bundle that fails to load (e.g. a hash mismatch) means never ready; `on_fatal(exc)` is called
(under `slc serve` the process exits non-zero).
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Awaitable, Callable, Optional, Protocol

import numpy as np

from serving.core.metrics import Metrics
from serving.core.models import Readiness
from serving.errors import NotReady, SlcError
from serving.settings import Settings

log = logging.getLogger(__name__)


class Front(Protocol):
    """A protocol front the lifecycle starts before the model loads and stops first when draining."""

    async def start(self) -> None: ...

    async def stop(self, grace_s: float) -> None: ...


class ServerState(Readiness):
    """What the fronts see: settings, metrics, the served models (serving/core/models.py) and, once
    loaded, the default model's bundle and engine (today's routes serve it)."""

    def __init__(self, settings: Settings, metrics: Metrics, on_fatal: Optional[Callable[[BaseException], None]]):
        from serving.core.models import ModelRepository

        self.settings = settings
        self.metrics = metrics
        self.on_fatal = on_fatal
        self.models = ModelRepository(settings, metrics, lambda m: open_model(self, m), lambda m: close_model(self, m))
        self.ready = False
        self.draining = False
        self.load_error: Optional[str] = None
        self.loader: Optional[asyncio.Task] = None

    def _default(self, what: str):
        model = self.models.default
        return getattr(model, what) if model is not None else None

    bundle = property(lambda self: self._default("bundle"))
    engine = property(lambda self: self._default("engine"))
    runtime = property(lambda self: self._default("runtime"))
    index = property(lambda self: self._default("index"))
    gallery = property(lambda self: self._default("gallery"))
    enrolled = property(lambda self: self._default("enrolled"))  # serving/core/enrolled.py: its enrolled classes

    def view(self, name: str):
        """The routes' view of the served model `name` (404 unknown_model when none is served so)."""
        from serving.core.models import ModelView

        if not self.ready:
            raise NotReady(self.not_ready_reason())
        return ModelView(self, self.models.get(name))

    def engine_for(self, v2_name: str):
        """The engine of the model a KServe v2 name (`<name>` or `<name>-full`) is of; 503 while loading."""
        if self.engine is None or not self.ready:
            raise NotReady(self.not_ready_reason())
        model = self.models.for_v2(v2_name)
        if not model.ready:
            raise NotReady(f"the model {model.name!r} is {model.state.lower()}")
        return model.engine

    @property
    def is_ready(self) -> bool:
        return self.ready and not self.draining

    def not_ready_reason(self) -> str:
        if self.draining:
            return "the server is shutting down"
        if self.load_error:
            return f"the model could not be loaded: {self.load_error}"
        return "the model is still loading"

    def check_loaded(self) -> None:
        """NotReady (503) while the models load at start, or once the server is shutting down."""
        if not self.is_ready:
            raise NotReady(self.not_ready_reason())

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

    def model_info(self, model=None) -> dict:
        """GET /v1/model (the default model's) and /v1/models/{model}/model."""
        model = model or self.models.default
        b, engine = model.bundle, model.engine
        m, served = b.manifest, engine.classes.calibration  # the calibration in use (swapped whole by a reload)
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
            "model": model.name,
            "providers": list(model.runtime.providers),
            "device": s.device,
            "head_device": engine.head_pass.device_info(),
            "head_precision": (engine.precision_choice.info() if engine.precision_choice is not None else
                               {"served": engine.head_pass.precision, "setting": s.head_precision,
                                "reason": "not timed (SLC_WARMUP=false)"}),
            "softmax_impl": engine.softmax_impl,
            "softmax_timing_ms": {k: round(v * 1e3, 3) for k, v in engine.softmax_timing.items()},
            "softmax_timing_ms_by_batch": {str(n): {k: round(v * 1e3, 3) for k, v in t.items()}
                                           for n, t in engine.head_pass.timing_by_batch.items()},
            "index": model.index.info(),
            "gallery": {"index_kind": model.gallery.index_kind},
            "classes": engine.classes.enrolled_info(),
            "batching": {"max_batch": s.max_batch, "max_delay_ms": s.max_delay_ms, "queue_size_inputs": s.queue_size,
                         "request_timeout_s": s.request_timeout_s, "max_inputs": s.max_inputs,
                         "intra_op_threads": s.intra_op_threads, "inline_max_ms": s.inline_max_ms,
                         "one_thread_backbone_max_batch": model.runtime.small_batch_max,
                         "small_batch_backbone": model.runtime.small_batch_device,
                         "concurrent_batches": engine.batcher.lanes},
        }


async def _open_bundle(state: ServerState, path):
    """A bundle, verified (the default model, built first, when `path` is None)."""
    from serving.bundle import load_bundle

    s = state.settings
    if path is None:
        from serving.default_model import ensure_default_bundle

        path = await asyncio.to_thread(ensure_default_bundle, s.home)
    log.info("loading bundle %s (verify=%s)", path, s.verify)
    return await asyncio.to_thread(load_bundle, path, s.verify)


async def _backbone_group(state: ServerState, bundle):
    """The backbone group of this bundle's backbone graph: the one already serving it, or a new one
    (its session opened, its batch lane started)."""
    from serving.bundle.format import backbone_key
    from serving.core.backbones import BackboneGroup
    from serving.core.sessions import Runtime

    s, repo, key = state.settings, state.models, backbone_key(bundle.manifest)
    async with repo.group_lock:
        group = repo.groups.get(key)
        if group is None:
            runtime = await asyncio.to_thread(Runtime, bundle, s.device, s.intra_op_threads)
            group = repo.groups[key] = BackboneGroup(key, runtime, s, state.metrics)
            group.start()
        else:
            log.info("bundle %s: its backbone is already served (sha256 %s…): one session, one batch lane",
                     bundle.name, key[:12])
    return group


async def _open_stores(state: ServerState, model) -> None:
    """Sessions (its backbone group's), the class index, the gallery and the enrolled classes of a model."""
    from serving.core.class_index import ClassIndex
    from serving.core.device import backend
    from serving.gallery import open_gallery

    s, bundle = state.settings, model.bundle
    model.group = await _backbone_group(state, bundle)
    model.runtime = model.group.view(bundle)
    device = backend.kind(model.runtime)
    model.data_dir.mkdir(parents=True, exist_ok=True)
    model.index = await asyncio.to_thread(ClassIndex.open, bundle, model.data_dir / "index-cache", device,
                                          _shared_index_kind(model, index_kind(s, device), device))
    model.gallery = await asyncio.to_thread(open_gallery, s.gallery_url, model.data_dir, bundle.digest,
                                            bundle.embed_dim, s.gallery_max_bytes)
    model.enrolled = await asyncio.to_thread(_open_enrolled, s, bundle, model.data_dir)


def _shared_index_kind(model, kind: str | None, device: str) -> str | None:
    """A model that shares its backbone with one loaded before it opens no `flat` copy of its rows on the CPU,
    where the engine answers mode=index by the exact pass over the mapped rows anyway (ClassIndex.reads_every_row):
    `exact` there, which holds no copy. A server of one bundle chooses as before."""
    from serving.core.class_index import EXACT_MAX_CLASSES

    if kind is None and device == "cpu" and not model.runtime.first and model.bundle.num_classes <= EXACT_MAX_CLASSES:
        return "exact"
    return kind


def index_kind(s: Settings, device: str) -> str | None:
    """The class index to open (None: by D): the device's policy (serving/core/device/index.py)."""
    from serving.core.device.index import index_kind as device_index_kind

    return device_index_kind(s.class_index, s.softmax_impl, device)


def _open_enrolled(s: Settings, bundle, data_dir):
    """The enrolled classes of this bundle's model, replayed from the gallery's store (classes an older
    slc kept under this manifest's digest re-keyed first); what it holds and does not serve: WARNING."""
    from serving.core import enrolled_report
    from serving.core.enrolled import EnrolledClasses
    from serving.gallery.enrolled import open_for_bundle

    store, model, adopted = open_for_bundle(s.gallery_url, data_dir, bundle, s.gallery_max_bytes)
    try:
        enrolled = EnrolledClasses(store, bundle, s, model)
    except BaseException:
        store.close()
        raise
    enrolled_report.log_start(enrolled.snapshot.n, enrolled.elsewhere, adopted)
    return enrolled


async def open_model(state: ServerState, model) -> None:
    """Bundle -> its backbone group -> index -> gallery -> enrolled classes -> engine -> warm-up. On a
    failure, what was opened is closed again and the error raised (the other models are untouched)."""
    from serving.bundle import release_memory
    from serving.codecs import image_decoder
    from serving.core.engine import Engine

    s = state.settings
    try:
        model.bundle = bundle = await _open_bundle(state, model.path)
        model.name = model.name or str(bundle.name)
        model.data_dir = model.data_dir or state.models.data_dir_of(model.name)
        if bundle.image is not None:  # image bodies: decode processes, starting while the rest loads
            image_decoder.pool_for(s)
        await _open_stores(state, model)
        engine = Engine(bundle, model.runtime, s, index=model.index, gallery=model.gallery, metrics=state.metrics,
                        enrolled=model.enrolled, batcher=model.group.batcher, name=model.name)
        model.group.join(engine)
        model.engine = engine
        await asyncio.to_thread(_reembed_gallery, model.gallery, engine)
        if s.warmup:
            await engine.warm_up()
        # start-up garbage (1M calibration dicts, a trained-then-dropped class index) back to the OS
        await asyncio.to_thread(release_memory)
        if bundle.image is not None:
            await image_decoder.start(s)
        model.enrolled.start_following()  # other processes' enrollments, every enrolled_sync_s
    except BaseException:
        await close_model(state, model)
        raise
    log.info("ready: %s as %r (D=%d, d=%d, input %s) providers=%s softmax=%s index=%s", bundle.name, model.name,
             bundle.num_classes, bundle.embed_dim, list(bundle.input_shape), model.runtime.providers,
             engine.softmax_impl, model.index.kind)


async def close_model(state: ServerState, model) -> None:
    """Close what was opened for a model; its backbone group too when it was the group's last."""
    engine, group = model.engine, model.group
    if engine is not None:
        engine.closed = True
    if group is not None:
        group.leave(engine)
        if not group.engines:  # its batch lane drained and stopped, its session dropped
            await group.stop()
            if state.models.groups.get(group.key) is group:
                del state.models.groups[group.key]
    if engine is not None:
        await engine.stop()
    if model.enrolled is not None:
        await asyncio.to_thread(model.enrolled.close)
    if model.gallery is not None:
        await asyncio.to_thread(model.gallery.close)


def initial_models(s: Settings) -> list[tuple[Optional[str], Optional[Path]]]:
    """(name or None for its manifest's, bundle folder or None for the embedded default) of each model
    to serve at start, the default first: SLC_BUNDLE, then SLC_BUNDLES (`PATH` or `NAME=PATH`), then
    every bundle folder of SLC_MODEL_REPOSITORY (named by its folder)."""
    out: list[tuple[Optional[str], Optional[Path]]] = [(None, s.bundle)] if s.bundle is not None else []
    out += [named_path(text) for text in s.bundles]
    if s.model_repository is not None:
        out += [(p.name, p) for p in repository_bundles(s.model_repository)]
    return out or [(None, None)]


def named_path(text: str) -> tuple[Optional[str], Path]:
    """`NAME=PATH` or `PATH`."""
    name, sep, path = str(text).partition("=")
    return (name, Path(path).expanduser()) if sep and name and "/" not in name else (None, Path(text).expanduser())


def repository_bundles(root: Path) -> list[Path]:
    """The bundle folders (holding a manifest.json) of a model repository folder, by name."""
    from serving.bundle.format import MANIFEST

    return sorted(p for p in Path(root).iterdir() if p.is_dir() and (p / MANIFEST).is_file())


async def load(state: ServerState) -> None:
    """The models to serve at start, the default first: a default that fails means never ready; any other
    that fails is refused in one line and the rest are served."""
    s, repo = state.settings, state.models
    sources = initial_models(s)
    for name, path in sources:
        if name is not None and path is not None:
            repo.sources[name] = path
    try:
        name, path = sources[0]
        model = await repo.add(path, name)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # noqa: BLE001 - reported, and the process exits under `slc serve`
        state.load_error = f"{type(exc).__name__}: {exc}"
        log.error("cannot serve bundle %s: %s", s.bundle or "(default)", state.load_error)
        if state.on_fatal is not None:
            state.on_fatal(exc)
        return
    await _add_others(state, sources[1:])
    state.set_ready(True)
    _log_curl_hint(s, model.bundle)


async def _add_others(state: ServerState, sources: list) -> None:
    from serving.core.models import one_line

    repo = state.models
    for name, path in sources:
        try:
            model = await repo.add(path, name)
            repo.sources.setdefault(model.name, path)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - refused in one line; the others are served
            key = name or str(path)
            repo.failed[key] = one_line(exc)
            log.error("model %s (%s): not served: %s", key, path, repo.failed[key])


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
        for group in list(state.models.groups.values()):
            await group.stop()  # finishes whatever is still queued
        for model in list(state.models.models.values()):
            await close_model(state, model)
        from serving.codecs import image_decoder

        image_decoder.stop(state.settings)  # kills the decode processes
        log.info("stopped")


async def _cancel(task: Optional[Awaitable]) -> None:
    if task is not None and not task.done():
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
