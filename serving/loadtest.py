"""Load generator for a running slc server (DESIGN.md §7, §8 `slc loadtest`).

Why it is built this way:
- endpoints are interleaved (round-robin per request slot, or per short time block) so that the
  machine's drift -- other tenants, thermal, GC -- hits every endpoint alike;
- request bodies are encoded once up front: the generator must not spend its CPU on JSON;
- the default client speaks keep-alive HTTP/1.1 over raw asyncio streams on uvloop: measured
  ~63 us of client CPU per request against ~160 us for aiohttp (2.5x cheaper; 4,000-4,400 vs
  2,600-3,000 req/s on GET /v1/health/live at concurrency 8, wrk 4,000-6,200 on the same
  endpoint, 2 shared cores); aiohttp stays selectable (client="aiohttp");
- the open loop measures latency from the SCHEDULED send time, so a server stall (or a client
  that falls behind) shows up in the numbers instead of silently thinning the load
  (no coordinated omission);
- every report carries the generator's own ceiling (trivial endpoint, and `wrk` when present),
  because a number above that ceiling measures the client, not the server.

Never imports torch.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence
from urllib.parse import quote, urlsplit

import numpy as np

try:  # orjson is a base dependency; json keeps the module importable without it
    import orjson

    def _dumps(obj) -> bytes:
        return orjson.dumps(obj)

    _loads = orjson.loads
except ImportError:  # pragma: no cover
    def _dumps(obj) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    _loads = json.loads

PERCENTILES = (50.0, 90.0, 99.0, 99.9)
TRIVIAL_ENDPOINT = "live"
ENDPOINT_NAMES = ("detect", "softmax", "topk", "topk_exact", "topk_index", "live", "model")


class RemoteTargetError(ValueError):
    """The target is not a loopback address and --allow-remote was not given."""


# ----------------------------------------------------------------------------------------------
# target checks and endpoint requests


def check_target(url: str, allow_remote: bool = False) -> tuple[str, int]:
    """Resolve the URL's host; refuse anything that is not loopback unless allowed.

    Returns (host, port). Resolution (not string matching) decides: a name that resolves to
    any non-loopback address is refused.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", ""):
        raise ValueError(f"only http:// targets are supported, got {url!r}")
    host = parts.hostname
    if not host:
        raise ValueError(f"no host in {url!r}")
    port = parts.port or 80
    if allow_remote:
        return host, port
    try:
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise RemoteTargetError(f"cannot resolve {host!r} ({exc}); refusing without --allow-remote") from exc
    addresses = {info[4][0] for info in infos}
    remote = []
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if not ip.is_loopback:
            remote.append(address)
    if remote or not addresses:
        raise RemoteTargetError(
            f"{host!r} resolves to non-loopback address(es) {sorted(remote)}; "
            "load tests only target 127.0.0.0/8, ::1 or localhost unless --allow-remote is given"
        )
    return host, port


@dataclass
class EndpointSpec:
    """One endpoint of the mix: its name, method, path and a pool of pre-encoded bodies."""

    name: str
    method: str
    path: str
    bodies: list[bytes]
    raw_requests: list[bytes] = field(default_factory=list)  # full HTTP/1.1 requests


def endpoint_request(name: str, class_: str, inputs: list, k: int = 10) -> tuple[str, str, Optional[dict]]:
    """(method, path, json body) of one endpoint of DESIGN.md §7."""
    cls = quote(str(class_), safe="")
    if name == "detect":
        return "POST", f"/v1/classes/{cls}/detect", {"inputs": inputs}
    if name == "softmax":
        return "POST", f"/v1/classes/{cls}/softmax", {"inputs": inputs}
    if name in ("topk", "topk_exact"):
        return "POST", "/v1/topk", {"inputs": inputs, "k": k, "mode": "exact"}
    if name == "topk_index":
        return "POST", "/v1/topk", {"inputs": inputs, "k": k, "mode": "index"}
    if name == "live":
        return "GET", "/v1/health/live", None
    if name == "model":
        return "GET", "/v1/model", None
    raise ValueError(f"unknown endpoint {name!r}; choose from {', '.join(ENDPOINT_NAMES)}")


