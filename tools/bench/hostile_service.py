"""`slc bench hostile`, the gallery and gRPC cases (issue 30): attacks that hold the server rather
than send one bad body. Each case runs while three probes loop: a health probe, a valid detect
request and the gallery list (GET /v1/gallery); it records the attack's answers, the slowest of
them, each probe's worst latency, and the server's resident memory during the attack (peak of
samples) and after it (3 s after the attacker left) against before.

Goal (issue 30): an answer within 0.5 s (gRPC) or 2 s (gallery), health under 100 ms, detect and
the gallery list within 1 s during the attack (the frozen-database case excepted for the gallery
routes: there only they may slow), RSS back within 300 MB after it.
"""
from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import orjson

from tools.bench import h2_attack
from tools.bench.server import timed_request
from tools.report import md_table, write_json

MB = 1 << 20


def _rss(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Probes:
    """Health, detect and gallery-list requests in loops (one thread each) while an attack runs;
    the worst latency of each and the server's peak RSS over the samples."""

    def __init__(self, url: str, pid: int, input_size: int):
        detect = orjson.dumps({"inputs": [[0.5] * input_size]})
        self.calls = {"health": lambda: timed_request(url + "/v1/health/live"),
                      "detect": lambda: timed_request(url + "/v1/classes/3/detect", detect),
                      "gallery": lambda: timed_request(url + "/v1/gallery")}
        self.worst = {k: 0.0 for k in self.calls}
        self.failed: Counter = Counter()
        self.pid, self.peak = pid, _rss(pid)
        self._busy = threading.Event()
        self._threads: list[threading.Thread] = []

    def _loop(self, name: str) -> None:
        while self._busy.is_set():
            status, _, seconds = self.calls[name]()
            self.worst[name] = max(self.worst[name], seconds)
            if status != 200:
                self.failed[f"{name} {status}"] += 1
            if name == "health":
                self.peak = max(self.peak, _rss(self.pid))
            time.sleep(0.01)

    def __enter__(self):
        self._busy.set()
        self._threads = [threading.Thread(target=self._loop, args=(n,), daemon=True) for n in self.calls]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._busy.clear()
        for t in self._threads:
            t.join(180)


def run_case(name: str, attack: Callable[[], tuple[dict, float]], url: str, pid: int, input_size: int) -> dict:
    """One case: attack() -> ({answer: count}, slowest answer s) while the probes run."""
    before = _rss(pid)
    with Probes(url, pid, input_size) as probes:
        time.sleep(0.3)  # the probes' own first answers
        answers, slowest = attack()
        time.sleep(0.5)
    time.sleep(3.0)  # the attacker is gone: buffers freed, pages handed back
    return {"case": name, "answers": answers, "seconds": slowest,
            "worst_health_ms": probes.worst["health"] * 1e3, "worst_detect_ms": probes.worst["detect"] * 1e3,
            "worst_gallery_ms": probes.worst["gallery"] * 1e3, "probe_failures": dict(probes.failed),
            "rss_during_mb": probes.peak - before, "rss_after_mb": _rss(pid) - before}


# ----------------------------------------------------------------------------- gallery cases
ZEROS = 4_190_000  # an 8 MiB metadata array (the red team's)


def _metadata_item(values: int) -> bytes:
    return orjson.dumps({"items": [{"id": "hostile", "input": [0.25] * 64, "metadata": {"z": [0] * values}}]})


def _concurrent(calls: list[Callable[[], tuple[int, str, float]]]) -> tuple[dict, float]:
    with ThreadPoolExecutor(len(calls)) as pool:
        results = list(pool.map(lambda f: f(), calls))
    return dict(Counter(f"{s} {c}".strip() for s, c, _ in results)), max(t for _, _, t in results)


def gallery_cases(url: str, input_size: int, data_dir: Path) -> list[tuple[str, Callable]]:
    """(name, attack) of the gallery cases."""
    items = url + "/v1/gallery/items"

    def write(body: bytes) -> Callable:
        return lambda: timed_request(items, body)

    def read_back() -> tuple[dict, float]:
        """The largest metadata the server takes (the 8 MiB one where it is taken), read 8 times at once."""
        for values in (ZEROS, 100_000):
            if timed_request(items, _metadata_item(values).replace(b'"hostile"', b'"big"'))[0] == 201:
                break
        return _concurrent([lambda: timed_request(items + "/big")] * 8)

    def frozen_database() -> tuple[dict, float]:
        """The SQLite file locked by another process for 5 s (a frozen database): 8 writes wait on it."""
        import sqlite3

        db = sqlite3.connect(data_dir / "gallery.sqlite3", timeout=30, check_same_thread=False)
        db.execute("BEGIN EXCLUSIVE")
        timer = threading.Timer(5.0, db.rollback)
        timer.start()
        try:
            return _concurrent([write(_metadata_item(10).replace(b'"hostile"', f'"f{i}"'.encode())) for i in range(8)])
        finally:
            timer.join()
            db.close()

    return [("gallery metadata 8 MiB", lambda: _concurrent([write(_metadata_item(ZEROS))])),
            ("gallery metadata 8 MiB x4", lambda: _concurrent([write(_metadata_item(ZEROS))] * 4)),
            ("gallery read back x8", read_back),
            ("gallery frozen database 5 s, 8 writes", frozen_database)]


# ----------------------------------------------------------------------------- gRPC cases
def _streams(host: str, port: int, streams: int, announce: int, send: int, per_connection: int) -> tuple[dict, float]:
    """Stalled calls held 3 s, then the attacker leaves. Answers: calls the server ended (refused,
    timed out) before the attacker left, and those still open."""
    t0 = time.perf_counter()
    conns = h2_attack.open_stalled_streams(host, port, streams, announce, send, per_connection)
    sent = time.perf_counter() - t0
    time.sleep(3.0)
    still_open = h2_attack.open_streams(conns)
    h2_attack.close_all(conns)
    return {"ended by the server": streams - still_open, "held until the client left": still_open}, sent


def _infer_once(host: str, port: int, request) -> tuple[dict, float]:
    import grpc
    from tritonclient.grpc import service_pb2 as pb

    with grpc.insecure_channel(f"{host}:{port}") as channel:
        call = channel.unary_unary(h2_attack.INFER, request_serializer=pb.ModelInferRequest.SerializeToString,
                                   response_deserializer=pb.ModelInferResponse.FromString)
        t0 = time.perf_counter()
        try:
            call(request, timeout=60)
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
        return {code: 1}, time.perf_counter() - t0


def grpc_cases(host: str, port: int, model: str, input_size: int) -> list[tuple[str, Callable]]:
    """(name, attack) of the gRPC cases."""
    from tritonclient.grpc import service_pb2 as pb

    typed = pb.ModelInferRequest(model_name=model)
    typed.inputs.add(name="input", datatype="FP32", shape=[1, input_size]).contents.fp32_contents.extend(
        [0.0] * 2_000_000)
    shape = pb.ModelInferRequest(model_name=model)
    shape.inputs.add(name="input", datatype="FP32", shape=[0, 2**62])
    shape.raw_input_contents.append(b"")
    big = 8 * MB - 64
    valid = 256 * (8 * input_size + 16) + 65536 - 64  # the largest valid message (default max_inputs)
    return [("gRPC 100 streams announcing 8 MiB, 7.5 MB sent", lambda: _streams(host, port, 100, big, 7_500_000, 10)),
            ("gRPC 400 streams announcing 8 MiB, 7.5 MB sent", lambda: _streams(host, port, 400, big, 7_500_000, 10)),
            (f"gRPC 400 streams announcing {valid // 1000} kB (a valid size), all but 1 kB sent",
             lambda: _streams(host, port, 400, valid, valid - 1000, 10)),
            ("gRPC 20k calls sending only headers", lambda: _streams(host, port, 20_000, 0, 0, 100)),
            ("gRPC 2 M typed FP32 values, wrong count", lambda: _infer_once(host, port, typed)),
            ("gRPC shape [0, 2^62]", lambda: _infer_once(host, port, shape))]


def service_rows(srv, data_dir: Path, input_size: int) -> dict:
    """Every gallery and gRPC case against a running ServerProcess (gRPC ones when it serves gRPC),
    with the load average (1, 5, 15 min) when they started."""
    import os

    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    cases = gallery_cases(srv.url, input_size, data_dir)
    if getattr(srv, "grpc_port", None):
        with urllib.request.urlopen(srv.url + "/v1/model", timeout=30) as r:
            model = orjson.loads(r.read())["name"]
        cases += grpc_cases("127.0.0.1", srv.grpc_port, model, input_size)
    rows = [run_case(name, attack, srv.url, srv.proc.pid, input_size) for name, attack in cases]
    return {"load_average": load, "rows": rows}


def service_markdown(result: dict) -> str:
    rows, load = result["rows"], result["load_average"]
    lines = ["", "## Gallery and gRPC attacks", "",
             "Each attack runs while a health probe, a valid detect request and `GET /v1/gallery` loop; RSS is "
             "the server's resident memory against before the attack: its peak during it, and 3 s after the "
             f"attacker left. Load average when run: {load}.",
             "Goal: answers within 0.5 s (gRPC) / 2 s (gallery), health < 100 ms, detect and the gallery list "
             "< 1 s (gallery routes may slow while the database is frozen), RSS after < 300 MB.", ""]
    cells = []
    for r in rows:
        frozen = "frozen" in r["case"]
        stalled = "streams" in r["case"] or "headers" in r["case"]
        limit = 0.5 if r["case"].startswith("gRPC") else 2.0
        answered = stalled or frozen or r["seconds"] <= limit  # (writes to a frozen database wait for it)
        answered = answered and not any(a[:1] == "5" or a in ("INTERNAL", "UNKNOWN") for a in r["answers"])  # no bug
        met = (answered and r["worst_health_ms"] < 100 and r["worst_detect_ms"] < 1000
               and (frozen or r["worst_gallery_ms"] < 1000) and r["rss_after_mb"] < 300 and not r["probe_failures"])
        answers = ", ".join(f"{n}× {a}" for a, n in r["answers"].items())
        if r["probe_failures"]:
            answers += "; probes failed: " + ", ".join(f"{n}× {k}" for k, n in r["probe_failures"].items())
        seconds = "—" if stalled else f"{r['seconds']:.3f}"  # stalled calls are held, not answered
        cells.append([r["case"], answers, seconds, f"{r['worst_health_ms']:.1f}", f"{r['worst_detect_ms']:.1f}",
                      f"{r['worst_gallery_ms']:.1f}", f"{r['rss_during_mb']:.0f}", f"{r['rss_after_mb']:.0f}",
                      "yes" if met else "**no**"])
    lines.append(md_table(["attack", "answers", "slowest answer s", "worst health ms", "worst detect ms",
                           "worst gallery list ms", "RSS during +MB", "RSS after +MB", "goal met"], cells, "llrrrrrrl"))
    return "\n".join(lines) + "\n"


def main() -> None:
    """`python -m tools.bench.hostile_service [--pythonpath DIR]`: the gallery and gRPC cases alone,
    against `slc serve` of this checkout or of the one at DIR (e.g. the code before a fix)."""
    import argparse
    import sys
    import tempfile

    from tools.bench.run import INPUT_DIM, cached_bundle
    from tools.bench.server import ServerProcess, free_port

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--pythonpath", help="serve from this checkout (its serving/ and slc/) instead of this one")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="slc-hostile-service-") as tmp:
        port, grpc_port = free_port(), free_port()
        argv = [sys.executable] + (["-P"] if args.pythonpath else []) + [  # -P: the other checkout, not the cwd's
            "-m", "slc", "serve", str(cached_bundle(1000, 64)), "--port", str(port), "--data-dir", f"{tmp}/data",
            "--grpc-port", str(grpc_port)]
        env = {"SLC_LOG_LEVEL": "warning", **({"PYTHONPATH": args.pythonpath} if args.pythonpath else {})}
        with ServerProcess(argv, port, Path(tmp) / "server.log", env=env) as srv:
            srv.grpc_port = grpc_port
            srv.wait_ready(300)
            result = service_rows(srv, Path(tmp) / "data", INPUT_DIM)
    if args.json:
        write_json(Path(args.json), result)
    command = "python -m tools.bench.hostile_service" + (f" --pythonpath {args.pythonpath}" if args.pythonpath else "")
    print(f"Command: `{command}`\n" + service_markdown(result))


if __name__ == "__main__":
    main()
