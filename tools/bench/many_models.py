"""Many class-sets on one server (issue 51), measured: N synthetic bundles of D classes sharing one
backbone graph served by one `slc serve --model-repository`, against a server of one of them:
resident memory (against one bundle plus the N heads), detect p50 (the same requests, one at a time,
servers taken in turn, 50 requests each), and loads / unloads of one more bundle while an open-loop client sends R req/s
to the served models (every answer counted; any non-200 or transport error is a failed request).

    slc bench many-models --models 20 --classes 1000 --rate 200
"""
from __future__ import annotations

import asyncio
import json
import platform
import shutil
import statistics
import time
from pathlib import Path

import httpx
import numpy as np

from tools.bench.server import process_tree_memory, slc_server

INPUT_DIM = 3072  # a 32×32×3 image, flat
DIM = 256


def build(work: Path, models: int, classes: int) -> tuple[Path, Path]:
    """work/repo/m00..m{N-1} (one backbone seed, heads of their own seeds) and work/extra (one more)."""
    from serving.bundle.synthetic import build_synthetic_bundle

    repo = work / "repo"
    repo.mkdir(parents=True, exist_ok=True)
    for i in range(models + 1):
        out = repo / f"m{i:02d}" if i < models else work / "extra"
        if not (out / "manifest.json").exists():
            build_synthetic_bundle(classes=classes, dim=DIM, input_dim=INPUT_DIM, seed=i + 1, out=out,
                                   backbone_seed=0, rows="gaussian")
    return repo, work / "extra"


