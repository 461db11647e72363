"""`slc bench scale`: single-logit against full-softmax serving as the number of classes D grows.

For each D: a cached synthetic bundle, a real `slc serve` subprocess, then
- closed loop (concurrency 8) over live, detect, softmax, topk exact, topk index, rotated in
  1 s blocks so that every endpoint sees the same drift but owns its throughput;
- one connection, endpoints interleaved per request (latency without queueing);
- recall@10 of topk index against topk exact on the same inputs (over HTTP);
- the server's resident memory against the head's size;
- the head alone in numpy (one logit vs all D logits, per input and per batch of 64);
- the plain torch peer (serving/torch_peer.py) on its softmax route, same loads.
Writes OUT/scale.json, scale.md, scale.png. Never imports torch (the peer runs in a subprocess).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from serving import loadtest as lt

INPUT_DIM = 64
BLOCK_S = 2.0
ROTATION = ["live", "detect", "softmax", "topk_exact", "topk_index"]
SINGLE = ["detect", "softmax", "topk_exact", "topk_index"]
READY_TIMEOUT_S = 1800.0


def bench_home() -> Path:
    return Path(os.environ.get("SLC_HOME") or Path.home() / ".cache" / "slc") / "bench"


SYNTHETIC_ROWS = "clustered"  # like trained heads; "gaussian" is the index worst case


def synthetic_builder_version() -> str:
    """A short hash of trainer/synthetic.py: a changed builder never reuses bundles of the old one."""
    import importlib.util

    spec = importlib.util.find_spec("trainer.synthetic")  # located, not imported
    source = Path(spec.origin).read_bytes() if spec is not None and spec.origin else b""
    return hashlib.sha256(source).hexdigest()[:8]


def cached_bundle(classes: int, dim: int, seed: int = 0, rows: str = SYNTHETIC_ROWS) -> Path:
    """Build (once) the synthetic bundle for D = classes; built into a temp dir, then renamed.

    The cache key holds everything the rows depend on: D, d, input size, seed, the rows kind
    and the builder's version (stale bundles of another kind or builder are never reused).
    """
    path = bench_home() / f"synthetic-D{classes}-d{dim}-i{INPUT_DIM}-s{seed}-{rows}-b{synthetic_builder_version()}"
    manifest = path / "manifest.json"
    if manifest.exists():
        try:
            if json.loads(manifest.read_text()).get("training", {}).get("rows") == rows:
                return path
        except (OSError, ValueError):
            pass
        _log(f"{path.name}: rows kind does not match {rows!r}, rebuilding")
    from trainer.synthetic import build_synthetic_bundle  # numpy + onnx only, no torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    t0 = time.perf_counter()
    build_synthetic_bundle(classes=classes, dim=dim, input_dim=INPUT_DIM, seed=seed, out=tmp, rows=rows)
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    _log(f"built {path.name} in {time.perf_counter() - t0:.1f} s")
    return path


_T0 = time.perf_counter()


def _log(msg: str) -> None:
    sys.stderr.write(f"[bench {time.perf_counter() - _T0:7.1f}s] {msg}\n")
    sys.stderr.flush()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server in a subprocess; ready when GET /v1/health/ready answers 200."""

    def __init__(self, argv: list[str], port: int, log_path: Path, env: Optional[dict] = None):
        self.port, self.log_path = port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self.started = time.perf_counter()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> float:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/v1/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - self.started
            except OSError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def process_tree_memory(pid: int) -> dict:
    """Resident memory (VmRSS) and its peak (VmHWM) of a process and its descendants, in bytes."""
    try:
        import psutil  # noqa: F401  (optional)

        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
        rss = sum(p.memory_info().rss for p in procs)
        return {"rss": rss, "hwm": None, "processes": len(procs), "source": "psutil"}
    except ImportError:
        pass
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    todo, pids = [pid], []
    while todo:
        p = todo.pop()
        pids.append(p)
        todo.extend(children.get(p, []))
    rss = hwm = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    hwm += int(line.split()[1]) * 1024
        except OSError:
            continue
    return {"rss": rss, "hwm": hwm, "processes": len(pids), "source": "/proc/PID/status"}


