"""`slc bench gallery`: how fast a write through one replica of a shared (PostgreSQL) gallery
becomes visible in another replica's index, and the write rate one replica sustains.

Two `PostgresGallery` replicas in this process (each with its own connections and follower
thread, as two servers would have); item i is upserted through replica A and replica B is
polled every millisecond until its index holds it; then the same for deletes.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from tools.report import md_table

DIM = 64


def _wait(check, timeout: float = 10.0) -> float:
    t0 = time.perf_counter()
    while not check():
        if time.perf_counter() - t0 > timeout:
            return float("nan")
        time.sleep(0.001)
    return time.perf_counter() - t0


def _quantiles(seconds: list[float]) -> dict:
    ms = sorted(1e3 * s for s in seconds)
    return {"n": len(ms), "p50_ms": statistics.median(ms), "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
            "max_ms": ms[-1], "lost": sum(1 for s in seconds if s != s)}


def measure(url: str, items: int = 200, poll_s: float = 0.5) -> dict:
    """Propagation delays (upsert, delete) from replica A to replica B, and A's write rate."""
    from serving.gallery import GalleryRecord
    from serving.gallery.postgres import PostgresGallery

    rng = np.random.default_rng(0)
    digest = f"bench-{time.time_ns()}"  # a digest of its own: other rows stay invisible
    with PostgresGallery(url, digest, DIM, poll_s) as a, PostgresGallery(url, digest, DIM, poll_s) as b:
        base = b.count()
        upserts, deletes = [], []
        t_write = 0.0
        for i in range(items):
            t0 = time.perf_counter()
            a.upsert([GalleryRecord(f"sync-{i}", rng.normal(size=DIM).astype(np.float32))])
            t_write += time.perf_counter() - t0
            upserts.append(_wait(lambda: b.count() == base + i + 1))
        for i in range(items):
            a.delete(f"sync-{i}")
            deletes.append(_wait(lambda: b.count() == base + items - i - 1))
    return {"items": items, "poll_s": poll_s, "upsert": _quantiles(upserts), "delete": _quantiles(deletes),
            "writes_per_s": items / t_write}


def markdown(result: dict, command: str) -> str:
    rows = [[kind, r["n"], f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}", f"{r['max_ms']:.1f}", r["lost"]]
            for kind, r in (("upsert", result["upsert"]), ("delete", result["delete"]))]
    return "\n".join([
        "# Shared gallery: how soon another replica sees a write", "", f"Command: `{command}`", "",
        "Two PostgreSQL-backed gallery replicas in one process (each with its own connections and NOTIFY "
        "listener), one local PostgreSQL, 2 shared CPU cores. Each item is written through replica A; "
        "replica B is polled every millisecond until its index holds it (then the same for deletes). "
        f"Followers also poll the table every {result['poll_s']} s, in case a notification is missed.", "",
        md_table(["change", "n", "p50 ms", "p99 ms", "max ms", "never seen (10 s)"], rows, "lrrrrr"), "",
        f"One replica's acknowledged single-item upserts: {result['writes_per_s']:.0f} per second "
        "(each a committed transaction, serialised by the writers' advisory lock).", ""])
