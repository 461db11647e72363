"""Many class-sets on one server (issue 51): the served models and their repository.

A `Model` is one bundle served under its own name: its head, thresholds, enrolled classes, gallery,
class index and engine. The `ModelRepository` holds them by name (the first one loaded is the
default, which today's routes serve), loads a bundle (verified) without disturbing the others and
unloads one after its requests drain, and groups the models by backbone graph
(serving/core/backbones.py): bundles whose backbone is the same share one session and one batch lane.

How a model's stores are opened is the lifecycle's (`open_model`, given to the repository), so this
module knows no file layout. `ModelView` is what a route sees of one model: ServerState's interface
(settings, metrics, ready_engine, model_info, check_ready) for that model.
"""
from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Awaitable, Callable, Optional

import numpy as np

from serving.errors import Conflict, InvalidInput, NotFound, NotReady

log = logging.getLogger(__name__)

DRAIN_QUIET_S = 0.2  # an unloading model is closed once none of its calls has been on its way for this long
MODEL_INDEX_STATES = ("READY", "LOADING", "UNLOADING", "UNAVAILABLE")


class Model:
    """One served class-set: a bundle and everything opened for it."""

    def __init__(self, name: Optional[str], path: Optional[Path], data_dir: Optional[Path]):
        self.name = name  # None until its bundle is read (then the manifest's name) when not given
        self.path = path  # None: the embedded default model
        self.data_dir = data_dir  # its gallery, enrolled store and index cache (set once it has a name)
        self.bundle = self.engine = self.runtime = self.index = self.gallery = self.enrolled = None
        self.group = None  # serving/core/backbones.BackboneGroup
        self.state = "LOADING"

    @property
    def ready(self) -> bool:
        return self.state == "READY" and self.engine is not None

    def head_bytes(self) -> int:
        b = self.bundle
        return int(np.asarray(b.weight).nbytes + np.asarray(b.bias).nbytes) if b is not None else 0

    def summary(self, default: bool, shared_with: list[str]) -> dict:
        """GET /v1/models: one entry."""
        b, engine = self.bundle, self.engine
        out = {"name": self.name, "default": default, "state": self.state.lower(),
               "bundle": str(self.path) if self.path is not None else "(default model)"}
        if b is None or engine is None:
            return out
        snap = engine.classes.snapshot()
        out.update(
            version=b.manifest.get("version"), input=list(b.input_shape), embed_dim=int(b.embed_dim),
            classes={"trained": int(b.num_classes), "enrolled": snap.n, "total": int(b.num_classes) + snap.n,
                     "preview": [str(c) for c in b.classes[:10]]},
            thresholds_sha256=engine.classes.calibration.sha256,
            memory={"head_bytes": self.head_bytes(), "head": engine.head_pass.device_info(),
                    "index": self.index.kind if self.index is not None else None,
                    "enrolled_bytes": int(snap.weight.nbytes + snap.bias.nbytes)},
            backbone={"sha256": self.group.key if self.group is not None else None, "shared_with": shared_with,
                      "providers": list(self.runtime.providers)},
            v2_models=[self.name, f"{self.name}-full"])
        return out


class Readiness:
    """Readiness over `engine`, `is_ready` and `not_ready_reason()`: the server's (its default model)
    and each model's view alike."""

    async def device_ready(self) -> bool:
        """False while the device has failed a pass over the head and a probe input still fails (a probe
        is run here, off the event loop, only after a failure): readiness then answers 503."""
        engine = self.engine
        if engine is None or engine.head_pass.device_healthy:
            return True
        return await asyncio.to_thread(engine.head_pass.probe)

    async def check_ready(self) -> None:
        """NotReady (503) unless ready and the device healthy."""
        if not self.is_ready:
            raise NotReady(self.not_ready_reason())
        if not await self.device_ready():
            raise NotReady("the device failed a pass over the head and still fails a probe", code="device_error")


class ModelView(Readiness):
    """What the routes of one model see (ServerState's interface, for that model)."""

    def __init__(self, state, model: Model):
        self.server = state
        self.model = model

    settings = property(lambda self: self.server.settings)
    metrics = property(lambda self: self.server.metrics)
    bundle = property(lambda self: self.model.bundle)
    engine = property(lambda self: self.model.engine)

    @property
    def is_ready(self) -> bool:
        return self.server.is_ready and self.model.ready

    def not_ready_reason(self) -> str:
        if not self.server.is_ready:
            return self.server.not_ready_reason()
        return f"the model {self.model.name!r} is {self.model.state.lower()}"

    def ready_engine(self):
        if not self.server.ready or not self.model.ready:
            raise NotReady(self.not_ready_reason())
        return self.model.engine

    def model_info(self) -> dict:
        return self.server.model_info(self.model)


