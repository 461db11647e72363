"""`slc bench routes`: the server's own time per request on each route, without HTTP or a load client.

The app is called in-process over ASGI, one request at a time, so the time of a request is the
event loop's CPU for it whenever its work runs inline (the backbone of one small input does); a
route whose work goes to the worker thread (softmax, a large backbone) adds the hop and that
thread's time. The event loop is what bounds throughput on small machines; free of the noise a
load client adds on the same cores, routes compare directly (v2 JSON against detect, binary
against JSON). Rounds alternate the routes and the best round counts (the least disturbed by the
rest of the machine). Settings come from SLC_* variables as for `slc serve`.
"""
from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from tools.report import md_table

ROUTES = ("live", "detect", "v2", "v2_binary", "softmax")
READY_TIMEOUT_S = 600.0  # loading verifies every hash of the bundle first


def _scope(method: str, path: str, headers: dict) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"host", b"bench")] + [(k.lower().encode(), str(v).encode()) for k, v in headers.items()],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000), "state": {}}


async def call(app, method: str, path: str, body: Optional[bytes], headers: dict) -> tuple[int, bytes]:
    """One request through the ASGI app: (status, response body)."""
    sent: list[dict] = []
    pending = [{"type": "http.request", "body": body or b"", "more_body": False}]

    async def receive():
        if pending:
            return pending.pop()
        await asyncio.Event().wait()  # (no disconnect while the answer is written)

    async def send(message):
        sent.append(message)

    await app(_scope(method, path, headers), receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


async def _started(app) -> Callable:
    """Run the app's lifespan until ready; returns a coroutine function that shuts it down."""
    inbox: asyncio.Queue = asyncio.Queue()
    outbox: asyncio.Queue = asyncio.Queue()
    task = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                                   inbox.get, outbox.put))
    await inbox.put({"type": "lifespan.startup"})
    if (await outbox.get())["type"] != "lifespan.startup.complete":
        raise RuntimeError("the server did not start")
    state = app.state.slc
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not state.is_ready:
        if state.load_error:
            raise RuntimeError(f"the bundle did not load: {state.load_error}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server was not ready after {READY_TIMEOUT_S:g} s")
        await asyncio.sleep(0.05)

    async def stop():
        await inbox.put({"type": "lifespan.shutdown"})
        await outbox.get()
        await task
    return stop


def requests_for(engine, routes: tuple[str, ...]) -> dict[str, tuple[str, str, Optional[bytes], dict]]:
    """(method, path, body, headers) per route, one input, the bodies the load client sends."""
    from tools.loadtest.client import V2Target, encode_http

    x = np.random.default_rng(0).standard_normal((1, *engine.input_shape)).astype(np.float32)
    target = V2Target(engine.bundle.name, 0)
    return {r: encode_http(r, "0", x, v2=target) for r in routes}


async def _measure(app, routes: tuple[str, ...], rounds: int, requests: int, progress) -> dict:
    stop = await _started(app)
    try:
        reqs = requests_for(app.state.slc.engine, routes)
        first = {}
        for r, req in reqs.items():
            status, body = await call(app, *req)
            if status != 200:
                raise RuntimeError(f"{r}: HTTP {status}: {body[:200]!r}")
            first[r] = body
        us: dict[str, list[float]] = {r: [] for r in routes}
        for _ in range(rounds):
            for r, req in reqs.items():
                failed = 0
                t0 = time.perf_counter()
                for _ in range(requests):
                    failed += (await call(app, *req))[0] != 200
                us[r].append((time.perf_counter() - t0) / requests * 1e6)
                if failed:
                    raise RuntimeError(f"{r}: {failed} of {requests} requests were not answered 200")
                progress()
        return {"us": us, "first": first}
    finally:
        await stop()


def measure_routes(bundle: Path, routes: tuple[str, ...] = ROUTES, rounds: int = 5, requests: int = 2000,
                   progress: Callable[[], None] = lambda: None) -> dict:
    """µs per request on each route: {"best_us": {route: µs}, "median_us": ..., "all_us": ...}."""
    from serving.http.app import create_app
    from serving.settings import Settings

    with tempfile.TemporaryDirectory(prefix="slc-routes-") as tmp:
        app = create_app(Settings(bundle=bundle, data_dir=Path(tmp), log_level="error"))
        raw = asyncio.run(_measure(app, routes, rounds, requests, progress))
    best = {r: min(v) for r, v in raw["us"].items()}
    median = {r: float(np.median(v)) for r, v in raw["us"].items()}
    return {"bundle": bundle.name, "rounds": rounds, "requests": requests, "best_us": best, "median_us": median,
            "all_us": raw["us"], "first_answers": {r: b.decode("latin-1") for r, b in raw["first"].items()}}


def routes_markdown(r: dict, command: str) -> str:
    best, med = r["best_us"], r["median_us"]
    lines = ["# Server time per request on each route (in-process ASGI, one request at a time)", "",
             f"Command: `{command}`  ", f"Bundle: `{r['bundle']}`; {r['rounds']} rounds of {r['requests']:,} "
             "requests per route, routes alternating; one input per request (the load client's bodies).", "",
             md_table(["route", "best µs", "median µs", "× detect (best)"],
                      [[route, f"{best[route]:.1f}", f"{med[route]:.1f}",
                        f"{best[route] / best['detect'] if 'detect' in best else float('nan'):.2f}"] for route in best], "lrrr")]
    lines += ["", "What a request costs the server, the inline backbone included (for routes whose work runs "
              "inline, the event loop's CPU; softmax also waits for the worker thread); not HTTP parsing "
              "(uvicorn) and not the load client. Lower is better."]
    return "\n".join(lines) + "\n"
