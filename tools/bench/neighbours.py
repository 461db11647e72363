"""A noisy neighbour on a shared backbone lane, measured: two bundles of one backbone graph served by one
`slc serve --model-repository` with a small queue; model m00 flooded by an open-loop client far above what
the server answers, model m01 asked by one client, one request at a time: m01's detect latency and failures
alone and under the flood, and the flood's 429s. With `--base DIR`, a second server runs DIR's code
(PYTHONPATH) on the same bundles, measured the same way in the same run: the before of a change.

    slc bench neighbours --queue-size 64 --connections 16 --inputs 16 --seconds 8 [--base ../old-checkout]
"""
from __future__ import annotations

import asyncio
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Optional

import numpy as np

from tools.bench.many_models import INPUT_DIM, RawClient, _bodies, _cpus, _open_loop, build
from tools.bench.server import slc_server

FLOODED, ASKED = "m00", "m01"


def _ask(url: str, bodies: list[bytes], seconds: float) -> dict:
    """One client, one detect of the asked model at a time, for `seconds`: latencies of the 200s, other statuses."""
    client, lat, other = RawClient(url), [], {}
    end, i = time.perf_counter() + seconds, 0
    try:
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            status, _ = client.post(f"/v1/models/{ASKED}/classes/{(7 * i) % 100}/detect", bodies[i % len(bodies)])
            if status == 200:
                lat.append(time.perf_counter() - t0)
            else:
                other[status] = other.get(status, 0) + 1
            i += 1
    finally:
        client.close()
    return {"answered": len(lat), "failed": other, "p50_ms": _ms(lat, 0.5), "p99_ms": _ms(lat, 0.99)}


def _ms(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    return 1e3 * (statistics.median(values) if q == 0.5 else sorted(values)[min(len(values) - 1, int(q * len(values)))])


def _flood_bodies(inputs: int, n: int = 32) -> list[bytes]:
    """Detect bodies of `inputs` inputs each: few requests that fill the queue, so that the flood costs the
    server's front little and its queue much."""
    rng = np.random.default_rng(11)
    return [json.dumps({"inputs": rng.standard_normal((inputs, INPUT_DIM)).round(3).tolist()}).encode()
            for _ in range(n)]


async def _flooded(url: str, bodies: list[bytes], seconds: float, connections: int, rate: float,
                   inputs: int) -> tuple[dict, dict]:
    """(the asked model's figures, the flood's) while the flooded model gets `rate` req/s of `inputs` inputs
    each over `connections`."""
    record, stop = {"sent": 0, "failed": []}, asyncio.Event()
    paths = [f"/v1/models/{FLOODED}/classes/{j}/detect" for j in range(100)]
    flood = asyncio.create_task(_open_loop(url, paths, _flood_bodies(inputs), rate, stop, record,
                                           connections=connections))
    await asyncio.sleep(1.0)  # the queue full before the asked model's client starts
    asked = await asyncio.to_thread(_ask, url, bodies, seconds)
    stop.set()
    await flood
    refused = sum(" 429 " in f for f in record["failed"])
    return asked, {"sent": record["sent"], "refused_429": refused, "failed_other": len(record["failed"]) - refused}


def measure(work: Path, classes: int, queue_size: int, connections: int, seconds: float, rate: float,
            inputs: int, base: Optional[Path]) -> dict:
    repo, _ = build(work, 2, classes)
    bodies = _bodies(256, 3)
    sides = {"this checkout": None} | ({"base": base} if base is not None else {})
    out = {}
    for side, code in sides.items():
        env = {"SLC_MODEL_REPOSITORY": str(repo), "SLC_QUEUE_SIZE": str(queue_size)}
        if code is not None:
            env["PYTHONPATH"] = str(Path(code).resolve())
        server = slc_server(None, work, side.replace(" ", "-"), work / f"data-{side.replace(' ', '-')}", env=env)
        with server:
            server.wait_ready()
            _ask(server.url, bodies, 1.0)  # warm
            alone = _ask(server.url, bodies, seconds)
            asked, flood = asyncio.run(_flooded(server.url, bodies, seconds, connections, rate, inputs))
        out[side] = {"alone": alone, "flooded": asked, "flood": flood}
    return {"classes": classes, "queue_size": queue_size, "connections": connections, "seconds": seconds,
            "rate": rate, "inputs": inputs, "base": str(base) if base else None, "sides": out,
            "machine": f"{platform.machine()}, {_cpus()} CPUs (shared), no GPU"}


def markdown(r: dict, command: str) -> str:
    fmt = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
    rows = []
    for side, s in r["sides"].items():
        a, f, fl = s["alone"], s["flooded"], s["flood"]
        ratio = f["p50_ms"] / a["p50_ms"] if f["p50_ms"] and a["p50_ms"] else None
        rows.append(f"| {side} | {fmt(a['p50_ms'])} | {fmt(f['p50_ms'])} ({fmt(ratio)}×) | {fmt(f['p99_ms'])} | "
                    f"{f['answered']:,} | {sum(f['failed'].values()):,} {f['failed'] or ''} | {fl['sent']:,} | "
                    f"{fl['refused_429']:,} | {fl['failed_other']:,} |")
    return "\n".join([
        "# A noisy neighbour on a shared backbone", "", f"`{command}`", "",
        f"Two bundles of {r['classes']:,} classes sharing one backbone graph (synthetic, as `slc bench many-models` "
        f"builds them) in one `slc serve --model-repository`, queue {r['queue_size']} inputs. `{FLOODED}` is flooded: "
        f"{r['rate']:g} req/s of {r['inputs']} inputs each asked over {r['connections']} connections, open loop, "
        f"far above what the server answers; `{ASKED}` is asked by one client, one detect at a time, {r['seconds']:g} s alone, then "
        f"{r['seconds']:g} s under the flood. Machine: {r['machine']}.", "",
        f"| server | `{ASKED}` p50 alone (ms) | under the flood (ms) | p99 under the flood (ms) | answered | "
        f"failed | flood sent | flood 429 | flood other failures |",
        "|---|---|---|---|---|---|---|---|---|", *rows, ""])