def _raw_request(method: str, path: str, host: str, port: int, body: Optional[bytes]) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return (head + "\r\n").encode("latin-1") + (body or b"")


def model_input_info(model: dict) -> tuple[list[int], Optional[str]]:
    """Input shape (without batch) and a default class from GET /v1/model, tolerant of nesting."""
    shape = None
    for holder in (model, model.get("manifest") or {}, model.get("model") or {}):
        spec = holder.get("input")
        if isinstance(spec, dict) and isinstance(spec.get("shape"), list):
            shape = spec["shape"]
            break
        if isinstance(holder.get("input_shape"), list):
            shape = holder["input_shape"]
            break
    if shape is None:
        raise ValueError(f"GET /v1/model has no input shape: keys {sorted(model)}")
    shape = [int(s) for s in shape if s not in (None, -1, "N", "batch")]
    default_class = None
    for holder in (model, model.get("manifest") or {}, model.get("model") or {}):
        classes = holder.get("classes")
        if isinstance(classes, list) and classes:
            default_class = str(classes[0]) if not isinstance(classes[0], dict) else str(
                classes[0].get("name", classes[0].get("id", 0)))
            break
    return shape, default_class


def build_endpoints(names: Sequence[str], class_: str, input_shape: Sequence[int], host: str, port: int,
                    batch: int = 1, pool: int = 8, k: int = 10, seed: int = 0) -> list[EndpointSpec]:
    """Encode `pool` request bodies per endpoint once (random inputs of the bundle's shape)."""
    rng = np.random.default_rng(seed)
    inputs_pool = [np.round(rng.standard_normal((batch, *input_shape)), 4).tolist() for _ in range(pool)]
    specs = []
    for name in names:
        method, path, body_obj = endpoint_request(name, class_, inputs_pool[0], k)
        bodies = []
        if body_obj is not None:
            for inputs in inputs_pool:
                _, _, obj = endpoint_request(name, class_, inputs, k)
                bodies.append(_dumps(obj))
        spec = EndpointSpec(name=name, method=method, path=path, bodies=bodies or [b""])
        spec.raw_requests = [_raw_request(method, path, host, port, b if body_obj is not None else None)
                             for b in spec.bodies]
        specs.append(spec)
    return specs


# ----------------------------------------------------------------------------------------------
# transports


class HttpError(Exception):
    pass


class RawHttpPool:
    """Keep-alive HTTP/1.1 connections over asyncio streams; at most `size` requests in flight."""

    def __init__(self, host: str, port: int, size: int):
        self.host, self.port = host, port
        self._sem = asyncio.Semaphore(size)
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _connect(self):
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer

    async def acquire_slot(self):
        await self._sem.acquire()

    async def roundtrip(self, spec: EndpointSpec, body_index: int) -> int:
        """Send one request on an idle connection (slot already held); returns the status."""
        conn = self._idle.pop() if self._idle else await self._connect()
        reader, writer = conn
        reusable = False
        try:
            writer.write(spec.raw_requests[body_index])
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length, chunked, close = None, False, False
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"transfer-encoding" and b"chunked" in value.lower():
                    chunked = True
                elif name == b"connection" and b"close" in value.lower():
                    close = True
            if chunked:
                while True:
                    size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                    await reader.readexactly(size + 2)
                    if size == 0:
                        break
            elif length is not None:
                await reader.readexactly(length)
            else:
                await reader.read()
                close = True
            reusable = not close
            return status
        finally:
            if reusable:
                self._idle.append(conn)
            else:
                writer.close()

    def release_slot(self):
        self._sem.release()

    async def close(self):
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


class AiohttpPool:
    """The same interface over aiohttp (selectable with client='aiohttp')."""

    def __init__(self, host: str, port: int, size: int):
        import aiohttp

        self._base = f"http://{host}:{port}"
        self._sem = asyncio.Semaphore(size)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=size, force_close=False),
            timeout=aiohttp.ClientTimeout(total=None),
            skip_auto_headers=("User-Agent",),
        )

    async def acquire_slot(self):
        await self._sem.acquire()

    async def roundtrip(self, spec: EndpointSpec, body_index: int) -> int:
        data = spec.bodies[body_index] if spec.method == "POST" else None
        headers = {"Content-Type": "application/json"} if data is not None else None
        async with self._session.request(spec.method, self._base + spec.path, data=data, headers=headers) as resp:
            await resp.read()
            return resp.status

    def release_slot(self):
        self._sem.release()

    async def close(self):
        await self._session.close()


