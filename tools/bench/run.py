"""`slc bench scale`: single-logit against full-softmax serving as the number of classes D grows.

For each D: a cached synthetic bundle, a real `slc serve` subprocess, then
- closed loop (concurrency 8) over live, detect, softmax, topk exact, topk index and the KServe
  v2 protocols (JSON, binary tensors, gRPC when slc[grpc] is installed), rotated in short
  blocks so that every endpoint sees the same drift but owns its throughput;
- softmax saturated (SATURATE connections: the next full batch queued while one computes, as under
  any overload) against the GEMM bound of the same batch, and with ONE_BATCH connections (exactly
  one batch: clients and server take turns, no overlap);
- one connection, endpoints interleaved per request (latency without queueing);
- recall@10 of topk index against topk exact on the same inputs (over HTTP);
- the server's resident memory against the head's size;
- the head alone in numpy (one logit vs all D logits, per input and per batch of 64);
- the plain torch peer (torch_peer.py, in a subprocess) on its softmax route, same loads;
- from D = 10⁵: the full softmax on the float32, bf16 and int8 heads, each in a server of its own,
  against the floor of the bytes each reads per pass (tools/bench/precision.py).
Writes OUT/scale.json, scale.md, scale.png. Uses the server's HTTP API and serving.bundle only.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from tools import loadtest as lt
from tools.bench import cpu
from tools.bench.head import head_alone
from tools.bench.precision import bench_precisions, read_bandwidth
from tools.bench.report import evaluate_targets, scale_markdown, scale_plot
from tools.bench.server import grpc_available, peer_server, process_tree_memory, slc_server
from serving.bundle import output, slc_home
from tools.loadtest.stats import endpoint_summary, latency_summary
from tools.report import write_json, write_result

log = logging.getLogger(__name__)

INPUT_DIM = 64
BLOCK_S = 2.0
ROTATION = ["live", "detect", "softmax", "topk_exact", "topk_index", "v2", "v2_binary"]
SINGLE = ["detect", "softmax", "topk_exact", "topk_index", "v2", "v2_binary"]
ONE_BATCH = 64  # connections that fill one batch (the server's max_batch)
SATURATE = 2 * ONE_BATCH  # connections that keep the next full batch queued while one computes
SYNTHETIC_ROWS = "clustered"  # like trained heads; "gaussian" is the index worst case
PRECISION_MIN_CLASSES = 100_000  # from here on the full softmax is also measured on the int8 and bf16 heads


def bench_home() -> Path:
    return slc_home() / "bench"


def synthetic_builder_version() -> str:
    """A short hash of the synthetic builder's source: a changed builder never reuses old bundles."""
    from serving.bundle import synthetic

    return hashlib.sha256(Path(synthetic.__file__).read_bytes()).hexdigest()[:8]


def bundle_cache_path(classes: int, dim: int, seed: int = 0, rows: str = SYNTHETIC_ROWS, negatives: int = 0) -> Path:
    """Where cached_bundle keeps (or will build) the synthetic bundle of these parameters."""
    return bench_home() / (f"synthetic-D{classes}-d{dim}-i{INPUT_DIM}-s{seed}-{rows}" + (f"-n{negatives}" if negatives else "")
                           + f"-b{synthetic_builder_version()}")


