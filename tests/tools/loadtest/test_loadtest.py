"""tools.loadtest against servers whose behaviour is known: fixed delays, a global stall,
injected statuses. The truth is the fake server's own log and numpy on the recorded samples."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import Counter

import numpy as np
import pytest

from tools import loadtest as lt
from tests.serving.helpers import slc

pytestmark = pytest.mark.integration  # real processes, sockets or files

aiohttp_web = pytest.importorskip("aiohttp.web")


class FakeServer:
    """A tiny aiohttp server on 127.0.0.1 in its own thread.

    - every `slow_every`-th request to detect sleeps `slow_s` (others answer at once);
    - softmax sleeps `softmax_s`;
    - once `stall_after` requests have arrived, every request is held until a 0.3 s (stall_s)
      window has passed (a global stall, as a GC pause or a blocked event loop would cause);
    - topk answers with status `topk_status(n)` for its n-th request.
    The server logs (path, status) of every answer.
    """

    def __init__(self, slow_every=0, slow_s=0.0, softmax_s=0.0, stall_after=None, stall_s=0.3,
                 topk_status=None, input_shape=(3, 2)):
        self.slow_every, self.slow_s, self.softmax_s = slow_every, slow_s, softmax_s
        self.stall_after, self.stall_s = stall_after, stall_s
        self.topk_status = topk_status or (lambda n: 200)
        self.input_shape = list(input_shape)
        self.log: list[tuple[str, int]] = []
        self.bodies: list[dict] = []
        self.arrivals = 0
        self.detect_n = 0
        self.topk_n = 0
        self.stall_window = None  # (start, end) in perf_counter seconds
        self._ready = threading.Event()

    async def _maybe_stall(self):
        self.arrivals += 1
        if self.stall_after is not None and self.stall_window is None and self.arrivals >= self.stall_after:
            now = time.perf_counter()
            self.stall_window = (now, now + self.stall_s)
        if self.stall_window is not None:
            wait = self.stall_window[1] - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)

    def _answer(self, request, status=200, payload=None):
        self.log.append((request.path, status))
        if status >= 400:
            payload = {"error": {"code": "injected", "message": "injected status"}}
        return aiohttp_web.json_response(payload or {"ok": True}, status=status)

    async def model(self, request):
        return aiohttp_web.json_response({"name": "fake", "input": {"shape": self.input_shape, "dtype": "float32"},
                                          "num_classes": 3, "classes": ["cat", "dog", "eel"]})

    async def live(self, request):
        await self._maybe_stall()
        return self._answer(request)

    async def detect(self, request):
        body = await request.json()
        self.bodies.append(body)
        await self._maybe_stall()
        self.detect_n += 1
        if self.slow_every and self.detect_n % self.slow_every == 0:
            await asyncio.sleep(self.slow_s)
        return self._answer(request)

    async def softmax(self, request):
        await request.read()
        await self._maybe_stall()
        if self.softmax_s:
            await asyncio.sleep(self.softmax_s)
        return self._answer(request)

    async def topk(self, request):
        body = await request.json()
        self.bodies.append(body)
        await self._maybe_stall()
        self.topk_n += 1
        return self._answer(request, self.topk_status(self.topk_n))

    def __enter__(self):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def _serve(self):
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        app = aiohttp_web.Application()
        app.router.add_get("/v1/model", self.model)
        app.router.add_get("/v1/health/live", self.live)
        app.router.add_post("/v1/classes/{cls}/detect", self.detect)
        app.router.add_post("/v1/classes/{cls}/softmax", self.softmax)
        app.router.add_post("/v1/topk", self.topk)
        self.runner = aiohttp_web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(aiohttp_web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self.loop.run_forever()

    def __exit__(self, *exc):
        fut = asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop)
        fut.result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def _ok_latencies(res, endpoint_index=None):
    a = res.samples.arrays()
    sel = a["measured"] & (a["status"] == 200)
    if endpoint_index is not None:
        sel &= a["endpoint"] == endpoint_index
    return (a["done"] - a["scheduled"])[sel]


def test_nearest_rank_percentiles_match_numpy_inverted_cdf():
    rng = np.random.default_rng(3)
    for n in (1, 2, 7, 100, 1001, 12345):
        x = rng.lognormal(size=n)
        got = lt.nearest_rank_percentiles(x, (0.1, 50, 90, 99, 99.9, 100))
        for p, v in got.items():
            assert v == np.percentile(x, p, method="inverted_cdf"), (n, p)


@pytest.mark.parametrize("client", ["raw", "aiohttp"])
def test_closed_loop_statistics_against_known_delays(client):
    """Every 4th detect sleeps 40 ms: at least a quarter of recorded latencies are >= 40 ms, so
    p90/p99/max are >= 40 ms; the report's percentiles equal numpy's on the recorded samples."""
    with FakeServer(slow_every=4, slow_s=0.040) as srv:
        res = lt.run_loadtest(srv.url, ["detect"], concurrency=2, duration=30, warmup=0, max_requests=80,
                              client=client)
    lat = _ok_latencies(res)
    assert lat.size == 80 == res.report["endpoints"]["detect"]["requests"]
    assert srv.detect_n == 80  # nothing issued beyond the cap (warm-up 0)
    assert (lat >= 0.040).sum() >= 80 // 4
    rep = res.report["endpoints"]["detect"]["latency_ms"]
    for p in (50, 90, 99, 99.9):
        assert rep[f"p{p:g}"] == pytest.approx(np.percentile(lat, p, method="inverted_cdf") * 1e3)
    assert rep["max"] == pytest.approx(lat.max() * 1e3)
    assert rep["p90"] >= 40 and rep["p99"] >= 40
    # the body has the shape GET /v1/model advertised
    assert np.asarray(srv.bodies[0]["inputs"]).shape == (1, 3, 2)


def test_open_loop_counts_from_the_schedule_through_a_stall():
    """One connection, 100 req/s, the server stalls 0.3 s: every request scheduled during the stall
    has latency >= stall end - its scheduled time (a closed-loop view would hide them)."""
    with FakeServer(stall_after=20, stall_s=0.3) as srv:
        res = lt.run_loadtest(srv.url, ["live"], rate=100, max_connections=1, duration=1.2, warmup=0)
    start, end = srv.stall_window
    a = res.samples.arrays()
    lat = a["done"] - a["scheduled"]
    during = (a["scheduled"] >= start) & (a["scheduled"] < end)
    assert during.sum() >= 20  # ~30 requests were scheduled inside the stall window
    assert np.all(lat[during] >= end - a["scheduled"][during])
    # and the report's max includes the request that waited for the whole stall
    assert res.report["endpoints"]["live"]["latency_ms"]["max"] >= (end - a["scheduled"][during].min()) * 1e3
    # service time (from the actual send) is what a coordinated-omission client would have reported
    service = a["done"] - a["sent"]
    assert np.all(service <= lat + 1e-9)


def test_open_loop_late_client_keeps_schedule():
    """Requests are counted from their scheduled times even when the client sends them late."""
    with FakeServer(softmax_s=0.05) as srv:
        # 1 connection, 50 ms per request, 100 req/s scheduled: the client necessarily falls behind
        res = lt.run_loadtest(srv.url, ["softmax"], rate=100, max_connections=1, duration=0.5, warmup=0)
    a = res.samples.arrays()
    order = np.argsort(a["scheduled"])
    sched, sent = a["scheduled"][order], a["sent"][order]
    assert np.allclose(np.diff(sched), 0.01, atol=1e-9)  # the schedule is fixed
    lat = a["done"] - a["scheduled"]
    # one connection, >= 50 ms each: the last answer comes >= n*50 ms after the first schedule, and
    # its request was scheduled no later than the last slot, so its latency includes the backlog
    n = sched.size
    last_done = np.argmax(a["done"])
    assert lat[last_done] >= n * 0.05 - (sched[-1] - sched[0])
    assert lat[last_done] > 2 * 0.05  # far beyond one service time: the backlog is counted
    assert np.all(sent >= sched)


def test_error_accounting_by_status_and_interleaving():
    statuses = {0: 200, 1: 429, 2: 500}
    with FakeServer(topk_status=lambda n: statuses[n % 3]) as srv:
        res = lt.run_loadtest(srv.url, ["detect", "softmax", "topk"], concurrency=3, duration=30, warmup=0,
                              max_requests=90, class_="dog")
    rep = res.report["endpoints"]
    server = Counter(srv.log)
    assert rep["detect"]["requests"] == server[("/v1/classes/dog/detect", 200)] == 30
    assert rep["softmax"]["requests"] == server[("/v1/classes/dog/softmax", 200)] == 30
    topk = rep["topk"]
    assert topk["requests"] == 30
    assert topk["ok"] == server[("/v1/topk", 200)]
    assert topk["errors"] == {"429": server[("/v1/topk", 429)], "500": server[("/v1/topk", 500)]}
    assert topk["ok"] + sum(topk["errors"].values()) == 30
    assert rep["detect"]["errors"] == {} and rep["softmax"]["errors"] == {}
    # round robin per request slot: the endpoint of slot i is i % 3
    a = res.samples.arrays()
    assert sorted(Counter(a["endpoint"].tolist()).values()) == [30, 30, 30]
    body = next(b for b in srv.bodies if "k" in b)
    assert body["mode"] == "exact" and body["k"] == 10


def test_transport_errors_are_counted_not_raised():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there
    res = lt.run_loadtest(f"http://127.0.0.1:{port}", ["live"], concurrency=1, duration=30, warmup=0,
                          max_requests=5)
    errs = res.report["endpoints"]["live"]["errors"]
    assert sum(errs.values()) == 5 and all(k.startswith("transport:") for k in errs)


def test_warmup_requests_are_not_recorded():
    with FakeServer() as srv:
        res = lt.run_loadtest(srv.url, ["live"], concurrency=1, duration=0.3, warmup=0.3)
    a = res.samples.arrays()
    assert res.report["requests"] == int(a["measured"].sum())
    assert np.all(a["scheduled"][~a["measured"]] < res.measure_start)
    assert np.all(a["scheduled"][a["measured"]] >= res.measure_start)
    assert res.report["warmup_requests"] == int((~a["measured"]).sum()) > 0
    assert len(srv.log) == a["measured"].size


def test_block_interleaving_rotates_and_drains():
    """Closed-loop blocks: one endpoint per block, rotated, and no request of a block is sent
    before every request of the previous block has finished (a slow endpoint's stragglers
    cannot eat the next endpoint's time). Throughput is over each endpoint's own blocks."""
    with FakeServer(softmax_s=0.03) as srv:
        res = lt.run_loadtest(srv.url, ["live", "softmax"], concurrency=3, duration=0.8, warmup=0.1,
                              interleave="block", block_s=0.2)
    a = res.samples.arrays()
    m = a["measured"]
    order = np.argsort(a["sent"][m])
    ep, sent, done = a["endpoint"][m][order], a["sent"][m][order], a["done"][m][order]
    runs = np.flatnonzero(np.diff(ep)) + 1  # indices where the endpoint changes
    assert len(runs) == 3  # 4 blocks: live, softmax, live, softmax
    assert ep[0] == 0 and list(ep[runs]) == [1, 0, 1]
    bounds = [0, *runs, len(ep)]
    for k in range(1, len(bounds) - 1):
        assert sent[bounds[k]:bounds[k + 1]].min() >= done[bounds[k - 1]:bounds[k]].max()
    rep = res.report["endpoints"]
    for i, name in enumerate(["live", "softmax"]):
        assert rep[name]["throughput_rps"] == pytest.approx(rep[name]["requests"] / rep[name]["window_s"])
    assert rep["live"]["window_s"] + rep["softmax"]["window_s"] == pytest.approx(res.report["window_s"])


@pytest.mark.parametrize("url", ["http://10.1.2.3:8000", "http://8.8.8.8", "http://[2001:db8::1]:80"])
def test_non_loopback_targets_are_refused(url):
    with pytest.raises(lt.RemoteTargetError):
        lt.check_target(url)
    with pytest.raises(lt.RemoteTargetError):
        lt.run_loadtest(url, ["live"], concurrency=1, duration=0.1, warmup=0)
    assert lt.check_target(url, allow_remote=True)[0] in url


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://127.5.6.7:1", "http://localhost:9",
                                 "http://[::1]:8000"])
def test_loopback_targets_are_accepted(url):
    lt.check_target(url)


def test_cli_refuses_remote(tmp_path, capsys):
    assert slc("loadtest", "--url", "http://192.0.2.1:8000", "--duration", "1", "--out", tmp_path) == 2
    assert not any(tmp_path.iterdir())
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--allow-remote" in err


def test_cli_closed_port_says_so_and_fails(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        code = slc("loadtest", "--url", f"127.0.0.1:{port}", "--duration", "0.5", "--warmup", "0", "--out", tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith("error: cannot reach the server") and f"127.0.0.1:{port}" in err[-1]


def test_cli_fails_when_every_request_failed(tmp_path, capsys):
    with FakeServer(topk_status=lambda n: 503) as srv:
        code = slc("loadtest", "--url", srv.url, "--endpoint", "topk", "--concurrency", "2", "--duration", "0.4",
                   "--warmup", "0", "--out", tmp_path)
    assert code == 1
    assert "no request succeeded" in capsys.readouterr().err
    assert json.loads((tmp_path / "report.json").read_text())["ok"] == 0


def test_cli_writes_three_reports_against_fake(tmp_path):
    with FakeServer(topk_status=lambda n: 429 if n % 2 else 200) as srv:
        assert slc("loadtest", "--url", srv.url, "--endpoint", "detect,softmax,topk", "--concurrency", "2",
                   "--duration", "0.5", "--warmup", "0.2", "--batch", "2", "--out", tmp_path) == 0
        report = json.loads((tmp_path / "report.json").read_text())
    assert {p.name for p in tmp_path.iterdir()} >= {"report.json", "report.md", "latency.png"}
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["generator_ceiling"]["rps"] > 0
    assert set(data["endpoints"]) == {"detect", "softmax", "topk"}
    assert data["endpoints"]["topk"]["errors"].get("429", 0) > 0
    md = (tmp_path / "report.md").read_text()
    assert "generator ceiling" in md and "429" in md
    assert (tmp_path / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["class"] == "cat"  # the first class of GET /v1/model


# ---------------------------------------------------------------------------------------------
# against the real server (a subprocess of `slc serve` on a small synthetic bundle)


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    from serving.bundle import synthetic
    from tools.bench.server import ServerProcess, slc_server

    tmp = tmp_path_factory.mktemp("lt-real")
    bundle = synthetic.build_synthetic_bundle(classes=50, dim=16, input_dim=8, seed=0, out=tmp / "bundle")
    srv: ServerProcess = slc_server(bundle, tmp, "test", tmp / "data")
    try:
        srv.wait_ready(120)
        yield srv
    finally:
        srv.stop()


def test_short_real_run_writes_three_reports(real_server, tmp_path):
    url = real_server.url.removeprefix("http://")  # host:port is accepted
    assert slc("loadtest", "--url", url, "--endpoint", "detect,softmax,topk,topk_index", "--class", "7",
               "--concurrency", "2", "--duration", "0.6", "--warmup", "0.2", "--out", tmp_path) == 0
    assert {p.name for p in tmp_path.iterdir()} >= {"report.json", "report.md", "latency.png"}
    data = json.loads((tmp_path / "report.json").read_text())
    for name in ("detect", "softmax", "topk", "topk_index"):
        ep = data["endpoints"][name]
        assert ep["requests"] > 0 and ep["errors"] == {}, (name, ep["errors"])
    assert data["input_shape"] == [8]  # read from GET /v1/model
    assert data["generator_ceiling"]["rps"] > 0


def test_real_server_open_loop_and_statuses(real_server):
    """Unknown class -> 404 counted under its status; open loop against the real server."""
    res = lt.run_loadtest(real_server.url, ["detect"], class_="no-such-class", rate=50, duration=0.4, warmup=0)
    ep = res.report["endpoints"]["detect"]
    assert ep["ok"] == 0 and ep["errors"] == {"404": ep["requests"]} and ep["requests"] > 0