def _post(url: str, path: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def topk_recall(url: str, n: int = 64, k: int = 10, seed: int = 1) -> dict:
    """recall@k of mode=index against mode=exact on the same random inputs, over HTTP."""
    x = np.random.default_rng(seed).standard_normal((n, INPUT_DIM)).astype(np.float32).round(4).tolist()
    got = {}
    for mode in ("exact", "index"):
        chunks = []
        for start in range(0, n, 32):
            res = _post(url, "/v1/topk", {"inputs": x[start:start + 32], "k": k, "mode": mode})
            chunks.extend(res["results"])
        got[mode] = [[e["class_id"] for e in row] for row in chunks]
    hits = [len(set(a) & set(b)) / len(a) for a, b in zip(got["exact"], got["index"]) if a]
    return {"recall_at_k": float(np.mean(hits)), "k": k, "queries": n}


def _time_call(fn, min_time: float = 0.3, repeats: int = 5) -> float:
    """Median seconds per call over `repeats` rounds of at least `min_time` each."""
    fn()
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t0
        if dt >= min_time / repeats or n >= 1 << 20:
            break
        n *= 4
    rounds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t0) / n)
    return float(np.median(rounds))


def head_kernels(W: np.ndarray, b: np.ndarray, H: np.ndarray, ids: np.ndarray) -> dict:
    """The timed head computations: one logit per input (gathered row) vs all D logits.

    W [D, d], b [D], H [B, d] embeddings, ids [B] class ids. Each returns its logits.
    """
    h1, j = H[:1], int(ids[0])  # [1, d], the first query's class

    def softmax_batch():
        z = H @ W.T + b  # [B, D]
        z -= z.max(axis=1, keepdims=True)
        np.exp(z, out=z)
        return z / z.sum(axis=1, keepdims=True)

    return {
        "one_logit_single": lambda: np.float32(W[j] @ h1[0] + b[j]),  # scalar
        "one_logit_batch": lambda: np.einsum("nd,nd->n", W[ids], H) + b[ids],  # [B]
        "all_logits_single": lambda: h1 @ W.T + b,  # [1, D]
        "all_logits_batch": lambda: H @ W.T + b,  # [B, D]
        "softmax_batch": softmax_batch,  # [B, D]
    }


def head_alone(bundle: Path, batch: int = 64, seed: int = 0) -> dict:
    """The head in numpy without HTTP: one logit vs all D logits, microseconds per input."""
    W = np.load(bundle / "head_weight.npy", mmap_mode="r", allow_pickle=False)  # [D, d], mapped as the server does
    b = np.load(bundle / "head_bias.npy", allow_pickle=False)  # [D]
    D, d = W.shape
    rng = np.random.default_rng(seed)
    H = rng.standard_normal((batch, d)).astype(np.float32)
    H /= np.linalg.norm(H, axis=1, keepdims=True)  # [B, d]
    ids = rng.integers(0, D, batch)  # [B]
    t = {name: _time_call(fn) for name, fn in head_kernels(W, b, H, ids).items()}
    us = {
        "one_logit_per_input_single_us": t["one_logit_single"] * 1e6,
        "one_logit_per_input_batch64_us": t["one_logit_batch"] / batch * 1e6,
        "all_logits_per_input_single_us": t["all_logits_single"] * 1e6,
        "all_logits_per_input_batch64_us": t["all_logits_batch"] / batch * 1e6,
        "softmax_per_input_batch64_us": t["softmax_batch"] / batch * 1e6,
    }
    us["all_over_one_single"] = us["all_logits_per_input_single_us"] / us["one_logit_per_input_single_us"]
    us["all_over_one_batch64"] = us["all_logits_per_input_batch64_us"] / us["one_logit_per_input_batch64_us"]
    return us


