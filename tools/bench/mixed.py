"""`slc bench mixed`: detect on one connection while full-softmax clients keep the head busy.

A detect needs one backbone call and one row of the head; a full softmax reads all D rows. On a
server that computes one batch at a time, a detect that arrives during a pass waits for it (and
for the pass queued after it). With two lanes (SLC_CONCURRENT_BATCHES=2, the default) the detect
is batched apart and starts beside the running pass. Two servers on the same bundle, one per
setting, are measured in alternating rounds: detect alone, then detect beside the softmax load.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from tools import loadtest as lt
from tools.bench.server import ServerProcess, free_port
from tools.loadtest.stats import latency_summary
from tools.report import md_table

SETTINGS = {"one batch at a time": "1", "two lanes": "2"}  # SLC_CONCURRENT_BATCHES of each server


def _server(bundle: Path, work: Path, lanes: str) -> ServerProcess:
    import sys

    port = free_port()
    argv = [sys.executable, "-m", "slc", "serve", str(bundle), "--port", str(port), "--data-dir", str(work / f"data{lanes}")]
    return ServerProcess(argv, port, work / f"server-lanes{lanes}.log",
                         env={"SLC_LOG_LEVEL": "warning", "SLC_CONCURRENT_BATCHES": lanes})


def _detect_latencies(url: str, duration: float) -> tuple[np.ndarray, float]:
    """(latencies in seconds of the successful detects, their req/s) on one connection."""
    res = lt.run_loadtest(url, ["detect"], concurrency=1, duration=duration, warmup=0.3)
    a = res.samples.arrays()
    ok = a["measured"] & (a["status"] == 200)
    return (a["done"] - a["scheduled"])[ok], res.report["endpoints"]["detect"]["goodput_rps"]


def _beside_softmax(url: str, duration: float, softmax_concurrency: int) -> tuple[np.ndarray, float, float]:
    """Detect latencies while `softmax_concurrency` softmax clients run (they start first and end last)."""
    load: dict = {}

    def softmax() -> None:
        rep = lt.run_loadtest(url, ["softmax"], concurrency=softmax_concurrency, duration=duration + 2.0, warmup=0.5)
        load["rps"] = rep.report["endpoints"]["softmax"]["goodput_rps"]

    bg = threading.Thread(target=softmax, name="softmax-load")
    bg.start()
    threading.Event().wait(1.5)  # the softmax clients are in full swing
    lat, rps = _detect_latencies(url, duration)
    bg.join()
    return lat, rps, load.get("rps", 0.0)


def run_mixed(bundle: Path, work: Path, duration: float = 5.0, softmax_concurrency: int = 16, rounds: int = 2,
              progress: Optional[Callable[[str], None]] = None) -> dict:
    """Both servers up; per round and server: detect alone, then detect beside the softmax load."""
    servers = {name: _server(bundle, work, lanes) for name, lanes in SETTINGS.items()}
    got = {name: {"alone": [], "beside": [], "alone_rps": [], "beside_rps": [], "softmax_rps": []} for name in servers}
    try:
        for srv in servers.values():
            srv.wait_ready()
        for r in range(rounds):
            for name, srv in servers.items():
                if progress:
                    progress(f"round {r + 1}/{rounds}: {name}")
                lat, rps = _detect_latencies(srv.url, duration)
                got[name]["alone"].append(lat)
                got[name]["alone_rps"].append(rps)
                lat, rps, sm = _beside_softmax(srv.url, duration, softmax_concurrency)
                got[name]["beside"].append(lat)
                got[name]["beside_rps"].append(rps)
                got[name]["softmax_rps"].append(sm)
    finally:
        for srv in servers.values():
            srv.stop()
    out = {"duration_s": duration, "softmax_concurrency": softmax_concurrency, "rounds": rounds, "servers": {}}
    for name, g in got.items():
        out["servers"][name] = {
            "concurrent_batches": int(SETTINGS[name]),
            "detect_alone": {**latency_summary(np.concatenate(g["alone"])), "rps": float(np.mean(g["alone_rps"]))},
            "detect_beside_softmax": {**latency_summary(np.concatenate(g["beside"])), "rps": float(np.mean(g["beside_rps"]))},
            "softmax_rps": float(np.mean(g["softmax_rps"])),
        }
    return out


def mixed_markdown(r: dict, command: str, classes: int) -> str:
    L = [f"# Detect beside full-softmax load (D = {classes:,})", "", f"Command: `{command}`  ",
         f"One connection asks detect while {r['softmax_concurrency']} connections ask the full softmax; "
         f"{r['rounds']} rounds of {r['duration_s']:g} s per server, the two servers alternating. "
         "Latency in ms from the request's send time.", "",
         md_table(["server", "detect alone p50 / p99", "detect beside softmax p50 / p99", "detect req/s beside softmax",
                   "softmax req/s"],
                  [[f"{name} (`SLC_CONCURRENT_BATCHES={s['concurrent_batches']}`)", f"{a['p50']:.2f} / {a['p99']:.2f}",
                    f"{b['p50']:.2f} / {b['p99']:.2f}", f"{b['rps']:.0f}", f"{s['softmax_rps']:.0f}"]
                   for name, s in r["servers"].items() for a, b in [(s["detect_alone"], s["detect_beside_softmax"])]],
                  "lrrrr")]
    return "\n".join(L) + "\n"
