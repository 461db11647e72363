"""One load run against a live server (`run_loadtest`): closed loop with N workers or open
loop at a rate, endpoints interleaved per request or per time block, warm-up not recorded.

Why it is built this way:
- endpoints are interleaved so that the machine's drift (other tenants, thermal, GC) hits
  every endpoint alike;
- request bodies are encoded once up front: the generator must not spend its CPU on JSON;
- the open loop measures latency from the SCHEDULED send time, so a server stall (or a client
  that falls behind) shows up in the numbers instead of silently thinning the load
  (no coordinated omission);
- every report carries the generator's own ceiling (trivial endpoint, and `wrk` when present),
  because a number above that ceiling measures the client, not the server;
- each endpoint goes out on its protocol's own pool (HTTP endpoints share one, grpc has a
  channel of its own), so protocols compare under one client, one schedule and one report.
"""
from __future__ import annotations

import asyncio
import math
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from tools.loadtest.client import (
    TRIVIAL_ENDPOINT, V2_ENDPOINTS, AiohttpPool, EndpointSpec, GrpcPool, RawHttpPool, build_endpoints, check_endpoints,
    check_target, get_json, model_input_info, v2_target,
)
from tools.loadtest.stats import LoadtestResult, Samples, summarize


@dataclass
class _RunState:
    endpoints: list[EndpointSpec]
    pools: list  # the transport of each endpoint, by index
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
    pool = state.pools[ep]
    status, error, sent, held = 0, "", float("nan"), False
    try:
        await pool.acquire_slot()  # open loop: may wait here; the latency still counts from `scheduled`
        held = True
        sent = time.perf_counter()
        status = await pool.roundtrip(spec, (slot // len(state.endpoints)) % len(spec.bodies))
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


def _make_pools(specs: list[EndpointSpec], client: str, host: str, port: int, grpc_port: Optional[int],
                size: int) -> list:
    """One pool per transport the endpoints use; returns each endpoint's pool, by index. HTTP
    endpoints share a pool (raw or aiohttp), grpc goes on its own channel to grpc_port."""
    made: dict[str, object] = {}

    def pool_for(transport: str):
        if transport not in made:
            made[transport] = (GrpcPool(host, grpc_port, size) if transport == "grpc"
                               else AiohttpPool(host, port, size) if client == "aiohttp"
                               else RawHttpPool(host, port, size))
        return made[transport]

    return [pool_for(spec.transport) for spec in specs]


async def _prepare(host: str, port: int, endpoints: list[str], class_: Optional[str],
                   input_shape: Optional[Sequence[int]]):
    """(input shape, class, v2 target or None), from GET /v1/model when anything is not given:
    v2 endpoints always ask it, for the model's name and the class's integer id."""
    v2_needed = any(e in V2_ENDPOINTS for e in endpoints)
    needs_inputs = any(e not in ("live", "model") for e in endpoints)
    if not (v2_needed or (needs_inputs and (input_shape is None or class_ is None))):
        return input_shape, class_, None
    model = await get_json(host, port, "/v1/model")
    shape, default_class = model_input_info(model)
    input_shape = input_shape if input_shape is not None else shape
    class_ = class_ if class_ is not None else (default_class if default_class is not None else "0")
    return input_shape, class_, (v2_target(model, class_) if v2_needed else None)


def _check_load(concurrency: Optional[int], rate: Optional[float], interleave: str) -> Optional[int]:
    """The load model's arguments checked before any connection opens; returns the concurrency
    (8 when neither it nor a rate is given: the closed loop is the default)."""
    if concurrency is not None and rate is not None:
        raise ValueError("give either concurrency (closed loop) or rate (open loop), not both")
    if rate is not None and rate <= 0:
        raise ValueError("rate must be > 0")
    if concurrency is None and rate is None:
        concurrency = 8
    if interleave not in ("request", "block"):
        raise ValueError("interleave must be 'request' or 'block'")
    return concurrency


async def _drive(state: _RunState, concurrency: Optional[int], rate: Optional[float], t0: float, warmup: float,
                 duration: float, block_s: float, drain_timeout: float, interleave: str) -> Optional[list[float]]:
    """Issue the load (closed blocks, closed workers or the open dispatcher), then drain: stragglers
    past the timeout are cancelled. Returns the seconds each endpoint owned (closed blocks), else None."""
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
    return owned


async def _close_run(progress_task: asyncio.Task, pools: list, progress: bool) -> None:
    """Stop the progress line and close each distinct pool once (endpoints share pools)."""
    progress_task.cancel()
    for pool in {id(p): p for p in pools}.values():
        await pool.close()
    if progress:
        sys.stderr.write("\n")


def _run_settings(report: dict, url: str, class_: Optional[str], batch: int, client: str, interleave: str,
                  concurrency: Optional[int], rate: Optional[float], max_connections: int, duration: float,
                  warmup: float, max_requests: Optional[int], input_shape: Optional[Sequence[int]],
                  grpc_port: Optional[int], v2, block_s: float) -> None:
    """Write the run's settings into the report, so that a number always travels with its load."""
    report.update({
        "url": url, "class": class_, "batch": batch, "client": client, "interleave": interleave,
        "load": ({"model": "closed", "concurrency": concurrency} if concurrency is not None
                 else {"model": "open", "rate": rate, "max_connections": max_connections}),
        "duration_s": duration, "warmup_s": warmup, "max_requests": max_requests,
        "input_shape": list(input_shape or []),
    })
    if grpc_port is not None:
        report["grpc_port"] = grpc_port
    if v2 is not None:
        report["v2"] = {"model": v2.model, "class_id": v2.class_id}
    if interleave == "block":
        report["block_s"] = block_s


async def run_async(url: str, endpoints: Sequence[str], class_: Optional[str] = None,
                    concurrency: Optional[int] = None, rate: Optional[float] = None,
                    duration: float = 10.0, warmup: float = 2.0, max_requests: Optional[int] = None,
                    batch: int = 1, allow_remote: bool = False, client: str = "raw",
                    interleave: str = "request", block_s: float = 1.0, max_connections: int = 256,
                    drain_timeout: float = 30.0, progress: bool = False, k: int = 10,
                    input_shape: Optional[Sequence[int]] = None, seed: int = 0,
                    grpc_port: Optional[int] = None) -> LoadtestResult:
    """One load run; returns the report (dict) and the raw samples.

    Closed loop with `concurrency` workers (default 8), or open loop at `rate` req/s using up to
    `max_connections` connections (per transport). Warm-up is not recorded; the run stops after
    `duration` measured seconds or `max_requests` measured requests, then drains in-flight
    requests. The grpc endpoint goes to `grpc_port` on the same host (the server's --grpc-port).
    """
    concurrency = _check_load(concurrency, rate, interleave)
    endpoints = [e.strip() for e in endpoints if e.strip()]
    check_endpoints(endpoints, grpc_port)
    host, port = check_target(url, allow_remote)

    input_shape, class_, v2 = await _prepare(host, port, endpoints, class_, input_shape)
    specs = build_endpoints(endpoints, class_ if class_ is not None else "0", input_shape or [1], host, port,
                            batch=batch, k=k, seed=seed, v2=v2)

    pools = _make_pools(specs, client, host, port, grpc_port,
                        concurrency if concurrency is not None else max_connections)
    samples = Samples()
    t0 = time.perf_counter()
    state = _RunState(specs, pools, samples, measure_start=t0 + warmup, measure_end=t0 + warmup + duration,
                      max_requests=max_requests, interleave=interleave, block_s=block_s)
    progress_task = asyncio.create_task(_progress(state, t0, progress))
    try:
        owned = await _drive(state, concurrency, rate, t0, warmup, duration, block_s, drain_timeout, interleave)
    finally:
        await _close_run(progress_task, pools, progress)
    report = summarize(samples, [s.name for s in specs], state.measure_start, duration, interleave, block_s, owned)
    _run_settings(report, url, class_, batch, client, interleave, concurrency, rate, max_connections, duration,
                  warmup, max_requests, input_shape, grpc_port, v2, block_s)
    return LoadtestResult(report=report, samples=samples, endpoints=[s.name for s in specs],
                          measure_start=state.measure_start)




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



def run_with_ceiling(url: str, endpoints: Sequence[str], concurrency: Optional[int] = None,
                     duration: float = 10.0, allow_remote: bool = False, **kwargs) -> LoadtestResult:
    """The generator's ceiling first (2 s for real runs, shorter for smoke runs), then the measured
    run with a progress line; the ceiling goes into the report as `generator_ceiling`."""
    async def both():
        ceiling = await ceiling_async(url, concurrency=concurrency or 8, duration=min(2.0, max(0.5, duration)),
                                      allow_remote=allow_remote)
        result = await run_async(url, endpoints, concurrency=concurrency, duration=duration,
                                 allow_remote=allow_remote, progress=True, **kwargs)
        return ceiling, result

    ceiling, result = _run(both())
    result.report["generator_ceiling"] = ceiling
    return result