def _summary(report: dict) -> dict:
    """The few numbers per endpoint the scale tables need."""
    out = {}
    for name, ep in report["endpoints"].items():
        lat = ep["latency_ms"]
        out[name] = {"rps": ep["goodput_rps"], "requests": ep["requests"], "errors": ep["errors"],
                     "p50_ms": lat.get("p50"), "p90_ms": lat.get("p90"), "p99_ms": lat.get("p99"),
                     "p99.9_ms": lat.get("p99.9"), "max_ms": lat.get("max"), "mean_ms": lat.get("mean")}
    return out


def measure_server(url: str, endpoints: Sequence[str], concurrency: int, duration: float, warmup: float = 2.0,
                   single: Optional[Sequence[str]] = None, class_: Optional[str] = None) -> dict:
    """Closed loop (block rotation) plus one-connection latency (per-request interleaving)."""
    closed = lt.run_loadtest(url, list(endpoints), class_=class_, concurrency=concurrency,
                             duration=duration * len(endpoints), warmup=warmup, interleave="block", block_s=BLOCK_S,
                             progress=True)
    one = lt.run_loadtest(url, list(single or endpoints), class_=class_, concurrency=1, duration=duration,
                          warmup=min(warmup, 1.0), interleave="request", progress=True)
    return {"closed": _summary(closed.report), "single_connection": _summary(one.report),
            "closed_report": closed.report, "single_report": one.report}


def _slc_server(bundle: Optional[Path], log_dir: Path, tag: str, data_dir: Path) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "trainer.cli", "serve"] + ([str(bundle)] if bundle else []) + [
        "--port", str(port), "--data-dir", str(data_dir)]
    return ServerProcess(argv, port, log_dir / f"server-{tag}.log", env={"SLC_LOG_LEVEL": "warning"})


def _peer_server(bundle: Path, log_dir: Path, tag: str) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "serving.torch_peer", str(bundle), "--port", str(port)]
    return ServerProcess(argv, port, log_dir / f"peer-{tag}.log")


def bench_one(D: int, dim: int, duration: float, concurrency: int, log_dir: Path, with_peer: bool) -> dict:
    bundle = cached_bundle(D, dim)
    head_bytes = D * dim * 4 + D * 4
    row: dict = {"classes": D, "dim": dim, "head_bytes": head_bytes, "bundle": str(bundle), "timings_s": {}}
    tick = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal tick
        now = time.perf_counter()
        row["timings_s"][name] = round(now - tick, 2)
        tick = now
    data_dir = bundle.with_name(bundle.name + "-data")
    with _slc_server(bundle, log_dir, f"D{D}", data_dir) as srv:
        row["ready_s"] = srv.wait_ready()
        _log(f"D={D}: server ready in {row['ready_s']:.1f} s")
        idle = process_tree_memory(srv.proc.pid)
        model = json.loads(urllib.request.urlopen(srv.url + "/v1/model", timeout=30).read())
        row["server_model"] = {k: model.get(k) for k in ("execution_providers", "providers", "softmax_impl", "index")
                               if k in model}
        phase("start")
        row["wrk_live"] = lt.wrk_ceiling(srv.url, concurrency, 3.0)
        m = measure_server(srv.url, ROTATION, concurrency, duration, single=SINGLE)
        row["slc"] = {"closed": m["closed"], "single_connection": m["single_connection"]}
        row["recall"] = topk_recall(srv.url)
        loaded = process_tree_memory(srv.proc.pid)
        phase("load")
        row["memory"] = {"idle_rss": idle["rss"], "loaded_rss": loaded["rss"], "hwm": loaded["hwm"],
                         "source": loaded["source"], "rss_over_head": loaded["rss"] / head_bytes}
        _log(f"D={D}: slc done; RSS {loaded['rss'] / 2**20:.0f} MiB, head {head_bytes / 2**20:.0f} MiB")
    row["head_alone"] = head_alone(bundle)
    phase("head_alone")
    if with_peer:
        with _peer_server(bundle, log_dir, f"D{D}") as peer:
            try:
                row["peer_ready_s"] = peer.wait_ready(600)
                pm = measure_server(peer.url, ["softmax"], concurrency, duration, single=["softmax"])
                row["peer"] = {"closed": pm["closed"], "single_connection": pm["single_connection"],
                               "memory_rss": process_tree_memory(peer.proc.pid)["rss"]}
            except (RuntimeError, TimeoutError) as exc:
                row["peer"] = {"error": str(exc)[-500:]}
        phase("peer")
    _log(f"D={D}: phases {row['timings_s']}")
    return row


