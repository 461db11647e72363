"""`slc bench soak`: mixed load on a real `slc serve` with kill -9 during gallery writes.

Phase 1 (kills): detect / softmax / top-k load from the load client while one writer upserts
gallery items one by one; every few seconds the server is SIGKILLed in the middle of the writes,
restarted on the same data directory, and every write it had acknowledged (201) is looked up.
Phase 2 (steady): the same load without kills; resident memory and open file descriptors are
read after warm-up and at the end. Reports acknowledged writes lost (must be 0), memory growth,
descriptors, and every error by status.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

from tools import loadtest as lt
from tools.bench.server import ServerProcess, free_port, process_tree_memory
from tools.report import md_table

log = logging.getLogger(__name__)
ENDPOINTS = ["detect", "softmax", "topk", "topk_index"]


class Writer(threading.Thread):
    """Upserts items w-0, w-1, ... one request each; remembers which ones were acknowledged."""

    def __init__(self, url_of, input_size: int):
        super().__init__(daemon=True)
        self.url_of, self.input_size = url_of, input_size
        self.acked: list[str] = []
        self.statuses: dict[str, int] = {}
        self.stop = threading.Event()
        self.n = 0

    def run(self) -> None:
        while not self.stop.is_set():
            item_id = f"w-{self.n}"
            self.n += 1
            body = json.dumps({"items": [{"id": item_id, "input": [0.01 * (self.n % 97)] * self.input_size,
                                          "metadata": {"n": self.n}}]}).encode()
            req = urllib.request.Request(self.url_of() + "/v1/gallery/items", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    status = r.status
            except urllib.error.HTTPError as exc:
                status = exc.code
            except OSError:  # the server is being killed or restarted
                status = 0
                time.sleep(0.05)
            key = str(status) if status else "transport"
            self.statuses[key] = self.statuses.get(key, 0) + 1
            if status == 201:
                self.acked.append(item_id)


def _missing(url: str, ids: list[str]) -> list[str]:
    missing = []
    for item_id in ids:
        try:
            with urllib.request.urlopen(f"{url}/v1/gallery/items/{item_id}", timeout=10) as r:
                if r.status != 200:
                    missing.append(item_id)
        except urllib.error.HTTPError:
            missing.append(item_id)
    return missing


def _fds(pid: int) -> int:
    try:
        return len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except OSError:
        return -1


class _Server:
    """The server under test, restartable on one port and data directory."""

    def __init__(self, bundle: Path, data_dir: Path, log_dir: Path, argv0: list[str]):
        self.bundle, self.data_dir, self.log_dir, self.argv0 = bundle, data_dir, log_dir, argv0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[ServerProcess] = None
        self.lives = 0

    def start(self) -> float:
        self.lives += 1
        argv = [*self.argv0, "serve", str(self.bundle), "--port", str(self.port), "--data-dir", str(self.data_dir)]
        self.proc = ServerProcess(argv, self.port, self.log_dir / f"soak-{self.lives}.log",
                                  env={"SLC_LOG_LEVEL": "warning"})
        return self.proc.wait_ready(300)

    def kill(self) -> None:
        self.proc.proc.kill()
        self.proc.proc.wait(30)
        self.proc.stop()


def _load(url: str, seconds: float, concurrency: int) -> dict:
    res = lt.run_loadtest(url, ENDPOINTS, concurrency=concurrency, duration=seconds, warmup=0.0,
                          interleave="request")
    return {name: {"ok": ep["ok"], "requests": ep["requests"], "errors": ep["errors"]}
            for name, ep in res.report["endpoints"].items()}


def _merge(total: dict, part: dict) -> None:
    for name, ep in part.items():
        t = total.setdefault(name, {"ok": 0, "requests": 0, "errors": {}})
        t["ok"] += ep["ok"]
        t["requests"] += ep["requests"]
        for k, v in ep["errors"].items():
            t["errors"][k] = t["errors"].get(k, 0) + v


def run_soak(bundle: Path, input_size: int, work: Path, duration: float, kills: int, concurrency: int,
             argv0: list[str]) -> dict:
    """Phase 1 with `kills` kill -9 rounds over duration/2, phase 2 steady over duration/2."""
    srv = _Server(bundle, work / "data", work, argv0)
    srv.start()
    writer = Writer(lambda: srv.url, input_size)
    writer.start()
    load: dict = {}
    lost_after_restart, restarts = [], []
    round_s = duration / 2 / max(1, kills)
    for k in range(kills):
        _merge(load, _load(srv.url, round_s, concurrency))  # killed at the end of the round, writes in flight
        acked_before = list(writer.acked)
        srv.kill()
        ready = srv.start()
        missing = _missing(srv.url, acked_before)
        lost_after_restart.append(len(missing))
        restarts.append(round(ready, 2))
        log.info("kill %d/%d: %d acknowledged writes checked, %d lost, ready again in %.1f s",
                 k + 1, kills, len(acked_before), len(missing), ready)
    warm = max(2.0, duration / 10)
    _merge(load, _load(srv.url, warm, concurrency))
    mem0, fd0 = process_tree_memory(srv.proc.proc.pid)["rss"], _fds(srv.proc.proc.pid)
    _merge(load, _load(srv.url, max(1.0, duration / 2 - warm), concurrency))
    mem1, fd1 = process_tree_memory(srv.proc.proc.pid)["rss"], _fds(srv.proc.proc.pid)
    writer.stop.set()
    writer.join(15)
    final_missing = _missing(srv.url, list(writer.acked))
    srv.proc.stop()
    return {"duration_s": duration, "kills": kills, "concurrency": concurrency, "ready_after_kill_s": restarts,
            "writes": {"acknowledged": len(writer.acked), "attempted": writer.n, "statuses": writer.statuses,
                       "lost_after_each_restart": lost_after_restart, "lost_at_end": len(final_missing)},
            "memory": {"rss_after_warmup": mem0, "rss_end": mem1, "growth_bytes": mem1 - mem0},
            "fds": {"after_warmup": fd0, "end": fd1}, "load": load}


def soak_markdown(res: dict, command: str) -> str:
    w, m = res["writes"], res["memory"]
    lines = [f"# Soak: mixed load with kill -9 during writes ({res['duration_s']:g} s)", "",
             f"Command: `{command}`", "",
             f"- acknowledged gallery writes lost: **{w['lost_at_end']}** of {w['acknowledged']} "
             f"(after each restart: {w['lost_after_each_restart']}); {w['attempted']} writes attempted, "
             f"statuses {w['statuses']} (`transport`: the server was down; `503`: it was restarting and not "
             "ready yet; neither is an acknowledgement)",
             f"- kill -9 rounds: {res['kills']}; ready again after {res['ready_after_kill_s']} s",
             f"- memory of the last life, after warm-up → end: {m['rss_after_warmup'] / 2**20:.1f} → "
             f"{m['rss_end'] / 2**20:.1f} MiB ({m['growth_bytes'] / 2**20:+.1f} MiB)",
             f"- open file descriptors after warm-up → end: {res['fds']['after_warmup']} → {res['fds']['end']}", "",
             md_table(["endpoint", "requests", "ok", "errors"],
                      [[name, ep["requests"], ep["ok"], ", ".join(f"{k}: {v}" for k, v in sorted(ep["errors"].items())) or "none"]
                       for name, ep in res["load"].items()], "lrrl")]
    lines += ["", "Load errors of kind `transport` fall in the kill windows (connections refused while the "
              "server restarts); every HTTP answer is counted by status.", ""]
    return "\n".join(lines)
