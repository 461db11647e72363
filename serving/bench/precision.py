"""The scale bench's head-precision phase (issue 29): the full softmax on the float32, bf16 and
int8 heads of one bundle, each in its own `slc serve` (SLC_HEAD_PRECISION), against the floor that
the bytes each precision reads per pass put on it at this machine's measured read bandwidth."""
from __future__ import annotations

import json
import logging
import time
import urllib.request
from pathlib import Path

import numpy as np

from serving import loadtest as lt
from serving.bench.server import process_tree_memory, slc_server
from serving.bundle.quantize import FILES, add_heads

log = logging.getLogger(__name__)

PRECISIONS = ("float32", "bf16", "int8")
BANDWIDTH_BYTES = 256 << 20  # the array `read_bandwidth` sums: far above the last-level cache


def read_bandwidth(rounds: int = 7) -> float:
    """Bytes per second numpy reads a 256 MiB float32 array at (its sum, best of `rounds`)."""
    a = np.ones(BANDWIDTH_BYTES // 4, dtype=np.float32)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best


def head_bytes(classes: int, dim: int, precision: str) -> int:
    """Bytes one pass reads: the rows in the precision's width, the float32 bias, int8's scales."""
    per = {"float32": 4, "bf16": 2, "int8": 1}[precision]
    return classes * dim * per + classes * 4 + (classes * 4 if precision == "int8" else 0)


def ensure_heads(bundle: Path) -> None:
    """The bundle's int8 and bf16 heads, added once (the float32 files are kept)."""
    missing = tuple(p for p in ("int8", "bf16") if not (bundle / FILES[p]["weight"]).is_file())
    if missing:
        add_heads(bundle, missing)


def bench_precisions(bundle: Path, classes: int, dim: int, duration: float, saturate: int, log_dir: Path,
                     bandwidth: float) -> dict:
    """{precision: one-connection and saturated softmax, RSS, and the bandwidth floor}."""
    from serving.bench.run import _summary

    ensure_heads(bundle)
    out = {}
    for precision in PRECISIONS:
        data_dir = bundle.with_name(bundle.name + f"-data-{precision}")
        with slc_server(bundle, log_dir, f"D{classes}-{precision}", data_dir,
                        env={"SLC_HEAD_PRECISION": precision}) as srv:
            ready = srv.wait_ready()
            model = json.loads(urllib.request.urlopen(srv.url + "/v1/model", timeout=30).read())
            one = lt.run_loadtest(srv.url, ["softmax"], concurrency=1, duration=duration, warmup=1.0)
            full = lt.run_loadtest(srv.url, ["softmax"], concurrency=saturate, duration=duration, warmup=2.0)
            rss = process_tree_memory(srv.proc.pid)["rss"]
        floor_ms = head_bytes(classes, dim, precision) / bandwidth * 1e3
        single = _summary(one.report)["softmax"]
        out[precision] = {"softmax_impl": model.get("softmax_impl"), "ready_s": ready, "single": single,
                          "saturated": _summary(full.report)["softmax"], "rss": rss, "floor_ms": floor_ms,
                          "p50_over_floor": single["p50_ms"] / floor_ms if single["p50_ms"] else None}
        log.info(f"D={classes:,} {precision}: one connection p50 {single['p50_ms']:.2f} ms (floor {floor_ms:.2f} ms), "
                 f"RSS {rss / 2**20:.0f} MiB")
    return out