def paired_detect(small: int, large: int, dim: int, concurrency: int, log_dir: Path, rounds: int = 4,
                  block: float = 2.0) -> dict:
    """detect at the smallest and the largest D with BOTH servers up, alternating blocks A B A B ...

    Sequential per-D runs minutes apart mostly measure the shared machine's drift; alternating
    short blocks between two live servers makes the ratio robust to it.
    """
    servers = {}
    try:
        for D in (small, large):
            bundle = cached_bundle(D, dim)
            servers[D] = _slc_server(bundle, log_dir, f"pair-D{D}", bundle.with_name(bundle.name + "-data"))
        for srv in servers.values():
            srv.wait_ready()
        for srv in servers.values():  # warm both
            lt.run_loadtest(srv.url, ["detect"], concurrency=concurrency, duration=0.5, warmup=1.0)
        counts = {D: 0 for D in servers}
        secs = {D: 0.0 for D in servers}
        lat: dict[int, list] = {D: [] for D in servers}
        for _ in range(rounds):
            for D, srv in servers.items():
                res = lt.run_loadtest(srv.url, ["detect"], concurrency=concurrency, duration=block, warmup=0.0)
                ep = res.report["endpoints"]["detect"]
                counts[D] += ep["ok"]
                secs[D] += res.report["window_s"]
                a = res.samples.arrays()
                ok = a["measured"] & (a["status"] == 200)
                lat[D].extend((a["done"] - a["scheduled"])[ok].tolist())
        out = {str(D): {"rps": counts[D] / secs[D], "requests": counts[D],
                        "p50_ms": lt.latency_summary(np.array(lat[D])).get("p50"),
                        "p99_ms": lt.latency_summary(np.array(lat[D])).get("p99")} for D in servers}
        out["large_over_small"] = out[str(large)]["rps"] / out[str(small)]["rps"]
        out["rounds"], out["block_s"] = rounds, block
        return out
    except (RuntimeError, TimeoutError) as exc:
        return {"error": str(exc)[-800:]}
    finally:
        for srv in servers.values():
            srv.stop()


def default_model_check(duration: float, concurrency: int, log_dir: Path) -> dict:
    """detect on the embedded default model (`slc serve` without a bundle) against the trivial endpoint."""
    data_dir = bench_home() / "default-data"
    with _slc_server(None, log_dir, "default", data_dir) as srv:
        try:
            ready = srv.wait_ready(900)
        except (RuntimeError, TimeoutError) as exc:
            return {"error": str(exc)[-800:]}
        closed = lt.run_loadtest(srv.url, ["live", "detect"], concurrency=concurrency, duration=2 * duration,
                                 warmup=2.0, interleave="block", block_s=BLOCK_S, progress=True)
        s = _summary(closed.report)
        return {"ready_s": ready, "closed": s, "detect_over_live": s["detect"]["rps"] / s["live"]["rps"]}


def _machine() -> dict:
    cpu = ""
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "python": platform.python_version(),
            "loadavg_start": os.getloadavg()}


def _ratio(a, b):
    return (a / b) if (a is not None and b not in (None, 0)) else None