def cached_bundle(classes: int, dim: int, seed: int = 0, rows: str = SYNTHETIC_ROWS, negatives: int = 0) -> Path:
    """Build (once) the synthetic bundle for D = classes; built into a temp dir, then renamed.

    The cache key holds everything the rows depend on: D, d, input size, seed, the rows kind
    and the builder's version (stale bundles of another kind or builder are never reused).
    """
    from serving.bundle.synthetic import build_synthetic_bundle

    path = bundle_cache_path(classes, dim, seed, rows, negatives)
    if (path / "manifest.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    t0 = time.perf_counter()
    build_synthetic_bundle(classes=classes, dim=dim, input_dim=INPUT_DIM, seed=seed, out=tmp, rows=rows,
                           negatives=negatives)
    output.replace_cache(tmp, path, "bundle")
    log.info("built %s in %.1f s", path.name, time.perf_counter() - t0)
    return path


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


def full_logits_formats(url: str, model: str, batch: int = 1, rounds: int = 9, seed: int = 2,
                        formats: Sequence[str] = ("json", "binary")) -> dict:
    """`<model>-full` over KServe v2, all D logits of `batch` inputs: JSON output against raw float32
    (binary tensor extension), one connection, alternating; median ms and bytes of each answer."""
    x = np.random.default_rng(seed).standard_normal((batch, INPUT_DIM)).astype(np.float32)
    head = {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}
    bodies = {"json": head, "binary": {**head, "outputs": [{"name": "logits", "parameters": {"binary_data": True}}]}}
    bodies = {fmt: body for fmt, body in bodies.items() if fmt in formats}
    times: dict[str, list] = {k: [] for k in bodies}
    size = {}
    for _ in range(rounds):
        for fmt, body in bodies.items():
            req = urllib.request.Request(f"{url}/v2/models/{model}-full/infer", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            t0 = time.perf_counter()
            with urllib.request.urlopen(req, timeout=300) as r:
                data = r.read()
                n = int(r.headers.get("Inference-Header-Content-Length") or len(data))
            if fmt == "json":
                json.loads(data)  # the client's cost of reading the numbers is part of it
            else:
                np.frombuffer(data, "<f4", offset=n)
            times[fmt].append(time.perf_counter() - t0)
            size[fmt] = len(data)
    out = {fmt: {"median_ms": 1e3 * float(np.median(t)), "bytes": size[fmt]} for fmt, t in times.items()}
    if len(out) == 2:
        out["json_over_binary"] = out["json"]["median_ms"] / out["binary"]["median_ms"]
    out["batch"] = batch
    return out


def measure_server(url: str, endpoints: Sequence[str], concurrency: int, duration: float, warmup: float = 2.0,
                   single: Optional[Sequence[str]] = None, class_: Optional[str] = None,
                   grpc_port: Optional[int] = None) -> dict:
    """Closed loop (block rotation) plus one-connection latency (per-request interleaving)."""
    closed = lt.run_loadtest(url, list(endpoints), class_=class_, concurrency=concurrency,
                             duration=duration * len(endpoints), warmup=warmup, interleave="block", block_s=BLOCK_S,
                             progress=True, grpc_port=grpc_port)
    one = lt.run_loadtest(url, list(single or endpoints), class_=class_, concurrency=1, duration=duration,
                          warmup=min(warmup, 1.0), interleave="request", progress=True, grpc_port=grpc_port)
    return {"closed": endpoint_summary(closed.report), "single_connection": endpoint_summary(one.report),
            "closed_report": closed.report, "single_report": one.report}



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
    grpc = grpc_available()
    rotation, single = ROTATION + ["grpc"] * grpc, SINGLE + ["grpc"] * grpc
    with slc_server(bundle, log_dir, f"D{D}", data_dir, grpc=grpc) as srv:
        row["ready_s"] = srv.wait_ready()
        log.info(f"D={D}: server ready in {row['ready_s']:.1f} s")
        idle = process_tree_memory(srv.proc.pid)
        model = json.loads(urllib.request.urlopen(srv.url + "/v1/model", timeout=30).read())
        row["server_model"] = {k: model.get(k) for k in ("execution_providers", "providers", "softmax_impl", "index")
                               if k in model}
        phase("start")
        row["wrk_live"] = lt.wrk_ceiling(srv.url, concurrency, 3.0)
        m = measure_server(srv.url, rotation, concurrency, duration, single=single, grpc_port=srv.grpc_port)
        row["slc"] = {"closed": m["closed"], "single_connection": m["single_connection"]}
        # the one-logit protocols alone on one connection: in the full rotation each endpoint follows
        # a different one (v2 comes after topk index) and pays for what that one evicted from the caches
        protocols = ["detect", "v2", "v2_binary"] + ["grpc"] * grpc
        one = lt.run_loadtest(srv.url, protocols, concurrency=1, duration=duration, warmup=1.0, interleave="request",
                              progress=True, grpc_port=srv.grpc_port)
        row["slc"]["protocols_single"] = endpoint_summary(one.report)
        for key, conns in (("softmax_one_batch", ONE_BATCH), ("softmax_saturated", SATURATE)):
            before = cpu.snapshot(srv.proc.pid)  # (the warm-up's 2 s count too: the same load)
            full = lt.run_loadtest(srv.url, ["softmax"], concurrency=conns, duration=duration, warmup=2.0)
            row[key] = {"concurrency": conns, **endpoint_summary(full.report)["softmax"]}
            row[key]["cpu"] = cpu.split(before, cpu.snapshot(srv.proc.pid), row[key]["rps"])
        row["recall"] = topk_recall(srv.url)
        row["full_logits"] = full_logits_formats(srv.url, model["name"], rounds=9 if D <= 100_000 else 5)
        loaded = process_tree_memory(srv.proc.pid)
        phase("load")
        row["memory"] = {"idle_rss": idle["rss"], "loaded_rss": loaded["rss"], "hwm": loaded["hwm"],
                         "source": loaded["source"], "rss_over_head": loaded["rss"] / head_bytes}
        log.info(f"D={D}: slc done; RSS {loaded['rss'] / 2**20:.0f} MiB, head {head_bytes / 2**20:.0f} MiB")
    row["head_alone"] = head_alone(bundle)
    phase("head_alone")
    if D >= PRECISION_MIN_CLASSES:
        row["precisions"] = bench_precisions(bundle, D, dim, duration, SATURATE, log_dir, read_bandwidth())
        phase("precisions")
    if with_peer:
        with peer_server(bundle, log_dir, f"D{D}") as peer:
            try:
                row["peer_ready_s"] = peer.wait_ready(600)
                pm = measure_server(peer.url, ["softmax"], concurrency, duration, single=["softmax"])
                row["peer"] = {"closed": pm["closed"], "single_connection": pm["single_connection"],
                               "memory_rss": process_tree_memory(peer.proc.pid)["rss"]}
            except (RuntimeError, TimeoutError) as exc:
                row["peer"] = {"error": str(exc)[-500:]}
        phase("peer")
    log.info(f"D={D}: phases {row['timings_s']}")
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
            servers[D] = slc_server(bundle, log_dir, f"pair-D{D}", bundle.with_name(bundle.name + "-data"))
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
                        "p50_ms": latency_summary(np.array(lat[D])).get("p50"),
                        "p99_ms": latency_summary(np.array(lat[D])).get("p99")} for D in servers}
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
    with slc_server(None, log_dir, "default", data_dir) as srv:
        try:
            ready = srv.wait_ready(900)
        except (RuntimeError, TimeoutError) as exc:
            return {"error": str(exc)[-800:]}
        closed = lt.run_loadtest(srv.url, ["live", "detect", "v2"], concurrency=concurrency, duration=3 * duration,
                                 warmup=2.0, interleave="block", block_s=BLOCK_S, progress=True)
        s = endpoint_summary(closed.report)
        return {"ready_s": ready, "closed": s, "detect_over_live": s["detect"]["rps"] / s["live"]["rps"],
                "v2_over_detect": s["v2"]["rps"] / s["detect"]["rps"]}