Opener = Callable[[Model], Awaitable[None]]


class ModelRepository:
    """The served models by name, their backbone groups, and the bundles it may load by name."""

    def __init__(self, settings, metrics, open_model: Opener, close_model: Callable[[Model], Awaitable[None]]):
        self.settings = settings
        self.metrics = metrics
        self._open, self._close = open_model, close_model
        self.models: dict[str, Model] = {}  # served (READY) and unloading, by name
        self.default: Optional[Model] = None
        self.groups: dict = {}  # backbone key -> BackboneGroup
        self.sources: dict[str, Path] = {}  # names a load may ask for -> bundle folder (CLI bundles, the repository)
        self.failed: dict[str, str] = {}  # name -> why its last load failed
        self._busy: set[str] = set()  # names being loaded or unloaded now
        self.group_lock = asyncio.Lock()  # one backbone group per graph, also under concurrent loads

    # ---------------------------------------------------------------- lookup
    def get(self, name: str) -> Model:
        """A served model by name; 404 unknown_model (naming the served ones) otherwise."""
        model = self.models.get(name)
        if model is None or model.state != "READY":
            served = ", ".join(repr(n) for n, m in self.models.items() if m.state == "READY") or "none"
            state = "" if model is None else f" (it is {model.state.lower()})"
            raise NotFound(f"unknown model {name!r}{state}; this server serves {served}", code="unknown_model")
        return model

    def for_v2(self, name: str) -> Model:
        """The model a KServe v2 name is of: `<name>` or `<name>-full`."""
        if name in self.models:
            return self.get(name)
        if name.endswith("-full") and name[:-5] in self.models:
            return self.get(name[:-5])
        return self.get(name)

    def served(self) -> list[Model]:
        return [m for m in self.models.values() if m.state == "READY"]

    def shared_with(self, model: Model) -> list[str]:
        group = model.group
        return sorted(m.name for m in self.models.values() if m is not model and m.group is group and group is not None)

    def listing(self) -> dict:
        """GET /v1/models."""
        return {"default": self.default.name if self.default is not None else None,
                "models": [m.summary(m is self.default, self.shared_with(m)) for m in self.models.values()],
                "failed": [{"name": n, "reason": r} for n, r in self.failed.items()]}

    def index(self) -> list[dict]:
        """KServe v2 repository index: every model served or loadable by name, with its state."""
        out = [{"name": m.name, "version": "1", "state": m.state} for m in self.models.values()]
        root = self.settings.model_repository
        folders = {p.name for p in Path(root).iterdir() if p.is_dir()} if root is not None and Path(root).is_dir() else set()
        for name in sorted(set(self.sources) | folders):
            if name not in self.models:
                entry = {"name": name, "version": "1", "state": "UNAVAILABLE"}
                if name in self.failed:
                    entry["reason"] = self.failed[name]
                out.append(entry)
        return out

    # ---------------------------------------------------------------- load and unload
    async def add(self, path: Optional[Path], name: Optional[str] = None, data_dir: Optional[Path] = None) -> Model:
        """Open the bundle at `path` (None: the embedded default model) and serve it under `name` (default:
        its manifest's name). The first model added is the default. Raises on any failure, the others untouched."""
        default = self.default is None
        model = Model(name, path, data_dir or (self.settings.data_dir if default else None))
        if name is not None:
            self._claim(name)
        try:
            await self._open(model)  # reads the bundle, names the model, opens its stores, warms it up
            if name is None:
                if model.name in self.models or model.name in self._busy:
                    await self._close(model)
                    raise Conflict(f"a model named {model.name!r} is already served; name this one (NAME=PATH)",
                                   code="model_exists")
            model.state = "READY"
            self.models[model.name] = model
            if default:
                self.default = model
            self.failed.pop(model.name, None)
            self._gauges(model, loaded=True)
            return model
        finally:
            if name is not None:
                self._busy.discard(name)

    def _claim(self, name: str) -> None:
        if name in self._busy:
            raise Conflict(f"the model {name!r} is being loaded or unloaded now; retry once that is done",
                           code="model_busy")
        if name in self.models:
            raise Conflict(f"the model {name!r} is already loaded (unload it first to load it again)",
                           code="model_exists")
        self._busy.add(name)

    def data_dir_of(self, name: str) -> Path:
        """A model's data folder (gallery, enrolled store, index cache): the default model keeps the
        server's; every other one has a folder of its own in it, by name (one path segment, never the
        server's own folder or another's)."""
        if name in ("", ".", "..") or any(c in name for c in "/\\\0"):
            raise ValueError(f"the model name {name!r} cannot name a folder of its own (give it another: NAME=PATH)")
        return self.settings.data_dir / "models" / name

    async def load(self, name: str) -> Model:
        """Repository extension `load`: the bundle known by `name` (a served bundle's folder, or a folder of
        the model repository), verified, served beside the others (or in place of the one of that name:
        `reload`). A failure is one line; nothing changes."""
        path = self.sources.get(name) or self._in_repository(name)
        if path is None:
            known = ", ".join(repr(n) for n in sorted(self.sources)) or "none"
            raise NotFound(f"no bundle named {name!r} to load (known: {known}; a model repository folder "
                           "holds one bundle per sub-folder)", code="unknown_model")
        served = self.models.get(name)
        try:
            if served is not None and served.state == "READY":
                return await self.reload(served, path)
            model = await self.add(path, name)
        except (Conflict, NotFound):
            raise
        except Exception as exc:  # noqa: BLE001 - a bundle that fails to load: refused in one line
            reason = one_line(exc)
            self.failed[name] = reason
            log.error("model %s: not loaded: %s", name, reason)
            raise InvalidInput(f"the model {name!r} was not loaded: {reason}", code="invalid_bundle") from None
        self.sources.setdefault(name, path)
        return model

    async def reload(self, old: Model, path: Path) -> Model:
        """`load` of a model already served (as KServe v2 and Triton have it): its bundle opened again from
        `path` beside the one serving, with the same data folder (enrolled classes, gallery: the stores
        replicas share), then requests go to the new one and the old one drains and closes. No request
        finds the name missing; a bundle that fails leaves the old one serving. Not the default model,
        which today's routes hold: restart for a new bundle, reload-calibration for new thresholds."""
        name = old.name
        if old is self.default:
            raise Conflict(f"the model {name!r} is the default one (today's routes serve it); restart the server "
                           "to serve a new bundle under it (POST /v1/admin/reload-calibration takes new thresholds)",
                           code="default_model")
        self._claim_unload(name)
        try:
            new = Model(name, path, old.data_dir)
            await self._open(new)
            new.state = "READY"
            self.models[name] = new  # from here every request is the new one's
            old.state = "UNLOADING"
            self.failed.pop(name, None)
            await self._drain(old, self.settings.request_timeout_s)
            await self._close(old)
            self._gauges(new, loaded=True)
            log.info("model %s: reloaded from %s", name, path)
            return new
        finally:
            self._busy.discard(name)

    def _in_repository(self, name: str) -> Optional[Path]:
        root = self.settings.model_repository
        if root is None or "/" in name or name in ("", ".", ".."):
            return None
        path = Path(root) / name
        return path if path.is_dir() else None

    async def unload(self, name: str, timeout_s: Optional[float] = None) -> None:
        """Repository extension `unload`: no new request reaches the model (404), those on their way
        finish (drain, up to the request timeout), then it is closed. The default model stays."""
        model = self.get(name)
        if model is self.default:
            raise Conflict(f"the model {name!r} is the default one (today's routes serve it); it cannot be unloaded",
                           code="default_model")
        self._claim_unload(name)
        try:
            model.state = "UNLOADING"
            await self._drain(model, self.settings.request_timeout_s if timeout_s is None else timeout_s)
            await self._close(model)
            self.models.pop(name, None)
            self._gauges(model, loaded=False)
            log.info("model %s: unloaded", name)
        finally:
            self._busy.discard(name)

    def _claim_unload(self, name: str) -> None:
        if name in self._busy:
            raise Conflict(f"the model {name!r} is being loaded or unloaded now", code="model_busy")
        self._busy.add(name)

    async def _drain(self, model: Model, timeout_s: float) -> None:
        """Until none of the model's calls has been on its way for DRAIN_QUIET_S (or the timeout)."""
        engine, end = model.engine, time.monotonic() + timeout_s
        quiet_since = None
        while time.monotonic() < end:
            if engine is None or engine.active == 0:
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since >= DRAIN_QUIET_S:
                    return
            else:
                quiet_since = None
            await asyncio.sleep(0.02)
        log.warning("model %s: unloading with %d calls still on their way (request timeout)", model.name,
                    engine.active if engine is not None else 0)

    async def close_all(self) -> None:
        for model in list(self.models.values()):
            await self._close(model)
        self.models.clear()

    def _gauges(self, model: Model, loaded: bool) -> None:
        if loaded:
            self.metrics.model_loaded.labels(model.name).set(1)
            self.metrics.model_head_bytes.labels(model.name).set(model.head_bytes())
        else:
            self.metrics.forget_model(model.name)
            for gauge in (self.metrics.model_loaded, self.metrics.model_head_bytes):
                try:
                    gauge.remove(model.name)
                except KeyError:
                    pass


def one_line(exc: BaseException) -> str:
    """An exception as one line (its first line, its type when the message says nothing)."""
    text = str(getattr(exc, "message", None) or exc).strip().splitlines()
    return text[0] if text and text[0] else type(exc).__name__