def evaluate_targets(rows: list[dict], default_model: Optional[dict], paired: Optional[dict] = None) -> list[dict]:
    """The product's headline figures: measured value, target, met or not."""
    by_d = {r["classes"]: r for r in rows}
    lo, hi = min(by_d), max(by_d)
    t: list[dict] = []

    def add(name, value, target, better="higher", note=""):
        met = None if value is None else (value >= target if better == "higher" else value <= target)
        t.append({"target": name, "value": value, "goal": target, "better": better, "met": met, "note": note})

    c = lambda D, ep: by_d[D]["slc"]["closed"][ep]  # noqa: E731
    s = lambda D, ep: by_d[D]["slc"]["single_connection"][ep]  # noqa: E731
    if paired and "large_over_small" in paired:
        add(f"detect throughput at D={hi:,} / at D={lo:,} (both servers up, alternating blocks)",
            paired["large_over_small"], 0.8)
    add(f"detect throughput at D={hi:,} / at D={lo:,} (sequential runs, drift-prone)",
        _ratio(c(hi, "detect")["rps"], c(lo, "detect")["rps"]), 0.8)
    add(f"detect / softmax throughput at D={hi:,}", _ratio(c(hi, "detect")["rps"], c(hi, "softmax")["rps"]), 10.0,
        note="aim 20")
    add(f"softmax / detect single-connection p50 latency at D={hi:,}",
        _ratio(s(hi, "softmax")["p50_ms"], s(hi, "detect")["p50_ms"]), 30.0)
    add(f"topk index recall@10 at D={hi:,}", by_d[hi]["recall"]["recall_at_k"], 0.95)
    add(f"topk index / exact throughput at D={hi:,} (per batch, closed loop)",
        _ratio(c(hi, "topk_index")["rps"], c(hi, "topk_exact")["rps"]), 5.0)
    add(f"topk exact / index single-connection p50 latency at D={hi:,} (per request)",
        _ratio(s(hi, "topk_exact")["p50_ms"], s(hi, "topk_index")["p50_ms"]), 5.0)
    add(f"server RSS / head size at D={hi:,}", by_d[hi]["memory"]["rss_over_head"], 1.5, better="lower",
        note=f"(RSS - RSS at D={lo:,}) / head = {_fmt(by_d[hi]['memory'].get('over_baseline_over_head'), 2)}")
    if default_model and "detect_over_live" in default_model:
        add("detect / trivial endpoint throughput, default model", default_model["detect_over_live"], 0.5)
    else:
        add("detect / trivial endpoint throughput, default model", None, 0.5,
            note=(default_model or {}).get("error", "not measured")[:200])
    for D in (100_000, hi):
        if D in by_d and "closed" in by_d[D].get("peer", {}):
            add(f"slc softmax / torch peer softmax throughput at D={D:,}",
                _ratio(c(D, "softmax")["rps"], by_d[D]["peer"]["closed"]["softmax"]["rps"]), 1.0)
            add(f"torch peer / slc softmax single-connection p50 at D={D:,}",
                _ratio(by_d[D]["peer"]["single_connection"]["softmax"]["p50_ms"], s(D, "softmax")["p50_ms"]), 1.0)
            if D == hi:
                break
    return t


def _fmt(x, digits=1):
    if x is None:
        return "–"
    if isinstance(x, float):
        if not math.isfinite(x):
            return "–"
        return f"{x:,.{digits}f}" if abs(x) >= 0.01 or x == 0 else f"{x:.2e}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def _index_kind(row: dict) -> str:
    info = (row.get("server_model") or {}).get("index") or {}
    kind = info.get("kind", "?")
    if info.get("fallback_reason"):
        return f"{kind} (asked {info['requested']}, fell back)"
    if kind == "ivf":
        return f"ivf nlist {info.get('nlist')} nprobe {info.get('nprobe')} rerank {info.get('rerank')}, build {_fmt(info.get('build_seconds'))} s"
    return kind


