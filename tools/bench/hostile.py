"""`slc bench hostile`: hostile bodies up to the size limit against a real server, each measured:
time to its answer, the server's peak-memory growth, and the worst latency of a health probe sent
throughout. Goal: every body answered within 0.5 s, < 100 MB extra, probe under 100 ms."""
from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import orjson

from tools.bench.server import ServerProcess
from tools.report import md_table

MB = 1 << 20


def hostile_body(kind: str, size: int, input_size: int) -> tuple[str, bytes]:
    """(path, body of about `size` bytes) of one kind of hostile request."""
    n = size // 7
    if kind == "strings":  # the right shape, every value a long string
        long = "x" * max(1, size // (200 * input_size))
        return "/v1/classes/3/detect", orjson.dumps({"inputs": [[long] * input_size] * 200})
    if kind == "objects":  # the right shape, every value an object
        obj = {f"k{i}": i for i in range(max(1, size // (200 * input_size * 12)))}
        return "/v1/classes/3/detect", orjson.dumps({"inputs": [[obj] * input_size] * 200})
    if kind == "flat_strings":  # one example of a million strings
        return "/v1/classes/3/detect", orjson.dumps({"inputs": [["abcd"] * n]})
    if kind == "nested":
        return "/v1/topk", orjson.dumps({"inputs": [[[[0]]] * (n // 2)]})
    if kind == "many_examples":
        return "/v1/classes/3/softmax", orjson.dumps({"inputs": [[0] * input_size] * (size // (3 * input_size))})
    if kind == "one_huge_example":
        return "/v1/classes/3/detect", orjson.dumps({"inputs": [[0.5] * (size // 5)]})
    if kind == "bools_in_numbers":
        return "/v1/classes/3/detect", orjson.dumps({"inputs": [[0.5] * (input_size - 1) + [True]] * 256})
    if kind == "gallery_strings":
        return "/v1/gallery/items", orjson.dumps({"items": [{"id": "a", "input": ["x"] * n}]})
    raise KeyError(kind)


KINDS = ("strings", "objects", "flat_strings", "nested", "many_examples", "one_huge_example", "bools_in_numbers",
         "gallery_strings")


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _probe_while(url: str, busy: threading.Event, worst: list) -> None:
    while busy.is_set():
        t0 = time.perf_counter()
        urllib.request.urlopen(url + "/v1/health/live", timeout=30).read()
        worst[0] = max(worst[0], time.perf_counter() - t0)
        time.sleep(0.005)


def measure(srv: ServerProcess, kind: str, size: int, input_size: int) -> dict:
    path, body = hostile_body(kind, size, input_size)
    hwm0 = _peak_rss(srv.proc.pid)
    busy, worst = threading.Event(), [0.0]
    busy.set()
    prober = threading.Thread(target=_probe_while, args=(srv.url, busy, worst), daemon=True)
    prober.start()
    req = urllib.request.Request(srv.url + path, data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, answer = r.status, r.read()
    except urllib.error.HTTPError as exc:
        status, answer = exc.code, exc.read()
    elapsed = time.perf_counter() - t0
    busy.clear()
    prober.join(30)
    code = orjson.loads(answer).get("error", {}).get("code") if answer[:1] == b"{" else None
    return {"kind": kind, "bytes": len(body), "status": status, "code": code, "seconds": elapsed,
            "peak_rss_growth_mb": (_peak_rss(srv.proc.pid) - hwm0) / MB, "worst_probe_ms": worst[0] * 1e3}


def hostile_markdown(rows: list[dict], command: str) -> str:
    lines = ["# Hostile bodies up to the size limit", "", f"Command: `{command}`", "",
             "Each body is sent once to a fresh-enough server while a health probe runs in a loop; peak-RSS "
             "growth is the server's VmHWM after minus before (a body that raises the peak costs that much).",
             "Goal: answered within 0.5 s, < 100 MB extra, health probe < 100 ms.", "",
             md_table(["body", "size", "answer", "seconds", "peak RSS growth MB", "worst probe ms", "goal met"],
                      [[r["kind"], f"{r['bytes'] / MB:.1f} MB", f"{r['status']} {r['code']}", f"{r['seconds']:.3f}",
                        f"{r['peak_rss_growth_mb']:.1f}", f"{r['worst_probe_ms']:.1f}",
                        "yes" if r["seconds"] <= 0.5 and r["peak_rss_growth_mb"] < 100 and r["worst_probe_ms"] < 100
                        else "**no**"] for r in rows], "lrlrrrl")]
    return "\n".join(lines) + "\n"
