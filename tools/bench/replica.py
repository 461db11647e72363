"""`slc bench replica`: one replica of a very large head (issue 29: 10⁷ classes on the int8 head).

A cached synthetic bundle of D classes (with its quantized heads), served by `slc serve` with
SLC_HEAD_PRECISION and SLC_CLASS_INDEX; measured: seconds to ready, resident memory split into
anonymous (the server's own) and file-backed (pages of the mapped .npy files, which the kernel
drops under pressure), and one-connection latency of detect (against a D = 10 server in the same
run), softmax and exact top-k. Detect reads its float32 row from the mapped head: when the head
does not stay in the page cache, that row comes from disk.
"""
from __future__ import annotations

import json
import logging
import time
import urllib.request
from pathlib import Path

from tools import loadtest as lt
from tools.bench.precision import ensure_heads, head_bytes, read_bandwidth
from tools.bench.server import process_tree_memory, slc_server
from tools.report import md_table

log = logging.getLogger(__name__)


def _serve_and_measure(bundle: Path, env: dict, endpoints: list[str], duration: float, tag: str, log_dir: Path) -> dict:
    from tools.loadtest.stats import endpoint_summary

    with slc_server(bundle, log_dir, tag, bundle.with_name(bundle.name + f"-data-{tag}"), env=env) as srv:
        ready = srv.wait_ready(3600)
        model = json.loads(urllib.request.urlopen(srv.url + "/v1/model", timeout=60).read())
        one = lt.run_loadtest(srv.url, endpoints, concurrency=1, duration=duration * len(endpoints), warmup=1.0,
                              interleave="block",
                              block_s=duration)
        return {"ready_s": ready, "softmax_impl": model.get("softmax_impl"), "index": (model.get("index") or {}).get("kind"),
                "memory": process_tree_memory(srv.proc.pid), "single": endpoint_summary(one.report)}


def bench_replica(classes: int, dim: int, precision: str, class_index: str, duration: float, log_dir: Path) -> dict:
    from tools.bench.run import cached_bundle

    t0 = time.perf_counter()
    big = cached_bundle(classes, dim)
    ensure_heads(big)
    built = time.perf_counter() - t0
    small = _serve_and_measure(cached_bundle(10, dim), {}, ["detect"], duration, "d10", log_dir)
    env = {"SLC_HEAD_PRECISION": precision, "SLC_CLASS_INDEX": class_index}
    large = _serve_and_measure(big, env, ["detect", "softmax", "topk_exact"], duration, f"d{classes}", log_dir)
    bandwidth = read_bandwidth()
    return {"classes": classes, "dim": dim, "precision": precision, "class_index": class_index, "bundle": big.name,
            "bundle_build_s": built, "d10": small, "large": large, "read_bandwidth": bandwidth,
            "floor_ms": head_bytes(classes, dim, precision) / bandwidth * 1e3,
            "head_bytes": {p: head_bytes(classes, dim, p) for p in ("float32", precision)}}


def replica_markdown(r: dict, command: str) -> str:
    big, small = r["large"], r["d10"]
    m = big["memory"]
    s = big["single"]
    det = s["detect"]["p50_ms"] / small["single"]["detect"]["p50_ms"]
    gib = 2 ** 30
    rows = [[name, f"{s[name]['p50_ms']:.2f}", f"{s[name]['p99_ms']:.2f}", f"{s[name]['requests']:,}"]
            for name in ("detect", "softmax", "topk_exact")]
    return "\n".join([
        f"# One replica at D = {r['classes']:,} (d = {r['dim']}), {r['precision']} head", "",
        f"Command: `{command}`  ",
        "Machine: 2 CPU cores, 24 GB (shared; the training runs were paused while this ran). "
        "tools/bench/replica.py says what is measured.", "",
        f"- Bundle: {r['bundle']} (float32 head {r['head_bytes']['float32'] / gib:.1f} GiB, {r['precision']} head "
        f"{r['head_bytes'][r['precision']] / gib:.1f} GiB); built once and cached (this run: {r['bundle_build_s']:.0f} s).",
        f"- Ready after {big['ready_s']:.0f} s (verify: every file hashed; calibration of {r['classes']:,} classes; the "
        f"{r['precision']} chunk sessions packed), class index `{big['index']}` (SLC_CLASS_INDEX={r['class_index']}), "
        f"passes on `{big['softmax_impl']}`.",
        f"- Resident memory {m['rss'] / gib:.1f} GiB: {m.get('rss_anon', 0) / gib:.1f} GiB anonymous, "
        f"{m.get('rss_file', 0) / gib:.1f} GiB pages of the mapped files; peak {(m.get('hwm') or 0) / gib:.1f} GiB.",
        f"- Detect p50 {s['detect']['p50_ms']:.2f} ms against {small['single']['detect']['p50_ms']:.2f} ms at D = 10 "
        f"({det:.2f}×). Softmax p50 against the floor of reading the {r['precision']} head once "
        f"({r['floor_ms']:.0f} ms at {r['read_bandwidth'] / 1e9:.0f} GB/s): {s['softmax']['p50_ms'] / r['floor_ms']:.2f}×.", "",
        md_table(["one connection", "p50 ms", "p99 ms", "requests"], rows, "lrrr"), ""])