def machine_info() -> dict:
    cpu = ""
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "python": platform.python_version(),
            "loadavg_start": os.getloadavg()}



def run_scale_bench(classes: Sequence[int], dim: int = 256, duration: float = 8.0, out: Path | str = "docs/results",
                    concurrency: int = 8, with_peer: bool = True, default_model: bool = True) -> dict:
    """Run the sweep; writes OUT/scale.json, scale.md, scale.png and returns the result dict."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    classes = sorted(int(c) for c in classes)
    command = f"slc bench scale --classes {','.join(map(str, classes))} --dim {dim} --duration {duration:g} --out {out}"
    res = {"command": command, "dim": dim, "duration_s": duration, "concurrency": concurrency, "block_s": BLOCK_S,
           "machine": machine_info(), "rows": []}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="slc-bench-") as tmp:
        log_dir = Path(tmp)
        for D in classes:
            log.info(f"D={D:,} ...")
            res["rows"].append(bench_one(D, dim, duration, concurrency, log_dir, with_peer))
            _write(res, out, partial=True)
        if len(classes) > 1:
            log.info(f"paired detect D={classes[0]:,} vs D={classes[-1]:,} ...")
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
    log.info(f"done in {res['elapsed_s']:.0f} s: {out / 'scale.md'}")
    return res


def _write(res: dict, out: Path, partial: bool = False) -> None:
    if partial:
        write_json(out / "scale.json", res, default=float)
        return
    write_result(out, "scale", lambda: scale_markdown(res), res, default=float)
    scale_plot(res, out / "scale.png")