def scale_markdown(res: dict) -> str:
    rows = res["rows"]
    L = [f"# Single logit vs full softmax as D grows (d = {res['dim']})", "",
         f"Command: `{res['command']}`  ", f"Machine: {res['machine']['cpus']} CPUs ({res['machine']['cpu_model']}), "
         f"load average at start {', '.join(f'{x:.1f}' for x in res['machine']['loadavg_start'])}, at end "
         f"{', '.join(f'{x:.1f}' for x in res['machine']['loadavg_end'])} (shared machine: absolute numbers are noisy, "
         "ratios within a run are the figures to read).  ",
         f"Load: closed loop, concurrency {res['concurrency']}, endpoints rotated in {BLOCK_S:g} s blocks (each block drains before the next), "
         f"{res['duration_s']:g} s per endpoint after 2 s warm-up; single connection: endpoints interleaved per "
         f"request, {res['duration_s']:g} s. 1 input per request. Client: serving/loadtest.py (raw asyncio HTTP/1.1, uvloop).",
         "", "## Targets", "", "| figure | measured | goal | met |", "|---|---:|---:|---|"]
    for t in res["targets"]:
        goal = ("≥ " if t["better"] == "higher" else "≤ ") + _fmt(float(t["goal"]), 2)
        met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
        note = f" ({t['note']})" if t.get("note") else ""
        L.append(f"| {t['target']}{note} | {_fmt(t['value'], 2)} | {goal} | {met} |")
    L += ["", "## Throughput, closed loop (req/s)", "",
          "| D | live | detect | softmax | topk exact | topk index | torch peer softmax | detect/softmax | index/exact | slc/peer softmax |",
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        c = r["slc"]["closed"]
        peer = r.get("peer", {}).get("closed", {}).get("softmax", {}).get("rps")
        L.append(f"| {r['classes']:,} | {_fmt(c['live']['rps'])} | {_fmt(c['detect']['rps'])} | {_fmt(c['softmax']['rps'])} | "
                 f"{_fmt(c['topk_exact']['rps'])} | {_fmt(c['topk_index']['rps'])} | {_fmt(peer)} | "
                 f"{_fmt(_ratio(c['detect']['rps'], c['softmax']['rps']), 2)} | "
                 f"{_fmt(_ratio(c['topk_index']['rps'], c['topk_exact']['rps']), 2)} | {_fmt(_ratio(c['softmax']['rps'], peer), 2)} |")
    L += ["", "## Latency, closed loop (ms, p50 / p99)", "",
          "| D | detect | softmax | topk exact | topk index | torch peer softmax |", "|---:|---|---|---|---|---|"]
    for r in rows:
        c = r["slc"]["closed"]
        pc = r.get("peer", {}).get("closed", {}).get("softmax")
        cell = lambda e: f"{_fmt(e['p50_ms'], 2)} / {_fmt(e['p99_ms'], 2)}" if e else "–"  # noqa: E731
        L.append(f"| {r['classes']:,} | {cell(c['detect'])} | {cell(c['softmax'])} | {cell(c['topk_exact'])} | "
                 f"{cell(c['topk_index'])} | {cell(pc)} |")
    L += ["", "## Latency, one connection (ms, p50 / p99)", "",
          "| D | detect | softmax | topk exact | topk index | torch peer softmax | softmax/detect p50 |",
          "|---:|---|---|---|---|---|---:|"]
    for r in rows:
        s = r["slc"]["single_connection"]
        ps = r.get("peer", {}).get("single_connection", {}).get("softmax")
        cell = lambda e: f"{_fmt(e['p50_ms'], 2)} / {_fmt(e['p99_ms'], 2)}" if e else "–"  # noqa: E731
        L.append(f"| {r['classes']:,} | {cell(s['detect'])} | {cell(s['softmax'])} | {cell(s['topk_exact'])} | "
                 f"{cell(s['topk_index'])} | {cell(ps)} | {_fmt(_ratio(s['softmax']['p50_ms'], s['detect']['p50_ms']), 1)} |")
    L += ["", "## Memory, recall, start-up", "",
          "| D | head MiB | server RSS MiB | RSS / head | (RSS − smallest-D RSS) / head | peer RSS MiB | topk index recall@10 | index kind | ready s |",
          "|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        mem = r["memory"]
        L.append(f"| {r['classes']:,} | {_fmt(r['head_bytes'] / 2**20)} | {_fmt(mem['loaded_rss'] / 2**20)} | "
                 f"{_fmt(mem['rss_over_head'], 2)} | {_fmt(mem.get('over_baseline_over_head'), 2)} | "
                 f"{_fmt((r.get('peer', {}).get('memory_rss') or 0) / 2**20)} | "
                 f"{_fmt(r['recall']['recall_at_k'], 3)} | {_index_kind(r)} | {_fmt(r['ready_s'])} |")
    L += ["", "## The head alone (numpy, no HTTP; µs per input)", "",
          "| D | one logit, 1 input | all logits, 1 input | ratio | one logit, batch 64 | all logits, batch 64 | ratio | softmax, batch 64 |",
          "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        h = r["head_alone"]
        L.append(f"| {r['classes']:,} | {_fmt(h['one_logit_per_input_single_us'], 2)} | {_fmt(h['all_logits_per_input_single_us'], 2)} | "
                 f"{_fmt(h['all_over_one_single'])} | {_fmt(h['one_logit_per_input_batch64_us'], 3)} | "
                 f"{_fmt(h['all_logits_per_input_batch64_us'], 2)} | {_fmt(h['all_over_one_batch64'])} | "
                 f"{_fmt(h['softmax_per_input_batch64_us'], 2)} |")
    L += ["", "## Generator ceiling", "",
          "The trivial endpoint (`GET /v1/health/live`) in the same rotation is the ceiling of client + server "
          "framework on these cores; wrk on the same endpoint for comparison:", "",
          "| D | live via slc loadtest (req/s) | wrk (req/s) |", "|---:|---:|---:|"]
    for r in rows:
        w = r.get("wrk_live") or {}
        L.append(f"| {r['classes']:,} | {_fmt(r['slc']['closed']['live']['rps'])} | "
                 f"{_fmt(w.get('rps')) if w.get('available') else w.get('note', '–')} |")
    pd = res.get("paired_detect")
    if pd:
        L += ["", "## detect at the smallest vs the largest D, both servers up", ""]
        if "error" in pd:
            L.append(f"Not measured: {pd['error'][:300]}")
        else:
            L += [f"Alternating {pd['rounds']} × {pd['block_s']:g} s closed-loop blocks per server (concurrency "
                  f"{res['concurrency']}), so both see the same machine.", "",
                  "| D | detect req/s | p50 ms | p99 ms |", "|---:|---:|---:|---:|"]
            for key, v in pd.items():
                if isinstance(v, dict):
                    L.append(f"| {int(key):,} | {_fmt(v['rps'])} | {_fmt(v['p50_ms'], 2)} | {_fmt(v['p99_ms'], 2)} |")
            L.append(f"\nRatio large / small: {_fmt(pd['large_over_small'], 2)}.")
    dm = res.get("default_model")
    if dm:
        L += ["", "## Default model (`slc serve` without a bundle)", ""]
        if "error" in dm:
            L.append(f"Not measured: {dm['error'][:300]}")
        else:
            L.append(f"detect {_fmt(dm['closed']['detect']['rps'])} req/s vs live {_fmt(dm['closed']['live']['rps'])} req/s "
                     f"→ {_fmt(dm['detect_over_live'], 2)} of the trivial endpoint.")
    L += ["", "Peer: serving/torch_peer.py — FastAPI, pydantic body, eager torch backbone rebuilt from backbone.onnx, "
          "W and b as torch tensors, full softmax over D per request, no batching.", ""]
    return "\n".join(L)


def scale_plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    D = [r["classes"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    series = [("detect", "detect"), ("softmax", "softmax"), ("topk_exact", "topk exact"), ("topk_index", "topk index"),
              ("live", "live (trivial)")]
    for key, label in series:
        axes[0].plot(D, [r["slc"]["closed"][key]["rps"] for r in rows], marker="o", label=label)
        if key != "live":
            axes[1].plot(D, [r["slc"]["closed"][key]["p99_ms"] for r in rows], marker="o", label=label)
            axes[2].plot(D, [r["slc"]["single_connection"][key]["p50_ms"] for r in rows], marker="o", label=label)
    peer_rows = [r for r in rows if "closed" in r.get("peer", {})]
    if peer_rows:
        pd = [r["classes"] for r in peer_rows]
        axes[0].plot(pd, [r["peer"]["closed"]["softmax"]["rps"] for r in peer_rows], "k--", marker="x", label="torch peer softmax")
        axes[1].plot(pd, [r["peer"]["closed"]["softmax"]["p99_ms"] for r in peer_rows], "k--", marker="x", label="torch peer softmax")
        axes[2].plot(pd, [r["peer"]["single_connection"]["softmax"]["p50_ms"] for r in peer_rows], "k--", marker="x",
                     label="torch peer softmax")
    titles = [f"throughput, closed loop c={res['concurrency']} (req/s)", "p99 latency, closed loop (ms)",
              "p50 latency, one connection (ms)"]
    for ax, title in zip(axes, titles):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("classes D")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_scale_bench(classes: Sequence[int], dim: int = 256, duration: float = 8.0, out: Path | str = "docs/results",
                    concurrency: int = 8, with_peer: bool = True, default_model: bool = True) -> dict:
    """Run the sweep; writes OUT/scale.json, scale.md, scale.png and returns the result dict."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    classes = sorted(int(c) for c in classes)
    command = f"slc bench scale --classes {','.join(map(str, classes))} --dim {dim} --duration {duration:g} --out {out}"
    res = {"command": command, "dim": dim, "duration_s": duration, "concurrency": concurrency,
           "machine": _machine(), "rows": []}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="slc-bench-") as tmp:
        log_dir = Path(tmp)
        for D in classes:
            _log(f"D={D:,} ...")
            res["rows"].append(bench_one(D, dim, duration, concurrency, log_dir, with_peer))
            _write(res, out, partial=True)
        if len(classes) > 1:
            _log(f"paired detect D={classes[0]:,} vs D={classes[-1]:,} ...")
            res["paired_detect"] = paired_detect(classes[0], classes[-1], dim, concurrency, log_dir)
        res["default_model"] = default_model_check(duration, concurrency, log_dir) if default_model else None
    res["machine"]["loadavg_end"] = os.getloadavg()
    res["elapsed_s"] = time.perf_counter() - t0
    base = min(res["rows"], key=lambda r: r["classes"])["memory"]["loaded_rss"]
    for r in res["rows"]:
        r["memory"]["baseline_rss"] = base
        r["memory"]["over_baseline_over_head"] = (r["memory"]["loaded_rss"] - base) / r["head_bytes"]
    res["targets"] = evaluate_targets(res["rows"], res["default_model"], res.get("paired_detect"))
    _write(res, out)
    _log(f"done in {res['elapsed_s']:.0f} s: {out / 'scale.md'}")
    print(scale_markdown(res))
    return res


def _write(res: dict, out: Path, partial: bool = False) -> None:
    (out / "scale.json").write_text(json.dumps(res, indent=2, default=float) + "\n")
    if partial:
        return
    (out / "scale.md").write_text(scale_markdown(res))
    scale_plot(res, out / "scale.png")