def _bodies(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [json.dumps({"inputs": rng.standard_normal((1, INPUT_DIM)).round(4).tolist()}).encode() for _ in range(n)]


def _request(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _read_response(read_line, read_exact) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.1 response with a Content-Length (what slc answers)."""
    status = int(read_line().split()[1])
    length = 0
    while (line := read_line()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return status, read_exact(length)


class RawClient:
    """One kept-alive HTTP/1.1 connection, plain sockets: a few µs of client per request, so that the
    figures are the server's (httpx costs a millisecond of these two cores per request)."""

    def __init__(self, url: str):
        import socket

        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.file = self.sock.makefile("rb")

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        self.sock.sendall(_request(path, body))
        return _read_response(self.file.readline, self.file.read)

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def latencies(targets: dict[str, tuple[str, list[str]]], bodies: list[bytes], block: int = 50) -> dict[str, list[float]]:
    """Detect one request at a time, the targets (name -> (url, paths)) taken in turn `block` requests each
    (so that a busy moment of the shared machine hits each alike, and each block starts on a server that
    sat idle during the others' blocks): seconds each, per target."""
    clients = {name: RawClient(url) for name, (url, _) in targets.items()}
    out: dict[str, list[float]] = {name: [] for name in targets}
    try:
        for start in range(0, len(bodies), block):
            for name, (_, paths) in targets.items():
                for i in range(start, min(start + block, len(bodies))):
                    path = paths[i % len(paths)]
                    t0 = time.perf_counter()
                    status, text = clients[name].post(path, bodies[i])
                    out[name].append(time.perf_counter() - t0)
                    if status != 200:
                        raise RuntimeError(f"{name} {path}: {status} {text[:200]!r}")
    finally:
        for c in clients.values():
            c.close()
    return out


async def _open_loop(url: str, paths: list[str], bodies: list[bytes], rate: float, stop: asyncio.Event,
                     record: dict, connections: int = 16) -> None:
    """Requests at `rate` per second until `stop` (open loop: scheduled on time whatever the answers; up to
    `connections` at once over kept-alive connections); failures (status or transport) recorded."""
    host, port = url.removeprefix("http://").split(":")
    queue: asyncio.Queue = asyncio.Queue()

    async def connection() -> None:
        reader = writer = None
        while (item := await queue.get()) is not None:
            try:
                if writer is None:
                    reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(_request(*item))
                status = int((await reader.readline()).split()[1])
                length = 0
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                text = await reader.readexactly(length)
                if status != 200:
                    record["failed"].append(f"{item[0]}: {status} {text[:160]!r}")
            except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
                record["failed"].append(f"{item[0]}: {type(exc).__name__}: {exc}")
                writer = None
            record["sent"] += 1
        if writer is not None:
            writer.close()

    workers = [asyncio.create_task(connection()) for _ in range(connections)]
    start, i = time.perf_counter(), 0
    while not stop.is_set():
        await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
        queue.put_nowait((paths[i % len(paths)], bodies[i % len(bodies)]))
        i += 1
    for _ in workers:
        queue.put_nowait(None)
    await asyncio.gather(*workers)
    record["seconds"] = time.perf_counter() - start


async def _load_unload(url: str, repo: Path, extra: Path, cycles: int) -> list[dict]:
    """Copy the extra bundle into the repository, load it, ask it, unload it; `cycles` times."""
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        for k in range(cycles):
            name = f"extra{k}"
            shutil.copytree(extra, repo / name, dirs_exist_ok=True)
            t0 = time.perf_counter()
            r = await c.post(f"/v2/repository/models/{name}/load")
            loaded = time.perf_counter() - t0
            asked = await c.post(f"/v1/models/{name}/classes/1/detect", content=_bodies(1, 99)[0],
                                 headers={"content-type": "application/json"})
            t1 = time.perf_counter()
            u = await c.post(f"/v2/repository/models/{name}/unload")
            out.append({"model": name, "load_status": r.status_code, "load_s": round(loaded, 3),
                        "asked_status": asked.status_code, "unload_status": u.status_code,
                        "unload_s": round(time.perf_counter() - t1, 3)})
            shutil.rmtree(repo / name)
            await asyncio.sleep(1.0)
    return out


async def churn(url: str, repo: Path, extra: Path, models: int, rate: float, cycles: int) -> dict:
    paths = [f"/v1/models/m{i % models:02d}/classes/{(7 * i) % 1000}/detect" for i in range(4 * models)]
    record = {"sent": 0, "failed": []}
    stop = asyncio.Event()
    flow = asyncio.create_task(_open_loop(url, paths, _bodies(256, 5), rate, stop, record))
    await asyncio.sleep(3.0)
    events = await _load_unload(url, repo, extra, cycles)
    await asyncio.sleep(2.0)
    stop.set()
    await flow
    return {"rate_asked": rate, "sent": record["sent"], "seconds": round(record["seconds"], 1),
            "rate_sent": round(record["sent"] / record["seconds"], 1), "failed": len(record["failed"]),
            "failures": record["failed"][:10], "events": events}


def measure(work: Path, models: int, classes: int, requests: int, rounds: int, rate: float, cycles: int) -> dict:
    repo, extra = build(work, models, classes)
    head_bytes = classes * (DIM + 1) * 4
    bodies = _bodies(requests)
    many = slc_server(None, work, "many", work / "data-many", env={"SLC_MODEL_REPOSITORY": str(repo)})
    one = slc_server(repo / "m00", work, "one", work / "data-one")
    with many, one:
        many.wait_ready(), one.wait_ready()
        many_paths = [f"/v1/models/m{i % models:02d}/classes/{(7 * i) % classes}/detect" for i in range(4 * models)]
        one_paths = [f"/v1/classes/{(7 * i) % classes}/detect" for i in range(4 * models)]
        default_paths = [f"/v1/classes/{(7 * i) % classes}/detect" for i in range(4 * models)]
        targets = {"many": (many.url, many_paths), "one": (one.url, one_paths),
                   "many_default_route": (many.url, default_paths)}
        latencies(targets, bodies[:200])  # warm
        lat = {name: [] for name in targets}
        for _ in range(rounds):
            for name, values in latencies(targets, bodies).items():
                lat[name] += values
        memory = {"many": process_tree_memory(many.proc.pid), "one": process_tree_memory(one.proc.pid)}
        listing = httpx.get(many.url + "/v1/models").json()
        one.stop()
        churned = asyncio.run(churn(many.url, repo, extra, models, rate, cycles))
        memory["many_after_churn"] = process_tree_memory(many.proc.pid)
    p50 = {k: statistics.median(v) * 1e3 for k, v in lat.items()}
    budget = memory["one"]["rss"] + models * head_bytes
    return {"models": models, "classes": classes, "dim": DIM, "input_dim": INPUT_DIM, "head_bytes": head_bytes,
            "backbone_groups": len({m["backbone"]["sha256"] for m in listing["models"]}),
            "served": len(listing["models"]), "rss": {k: v["rss"] for k, v in memory.items()}, "memory": memory,
            "rss_budget": budget, "rss_ratio": memory["many"]["rss"] / budget,
            "detect_p50_ms": p50, "detect_p50_ratio": p50["many"] / p50["one"], "requests_per_round": requests,
            "rounds": rounds, "churn": churned, "machine": f"{platform.machine()}, {_cpus()} CPUs (shared), no GPU"}


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


def markdown(r: dict, command: str) -> str:
    mb = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    c = r["churn"]
    ok = lambda good: "met" if good else "**missed**"  # noqa: E731
    lines = [
        "# Many class-sets on one server", "",
        f"`{command}`", "",
        f"{r['models']} bundles of {r['classes']:,} classes each (d = {r['dim']}, synthetic, gaussian rows) sharing one "
        f"backbone graph (a synthetic MLP over {r['input_dim']:,}-value inputs, a 32×32×3 image flattened; "
        "`slc bundle synthetic --backbone-seed 0`), served by one `slc serve --model-repository`; against a server of "
        f"one of them. Machine: {r['machine']}, shared with other work while measured: read the ratios.", "",
        "| goal | figure | |", "|---|---|---|",
        f"| server RSS within 10% of one bundle plus the {r['models']} heads | {mb(r['rss']['many'])} vs "
        f"{mb(r['rss']['one'])} + {r['models']} × {mb(r['head_bytes'])} = {mb(r['rss_budget'])}: "
        f"{r['rss_ratio']:.3f}× | {ok(r['rss_ratio'] <= 1.10)} |",
        f"| detect p50 within 10% of a one-bundle server | {r['detect_p50_ms']['many']:.3f} ms vs "
        f"{r['detect_p50_ms']['one']:.3f} ms: {r['detect_p50_ratio']:.3f}× | {ok(r['detect_p50_ratio'] <= 1.10)} |",
        f"| load and unload of a bundle while {r['churn']['rate_asked']:g} req/s flow to the others: 0 failed | "
        f"{c['failed']} failed of {c['sent']:,} ({c['rate_sent']:g} req/s sent over {c['seconds']:g} s), "
        f"{len(c['events'])} load/unload cycles | {ok(c['failed'] == 0 and c['rate_sent'] >= 0.95 * c['rate_asked'])} |",
        "",
        f"Backbone groups on the many-model server: {r['backbone_groups']} (one session, one batch lane for all "
        f"{r['served']} models). Detect p50: {r['rounds']} rounds of {r['requests_per_round']} requests one at a time "
        "(plain sockets, one kept-alive connection per server), the servers taken in turn 50 requests each; the "
        f"many-model server's requests spread over its {r['models']} models (`/v1/models/mNN/classes/j/detect`). The "
        f"same server through today's route (its default model): {r['detect_p50_ms']['many_default_route']:.3f} ms.",
        "",
        "| load / unload cycle | load | detect on it | unload |", "|---|---|---|---|",
        *[f"| {e['model']} | {e['load_status']} in {e['load_s']} s | {e['asked_status']} | {e['unload_status']} in "
          f"{e['unload_s']} s |" for e in c["events"]],
        "", f"RSS after the cycles: {mb(r['rss']['many_after_churn'])}.", "",
    ]
    return "\n".join(lines)
