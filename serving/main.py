"""`run_server(overrides)`: `slc serve` (docs/cli.md). Settings -> the core's Lifecycle with its
fronts side by side: the gRPC front when grpc_port is set, the HTTP app (create_app) under
uvicorn, one worker, unless http is off (then the gRPC front alone, on the same lifecycle).

uvicorn runs on uvloop with the guarded httptools protocol (serving/http/transport.py: header timeout,
header size limit, JSON protocol errors). SIGTERM / SIGINT: readiness turns 503 at once; after
`drain_delay_s` (0 by default; a second SIGTERM ends it early) uvicorn stops accepting connections
and waits for in-flight requests (up to request_timeout_s + 5 s; a request cut off then gets the
JSON 503 `shutting_down`), the lifespan drains the queue, exit 0.
A bundle that fails to load (e.g. a hash mismatch) stops the server with exit code 1.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading

import uvicorn

from serving.core.lifecycle import Lifecycle
from serving.settings import Settings

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that flips readiness on the first signal and exits 0 after a graceful stop.

    (uvicorn re-raises the captured signal after shutdown, which would end the process with
    -SIGTERM; a drained stop is a clean exit, so the signal is not re-raised.)
    """

    def __init__(self, config: uvicorn.Config, state, drain_delay_s: float = 0.0):
        super().__init__(config)
        self.slc_state = state
        self.drain_delay_s = drain_delay_s
        self._drain_timer: threading.Timer | None = None

    def handle_exit(self, sig, frame) -> None:
        if not self.slc_state.draining:
            log.info("signal %s: draining (readiness 503 now; %s, then in-flight and queued requests finish)",
                     signal.Signals(sig).name if sig else sig,
                     f"still accepting for {self.drain_delay_s:g} s" if self.drain_delay_s else "no drain delay")
            self.slc_state.start_draining()
            if self.drain_delay_s > 0:  # load balancers see readiness 503 before connections are refused
                self._drain_timer = threading.Timer(self.drain_delay_s, self._stop_accepting)
                self._drain_timer.daemon = True
                self._drain_timer.start()
            else:
                self.should_exit = True
        elif sig == signal.SIGINT:
            self.force_exit = True
        else:  # a second SIGTERM ends the drain delay
            self._stop_accepting()

    def _stop_accepting(self) -> None:
        self.should_exit = True


def _http_protocol(settings: Settings, metrics):
    """The guarded httptools protocol (serving/http/transport.py); uvicorn's own choice without httptools."""
    try:
        from serving.http.transport import guarded_protocol
    except ImportError:  # pragma: no cover - httptools comes with uvicorn[standard]
        log.warning("httptools is not installed: no header timeout or header size limit; plain-text protocol errors")
        return "auto"

    def refused(status: int, code: str) -> None:
        metrics.reject(code)
        metrics.requests.labels("(protocol)", "-", str(status)).inc()

    return guarded_protocol(settings.header_timeout_s, settings.max_header_bytes, refused)


MMAP_THRESHOLD = 1 << 20  # bytes: larger blocks come from mmap and go back to the OS when freed


def bound_allocator_slack() -> None:
    """Fix glibc's mmap threshold: by default it rises to the largest block ever freed, so after a
    few large batch buffers those come from the heap and their pages stay with the process
    (about 40 MiB at D = 10^6). No-op where mallopt is absent."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(ctypes.c_int(-3), ctypes.c_int(MMAP_THRESHOLD))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        log.debug("mallopt unavailable: allocator thresholds left as they are")


def build(settings: Settings, on_fatal=None):
    """(the HTTP app or None, the lifecycle): the core with its fronts attached."""
    lifecycle = Lifecycle(settings, on_fatal)
    if settings.grpc_port is not None:  # before the model loads: it answers UNAVAILABLE until ready
        from serving.grpc.server import GrpcFront

        lifecycle.attach(GrpcFront(lifecycle.state, settings.host, settings.grpc_port, settings.max_body_bytes))
    if not settings.http:
        return None, lifecycle
    from serving.http.app import create_app

    return create_app(settings, lifecycle=lifecycle), lifecycle


def run_server(overrides: dict) -> None:
    settings = Settings(**overrides)
    bound_allocator_slack()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # its CPU-feature probing is not news
    fatal: list[BaseException] = []
    stop: list = []  # what ends the serving loop early: uvicorn's should_exit, or the gRPC-only event

    def on_fatal(exc: BaseException) -> None:
        fatal.append(exc)
        for end in stop:
            end()

    app, lifecycle = build(settings, on_fatal)
    if app is None:
        started = asyncio.run(_serve_without_http(lifecycle, settings.drain_delay_s, stop))
    else:
        started = _serve_http(app, settings, lifecycle, stop)
    if fatal:
        log.error("exiting: the model could not be served (%s)", lifecycle.state.load_error)
        sys.exit(1)
    if not started:
        sys.exit(3)


def _serve_http(app, settings: Settings, lifecycle: Lifecycle, stop: list) -> bool:
    """uvicorn with the app (whose lifespan starts and stops the lifecycle); False if it never started."""
    # proxy_headers off: nothing in slc reads the client address, and the layer runs on every request
    config = uvicorn.Config(app, host=settings.host, port=settings.port, workers=1, loop="auto", proxy_headers=False,
                            http=_http_protocol(settings, lifecycle.state.metrics),
                            lifespan="on", log_level=settings.log_level.lower(), access_log=False,
                            timeout_graceful_shutdown=int(settings.request_timeout_s + 5))
    server = DrainingServer(config, lifecycle.state, settings.drain_delay_s)
    stop.append(lambda: setattr(server, "should_exit", True))
    log.info("slc serve on http://%s:%d (bundle %s, data %s)", settings.host, settings.port,
             settings.bundle or "default", settings.data_dir)
    server.run()
    return server.started


async def _serve_without_http(lifecycle: Lifecycle, drain_delay_s: float, stop: list) -> bool:
    """The gRPC front alone: until SIGTERM / SIGINT (readiness off at once, the drain delay, then
    the lifecycle stops) or a failed load."""
    loop = asyncio.get_running_loop()
    ended = asyncio.Event()
    stop.append(lambda: loop.call_soon_threadsafe(ended.set))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, ended.set)
    try:
        await lifecycle.start()
    except Exception as exc:  # noqa: BLE001 - e.g. the gRPC port is taken
        log.error("cannot start: %s", exc)
        return False
    log.info("slc serve: gRPC only (bundle %s, data %s)", lifecycle.state.settings.bundle or "default",
             lifecycle.state.settings.data_dir)
    await ended.wait()
    lifecycle.state.start_draining()
    if drain_delay_s > 0 and lifecycle.state.load_error is None:
        await asyncio.sleep(drain_delay_s)
    await lifecycle.stop()
    return True
