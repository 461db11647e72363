"""`run_server(overrides)`: `slc serve` (docs/cli.md) — Settings -> create_app -> uvicorn, one worker.

uvicorn runs on uvloop with the guarded httptools protocol (serving/protocol.py: header timeout,
header size limit, JSON protocol errors). SIGTERM / SIGINT: readiness turns 503 at once; after
`drain_delay_s` (0 by default; a second SIGTERM ends it early) uvicorn stops accepting connections
and waits for in-flight requests (up to request_timeout_s + 5 s; a request cut off then gets the
JSON 503 `shutting_down`), the lifespan drains the queue, exit 0.
A bundle that fails to load (e.g. a hash mismatch) stops the server with exit code 1.
"""
from __future__ import annotations

import logging
import signal
import sys
import threading

import uvicorn

from serving.app import create_app
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
    """The guarded httptools protocol (serving/protocol.py); uvicorn's own choice without httptools."""
    try:
        from serving.protocol import guarded_protocol
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
    (about 40 MiB at D = 10^6, docs/results/scale.md). No-op where mallopt is absent."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(ctypes.c_int(-3), ctypes.c_int(MMAP_THRESHOLD))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        log.debug("mallopt unavailable: allocator thresholds left as they are")


def run_server(overrides: dict) -> None:
    settings = Settings(**overrides)
    bound_allocator_slack()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # its CPU-feature probing is not news
    fatal: list[BaseException] = []
    server: DrainingServer | None = None

    def on_fatal(exc: BaseException) -> None:
        fatal.append(exc)
        if server is not None:
            server.should_exit = True

    app = create_app(settings, on_fatal=on_fatal)
    # proxy_headers off: nothing in slc reads the client address, and the layer runs on every request
    config = uvicorn.Config(app, host=settings.host, port=settings.port, workers=1, loop="auto", proxy_headers=False,
                            http=_http_protocol(settings, app.state.slc.metrics),
                            lifespan="on", log_level=settings.log_level.lower(), access_log=False,
                            timeout_graceful_shutdown=int(settings.request_timeout_s + 5))
    server = DrainingServer(config, app.state.slc, settings.drain_delay_s)
    log.info("slc serve on http://%s:%d (bundle %s, data %s)", settings.host, settings.port,
             settings.bundle or "default", settings.data_dir)
    server.run()
    if fatal:
        log.error("exiting: the model could not be served (%s)", app.state.slc.load_error)
        sys.exit(1)
    if not server.started:
        sys.exit(3)
