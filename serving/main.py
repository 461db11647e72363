"""`run_server(overrides)`: `slc serve` (docs/cli.md) — Settings -> create_app -> uvicorn, one worker.

uvicorn picks uvloop and httptools when they are installed (loop="auto", http="auto").
SIGTERM / SIGINT: readiness turns 503 at once, uvicorn stops accepting connections and waits
for in-flight requests (up to request_timeout_s + 5 s), the lifespan drains the queue, exit 0.
A bundle that fails to load (e.g. a hash mismatch) stops the server with exit code 1.
"""
from __future__ import annotations

import logging
import signal
import sys

import uvicorn

from serving.app import create_app
from serving.settings import Settings

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that flips readiness on the first signal and exits 0 after a graceful stop.

    (uvicorn re-raises the captured signal after shutdown, which would end the process with
    -SIGTERM; a drained stop is a clean exit, so the signal is not re-raised.)
    """

    def __init__(self, config: uvicorn.Config, state):
        super().__init__(config)
        self.slc_state = state

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            log.info("signal %s: draining (readiness 503, in-flight and queued requests finish)",
                     signal.Signals(sig).name if sig else sig)
            self.slc_state.start_draining()
            self.should_exit = True
        elif sig == signal.SIGINT:
            self.force_exit = True


def run_server(overrides: dict) -> None:
    settings = Settings(**overrides)
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
    config = uvicorn.Config(app, host=settings.host, port=settings.port, workers=1, loop="auto", http="auto",
                            lifespan="on", log_level=settings.log_level.lower(), access_log=False,
                            timeout_graceful_shutdown=int(settings.request_timeout_s + 5))
    server = DrainingServer(config, app.state.slc)
    log.info("slc serve on http://%s:%d (bundle %s, data %s)", settings.host, settings.port,
             settings.bundle or "default", settings.data_dir)
    server.run()
    if fatal:
        log.error("exiting: the model could not be served (%s)", app.state.slc.load_error)
        sys.exit(1)
    if not server.started:
        sys.exit(3)