# ----------------------------------------------------------------------------------------------
# the run


@dataclass
class Samples:
    """One row per issued request (warm-up included, flagged), times in perf_counter seconds."""

    endpoint: list = field(default_factory=list)   # index into the endpoint list
    scheduled: list = field(default_factory=list)  # open loop: scheduled send time; closed: send time
    sent: list = field(default_factory=list)       # when a connection was held and the write began
    done: list = field(default_factory=list)
    status: list = field(default_factory=list)     # HTTP status, or 0 for a transport error
    error: list = field(default_factory=list)      # transport error name or ""
    measured: list = field(default_factory=list)   # False for warm-up

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            "endpoint": np.asarray(self.endpoint, dtype=np.int64),
            "scheduled": np.asarray(self.scheduled, dtype=np.float64),
            "sent": np.asarray(self.sent, dtype=np.float64),
            "done": np.asarray(self.done, dtype=np.float64),
            "status": np.asarray(self.status, dtype=np.int64),
            "error": np.asarray(self.error, dtype=object),
            "measured": np.asarray(self.measured, dtype=bool),
        }


@dataclass
class LoadtestResult:
    report: dict
    samples: Samples
    endpoints: list[str]
    measure_start: float = 0.0


@dataclass
class _RunState:
    endpoints: list[EndpointSpec]
    pool: object
    samples: Samples
    measure_start: float
    measure_end: float
    max_requests: Optional[int]
    interleave: str
    block_s: float
    issued_measured: int = 0
    completed: int = 0
    errors: int = 0
    stop: bool = False
    phase_end: float = math.inf  # closed-loop block mode: end of the current block (else measure_end)
    fixed_endpoint: Optional[int] = None  # closed-loop block mode: the current block's endpoint

    def endpoint_for(self, slot: int, t: float) -> int:
        """Round-robin per request slot; in 'block' mode the block's endpoint (by time in the open loop)."""
        if self.fixed_endpoint is not None:
            return self.fixed_endpoint
        n = len(self.endpoints)
        if self.interleave == "block" and t >= self.measure_start:
            return int((t - self.measure_start) // self.block_s) % n
        return slot % n

    def admit(self, t: float) -> Optional[bool]:
        """None: stop issuing; else whether the request at time t is measured."""
        if self.stop or t >= self.measure_end or t >= self.phase_end:
            return None
        if t < self.measure_start:
            return False
        if self.max_requests is not None and self.issued_measured >= self.max_requests:
            self.stop = True
            return None
        self.issued_measured += 1
        return True


async def _one_request(state: _RunState, slot: int, ep: int, scheduled: float, measured: bool) -> None:
    spec = state.endpoints[ep]
    pool = state.pool
    status, error, sent, held = 0, "", float("nan"), False
    try:
        await pool.acquire_slot()  # open loop: may wait here; the latency still counts from `scheduled`
        held = True
        sent = time.perf_counter()
        status = await pool.roundtrip(spec, (slot // len(state.endpoints)) % len(spec.raw_requests))
    except asyncio.CancelledError:
        error = "timeout"
        raise
    except Exception as exc:  # transport failures are data, not crashes
        error = type(exc).__name__
    finally:
        if held:
            pool.release_slot()
        done = time.perf_counter()
        s = state.samples
        s.endpoint.append(ep)
        s.scheduled.append(scheduled)
        s.sent.append(sent)
        s.done.append(done)
        s.status.append(status)
        s.error.append(error)
        s.measured.append(measured)
        state.completed += 1
        if error or not 200 <= status < 300:
            state.errors += 1


async def _closed_worker(state: _RunState, counter: list[int]) -> None:
    while True:
        t = time.perf_counter()
        measured = state.admit(t)
        if measured is None:
            return
        slot = counter[0]
        counter[0] += 1
        await _one_request(state, slot, state.endpoint_for(slot, t), t, measured)


async def _closed_phase(state: _RunState, counter: list[int], concurrency: int, timeout: float) -> None:
    """Run `concurrency` workers until the state admits no more requests; cancel stragglers after timeout."""
    workers = [asyncio.create_task(_closed_worker(state, counter)) for _ in range(concurrency)]
    _, pending = await asyncio.wait(workers, timeout=timeout)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending)


async def _closed_blocks(state: _RunState, concurrency: int, warmup: float, duration: float, block_s: float,
                         drain_timeout: float) -> list[float]:
    """Closed loop in blocks: one endpoint per block, rotated; each block drains before the next starts.

    Draining keeps a slow endpoint's stragglers out of the next endpoint's block (they would
    otherwise steal its server time). Returns the seconds each endpoint owned (block + its drain).
    """
    n = len(state.endpoints)
    counter = [0]
    if warmup > 0:  # warm-up interleaved per request, not recorded
        state.phase_end = state.measure_start
        await _closed_phase(state, counter, concurrency, warmup + drain_timeout)
    blocks = n * max(1, round(duration / (block_s * n)))
    state.measure_start = time.perf_counter()
    state.measure_end = math.inf
    owned = [0.0] * n
    for b in range(blocks):
        if state.stop:
            break
        ep = b % n
        start = time.perf_counter()
        state.fixed_endpoint, state.phase_end = ep, start + block_s
        await _closed_phase(state, counter, concurrency, block_s + drain_timeout)
        owned[ep] += time.perf_counter() - start
    state.fixed_endpoint, state.phase_end = None, math.inf
    return owned


async def _open_dispatcher(state: _RunState, rate: float, t0: float, tasks: set) -> None:
    slot = 0
    while True:
        scheduled = t0 + slot / rate
        measured = state.admit(scheduled)
        if measured is None:
            return
        # timers may fire up to ~1 ms early (uvloop rounds to ms): never send before the schedule
        while (delay := scheduled - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        # if the dispatcher is late the request keeps its scheduled time: latency counts from it
        task = asyncio.create_task(_one_request(state, slot, state.endpoint_for(slot, scheduled), scheduled, measured))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        slot += 1


async def _progress(state: _RunState, t0: float, enabled: bool) -> None:
    if not enabled:
        return
    last_n, last_t = 0, time.perf_counter()
    while True:
        await asyncio.sleep(0.5)
        now = time.perf_counter()
        phase = "warm-up" if now < state.measure_start else ("measure" if now < state.measure_end else "drain")
        rps = (state.completed - last_n) / (now - last_t)
        last_n, last_t = state.completed, now
        sys.stderr.write(f"\r[{phase:7s}] {now - t0:6.1f}s  done {state.completed:8d}  "
                         f"{rps:9.1f} req/s  errors {state.errors:6d}   ")
        sys.stderr.flush()


async def run_async(url: str, endpoints: Sequence[str], class_: Optional[str] = None,
                    concurrency: Optional[int] = None, rate: Optional[float] = None,
                    duration: float = 10.0, warmup: float = 2.0, max_requests: Optional[int] = None,
                    batch: int = 1, allow_remote: bool = False, client: str = "raw",
                    interleave: str = "request", block_s: float = 1.0, max_connections: int = 256,
                    drain_timeout: float = 30.0, progress: bool = False, k: int = 10,
                    input_shape: Optional[Sequence[int]] = None, seed: int = 0) -> LoadtestResult:
    """One load run; returns the report (dict) and the raw samples.

    Closed loop with `concurrency` workers (default 8), or open loop at `rate` req/s using up to
    `max_connections` connections. Warm-up is not recorded; the run stops after `duration`
    measured seconds or `max_requests` measured requests, then drains in-flight requests.
    """
    if concurrency is not None and rate is not None:
        raise ValueError("give either concurrency (closed loop) or rate (open loop), not both")
    if rate is not None and rate <= 0:
        raise ValueError("rate must be > 0")
    if concurrency is None and rate is None:
        concurrency = 8
    if interleave not in ("request", "block"):
        raise ValueError("interleave must be 'request' or 'block'")
    endpoints = [e.strip() for e in endpoints if e.strip()]
    for e in endpoints:
        endpoint_request(e, "0", [])  # validates the name
    host, port = check_target(url, allow_remote)

    need_model = any(e not in ("live", "model") for e in endpoints) and (input_shape is None or class_ is None)
    if need_model:
        model = await _get_json(host, port, "/v1/model")
        shape, default_class = model_input_info(model)
        input_shape = input_shape if input_shape is not None else shape
        class_ = class_ if class_ is not None else (default_class if default_class is not None else "0")
    specs = build_endpoints(endpoints, class_ if class_ is not None else "0", input_shape or [1], host, port,
                            batch=batch, k=k, seed=seed)

    size = concurrency if concurrency is not None else max_connections
    pool = AiohttpPool(host, port, size) if client == "aiohttp" else RawHttpPool(host, port, size)
    samples = Samples()
    t0 = time.perf_counter()
    state = _RunState(specs, pool, samples, measure_start=t0 + warmup, measure_end=t0 + warmup + duration,
                      max_requests=max_requests, interleave=interleave, block_s=block_s)
    progress_task = asyncio.create_task(_progress(state, t0, progress))
    try:
        owned = None
        if concurrency is not None and interleave == "block":
            owned = await _closed_blocks(state, concurrency, warmup, duration, block_s, drain_timeout)
            pending = set()
        elif concurrency is not None:
            counter = [0]
            workers = [asyncio.create_task(_closed_worker(state, counter)) for _ in range(concurrency)]
            done, pending = await asyncio.wait(workers, timeout=warmup + duration + drain_timeout)
        else:
            tasks: set = set()
            await _open_dispatcher(state, rate, t0, tasks)
            pending_now = set(tasks)
            done, pending = (await asyncio.wait(pending_now, timeout=drain_timeout)) if pending_now else (set(), set())
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
    finally:
        progress_task.cancel()
        await pool.close()
        if progress:
            sys.stderr.write("\n")
    report = summarize(samples, [s.name for s in specs], state.measure_start, duration, interleave, block_s, owned)
    report.update({
        "url": url, "class": class_, "batch": batch, "client": client, "interleave": interleave,
        "load": ({"model": "closed", "concurrency": concurrency} if concurrency is not None
                 else {"model": "open", "rate": rate, "max_connections": max_connections}),
        "duration_s": duration, "warmup_s": warmup, "max_requests": max_requests,
        "input_shape": list(input_shape or []),
    })
    if interleave == "block":
        report["block_s"] = block_s
    return LoadtestResult(report=report, samples=samples, endpoints=[s.name for s in specs],
                          measure_start=state.measure_start)


async def _get_json(host: str, port: int, path: str) -> dict:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
        data = await reader.read()
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head[9:12])
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    if status != 200:
        raise HttpError(f"GET {path} -> {status}: {body[:200]!r}")
    return _loads(body)


def _dechunk(data: bytes) -> bytes:
    out, pos = bytearray(), 0
    while True:
        end = data.index(b"\r\n", pos)
        size = int(data[pos:end].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += data[end + 2:end + 2 + size]
        pos = end + 2 + size + 2


# ----------------------------------------------------------------------------------------------
# statistics and reports


def nearest_rank_percentiles(values: np.ndarray, percentiles: Sequence[float] = PERCENTILES) -> dict[float, float]:
    """Nearest-rank percentile: the smallest sample with at least p% of samples at or below it.

    (The definition HdrHistogram and wrk use; numpy's method="inverted_cdf".)
    """
    ordered = np.sort(np.asarray(values, dtype=np.float64))
    n = ordered.size
    if n == 0:
        return {p: float("nan") for p in percentiles}
    out = {}
    for p in percentiles:
        rank = max(1, math.ceil(p / 100.0 * n - 1e-9))
        out[p] = float(ordered[min(rank, n) - 1])
    return out


def _pkey(p: float) -> str:
    return f"p{p:g}"


def latency_summary(seconds: np.ndarray) -> dict:
    """Latency statistics in milliseconds (nearest-rank percentiles, mean, max, count)."""
    seconds = np.asarray(seconds, dtype=np.float64)
    if seconds.size == 0:
        return {"count": 0}
    out = {_pkey(p): v * 1e3 for p, v in nearest_rank_percentiles(seconds).items()}
    out.update({"mean": float(seconds.mean() * 1e3), "max": float(seconds.max() * 1e3),
                "min": float(seconds.min() * 1e3), "count": int(seconds.size)})
    return out


def _owned_time(index: int, n: int, window: float, interleave: str, block_s: float) -> float:
    """Seconds of the measured window that belong to endpoint `index` (all of it unless 'block')."""
    if interleave != "block" or n == 1:
        return window
    total, j = 0.0, index
    while j * block_s < window:
        total += min((j + 1) * block_s, window) - j * block_s
        j += n
    return max(total, 1e-9)


def summarize(samples: Samples, names: list[str], measure_start: float, duration: float,
              interleave: str = "request", block_s: float = 1.0, owned: Optional[list[float]] = None) -> dict:
    """Per-endpoint throughput, latency and errors over the measured requests; ratios between endpoints."""
    a = samples.arrays()
    m = a["measured"]
    if m.sum():
        # the window ends at the last completion, or at the planned end if requests stopped earlier
        window = float(max(a["done"][m].max(), a["scheduled"][m].max()) - measure_start)
    else:
        window = 0.0
    window = max(window, 1e-9)
    if owned is not None:  # closed-loop blocks: each endpoint's own blocks, drains included
        window = max(sum(owned), 1e-9)
    per = {}
    for i, name in enumerate(names):
        sel = m & (a["endpoint"] == i)
        status, error = a["status"][sel], a["error"][sel]
        ok = (error == "") & (status >= 200) & (status < 300)
        latency = (a["done"] - a["scheduled"])[sel]
        service = (a["done"] - a["sent"])[sel]
        errors: dict[str, int] = {}
        for st, er in zip(status[~ok], error[~ok]):
            key = f"transport:{er}" if er else str(int(st))
            errors[key] = errors.get(key, 0) + 1
        # in 'block' interleaving an endpoint only owns its blocks: throughput over its own time
        sched = a["scheduled"][sel]
        own = max(owned[i], 1e-9) if owned is not None else _owned_time(i, len(names), window, interleave, block_s)
        per[name] = {
            "requests": int(sel.sum()),
            "ok": int(ok.sum()),
            "errors": dict(sorted(errors.items())),
            "throughput_rps": float(sel.sum() / own),
            "goodput_rps": float(ok.sum() / own),
            "window_s": own,
            "latency_ms": latency_summary(latency[ok]),
            "service_ms": latency_summary(service[ok]),
            "first_scheduled": float(sched.min() - measure_start) if sched.size else None,
        }
    total_ok = sum(v["ok"] for v in per.values())
    report = {
        "window_s": window,
        "requests": int(m.sum()),
        "ok": int(total_ok),
        "throughput_rps": float(m.sum() / window),  # all endpoints together
        "goodput_rps": float(total_ok / window),
        "warmup_requests": int((~m).sum()),
        "endpoints": per,
        "ratios": endpoint_ratios(per),
    }
    return report


def endpoint_ratios(per: dict) -> dict:
    """For each pair a/b: p50, p99 and mean latency of b over a (>1: a is faster), goodput a over b."""
    names = list(per)
    out = {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            la, lb = per[a]["latency_ms"], per[b]["latency_ms"]
            if not la.get("count") or not lb.get("count"):
                continue
            out[f"{a}/{b}"] = {
                "latency_p50_b_over_a": lb["p50"] / la["p50"] if la["p50"] else None,
                "latency_p99_b_over_a": lb["p99"] / la["p99"] if la["p99"] else None,
                "latency_mean_b_over_a": lb["mean"] / la["mean"] if la["mean"] else None,
                "goodput_a_over_b": (per[a]["goodput_rps"] / per[b]["goodput_rps"]) if per[b]["goodput_rps"] else None,
            }
    return out


def wrk_ceiling(url: str, connections: int = 8, duration: float = 3.0, threads: int = 1) -> dict:
    """Requests/s of `wrk` on the trivial endpoint, or why it could not run."""
    exe = shutil.which("wrk")
    if exe is None:
        return {"available": False, "note": "wrk not installed (apt-get install wrk)"}
    target = url.rstrip("/") + "/v1/health/live"
    cmd = [exe, f"-t{threads}", f"-c{connections}", f"-d{max(1, round(duration))}s", "--latency", target]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"available": False, "note": f"wrk failed: {exc}"}
    found = re.search(r"Requests/sec:\s*([\d.]+)", proc.stdout)
    p50 = re.search(r"50%\s+([\d.]+)(us|ms|s)", proc.stdout)
    p99 = re.search(r"99%\s+([\d.]+)(us|ms|s)", proc.stdout)
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}
    return {
        "available": found is not None,
        "rps": float(found.group(1)) if found else None,
        "p50_ms": float(p50.group(1)) * scale[p50.group(2)] if p50 else None,
        "p99_ms": float(p99.group(1)) * scale[p99.group(2)] if p99 else None,
        "command": " ".join(cmd),
        "note": None if found else proc.stdout[-300:] + proc.stderr[-300:],
    }


async def ceiling_async(url: str, concurrency: int = 8, duration: float = 2.0, client: str = "raw",
                        allow_remote: bool = False, with_wrk: bool = True) -> dict:
    """The generator's own ceiling: closed loop on GET /v1/health/live, plus wrk for comparison."""
    res = await run_async(url, [TRIVIAL_ENDPOINT], concurrency=concurrency, duration=duration, warmup=min(0.5, duration),
                          allow_remote=allow_remote, client=client)
    ep = res.report["endpoints"][TRIVIAL_ENDPOINT]
    out = {"endpoint": "/v1/health/live", "client": client, "concurrency": concurrency,
           "rps": ep["goodput_rps"], "p50_ms": ep["latency_ms"].get("p50"), "p99_ms": ep["latency_ms"].get("p99"),
           "errors": ep["errors"]}
    if with_wrk:
        out["wrk"] = await asyncio.get_running_loop().run_in_executor(None, wrk_ceiling, url, concurrency, duration)
    return out


def _run(coro):
    """Run on uvloop when installed (cheaper per request), else the default loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def run_loadtest(url: str, endpoints: Sequence[str], **kwargs) -> LoadtestResult:
    """Synchronous wrapper of run_async (see its arguments)."""
    return _run(run_async(url, endpoints, **kwargs))


def measure_ceiling(url: str, **kwargs) -> dict:
    return _run(ceiling_async(url, **kwargs))


def _fmt(x, digits=2) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return str(x)


def report_markdown(report: dict) -> str:
    load = report["load"]
    load_s = (f"closed loop, concurrency {load['concurrency']}" if load["model"] == "closed"
              else f"open loop, {load['rate']} req/s (latency from the scheduled send time)")
    lines = [
        f"# slc load test: {', '.join(report['endpoints'])}",
        "",
        f"- target: `{report['url']}`, class `{report.get('class')}`, {report['batch']} input(s) per request",
        f"- load: {load_s}; interleaving per {'request slot' if report['interleave'] == 'request' else 'time block of ' + _fmt(report.get('block_s')) + ' s'}",
        f"- measured {report['requests']} requests over {_fmt(report['window_s'])} s after {report['warmup_s']} s warm-up "
        f"({report['warmup_requests']} warm-up requests not recorded); client `{report['client']}`",
    ]
    if report.get("command"):
        lines.append(f"- command: `{report['command']}`")
    ceil = report.get("generator_ceiling")
    if ceil:
        wrk = ceil.get("wrk") or {}
        wrk_s = (f"wrk {_fmt(wrk.get('rps'), 0)} req/s (p50 {_fmt(wrk.get('p50_ms'))} ms)" if wrk.get("available")
                 else f"wrk: {wrk.get('note', 'not run')}")
        lines.append(f"- generator ceiling on `{ceil['endpoint']}` (concurrency {ceil['concurrency']}): "
                     f"{_fmt(ceil['rps'], 0)} req/s (p50 {_fmt(ceil['p50_ms'])} ms); {wrk_s}. "
                     "Numbers near this ceiling measure the client and the shared cores, not the endpoint.")
    lines += ["", "| endpoint | requests | ok | req/s | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms | errors |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, ep in report["endpoints"].items():
        lat = ep["latency_ms"]
        errs = ", ".join(f"{k}: {v}" for k, v in ep["errors"].items()) or "none"
        lines.append(f"| {name} | {ep['requests']} | {ep['ok']} | {_fmt(ep['goodput_rps'], 1)} | {_fmt(lat.get('p50'))} | "
                     f"{_fmt(lat.get('p90'))} | {_fmt(lat.get('p99'))} | {_fmt(lat.get('p99.9'))} | {_fmt(lat.get('max'))} | {errs} |")
    if report["ratios"]:
        lines += ["", "Ratios (b over a for latency: > 1 means a is faster):", "",
                  "| a/b | p50 | p99 | mean | goodput a/b |", "|---|---:|---:|---:|---:|"]
        for pair, r in report["ratios"].items():
            lines.append(f"| {pair} | {_fmt(r['latency_p50_b_over_a'])} | {_fmt(r['latency_p99_b_over_a'])} | "
                         f"{_fmt(r['latency_mean_b_over_a'])} | {_fmt(r['goodput_a_over_b'])} |")
        if report["interleave"] == "request" and report["load"]["model"] == "closed":
            lines += ["", "With per-request interleaving in a closed loop every endpoint gets the same number of "
                      "requests, so goodput ratios are ~1 by construction; compare latencies."]
    lines.append("")
    return "\n".join(lines)


def plot_latency(result: LoadtestResult, path: Path) -> None:
    """Latency distribution per endpoint: histogram (log x) and percentile spectrum."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = result.samples.arrays()
    ok = a["measured"] & (a["error"] == "") & (a["status"] >= 200) & (a["status"] < 300)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, name in enumerate(result.endpoints):
        lat = (a["done"] - a["scheduled"])[ok & (a["endpoint"] == i)] * 1e3
        if lat.size == 0:
            continue
        lo, hi = max(lat.min(), 1e-3), max(lat.max(), 1e-3 * 1.01)
        bins = np.logspace(np.log10(lo), np.log10(hi) + 1e-9, 60)
        ax1.hist(lat, bins=bins, histtype="step", label=f"{name} (n={lat.size})")
        ordered = np.sort(lat)
        q = (np.arange(1, ordered.size + 1) - 0.5) / ordered.size
        ax2.plot(1.0 / (1.0 - q), ordered, label=name)
    ax1.set_xscale("log")
    ax1.set_xlabel("latency (ms)")
    ax1.set_ylabel("requests")
    ax1.set_title("latency histogram")
    ax1.legend(fontsize=8)
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ticks = [2, 10, 100, 1000]
    ax2.set_xticks(ticks)
    ax2.set_xticklabels(["p50", "p90", "p99", "p99.9"])
    ax2.set_xlabel("percentile")
    ax2.set_ylabel("latency (ms)")
    ax2.set_title("percentile spectrum")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(result: LoadtestResult, out: Path) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "report.json", out / "report.md", out / "latency.png"]
    paths[0].write_text(json.dumps(result.report, indent=2, default=float) + "\n")
    paths[1].write_text(report_markdown(result.report))
    plot_latency(result, paths[2])
    return paths


def run_loadtest_cli(url: str, endpoints: Sequence[str], class_: Optional[str], concurrency: Optional[int],
                     rate: Optional[float], duration: float, warmup: float, max_requests: Optional[int],
                     batch: int, allow_remote: bool, out: Path) -> dict:
    """`slc loadtest`: generator ceiling first, then the measured run; writes OUT/report.{json,md}, latency.png."""
    try:
        check_target(url, allow_remote)
    except (RemoteTargetError, ValueError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        raise SystemExit(2)
    if concurrency is not None and rate is not None:
        sys.stderr.write("error: give either --concurrency or --rate, not both\n")
        raise SystemExit(2)

    async def both():
        # a ceiling run proportionate to the run (2 s for real runs, shorter for smoke runs)
        ceiling = await ceiling_async(url, concurrency=concurrency or 8, duration=min(2.0, max(0.5, duration)),
                                      allow_remote=allow_remote)
        result = await run_async(url, endpoints, class_=class_, concurrency=concurrency, rate=rate, duration=duration,
                                 warmup=warmup, max_requests=max_requests, batch=batch, allow_remote=allow_remote,
                                 progress=True)
        return ceiling, result

    ceiling, result = _run(both())
    result.report["generator_ceiling"] = ceiling
    result.report["command"] = " ".join(["slc", *sys.argv[1:]]) if sys.argv[1:] else None
    paths = write_reports(result, out)
    print(report_markdown(result.report))
    print("wrote " + ", ".join(str(p) for p in paths))
    return result.report
