"""`slc bench index`: build time, memory, recall@10 and speed-up against exact search of the
top-k class index on a synthetic head (written once under WORK), outside the server."""
from __future__ import annotations

import resource
import time
import types
from pathlib import Path
from typing import Optional

import numpy as np

from serving.core.class_index import RECALL_K, ClassIndex, exact_topk

ROW_CHUNK = 65_536


def write_head(work: Path, classes: int, dim: int, rows: str) -> tuple[np.ndarray, np.ndarray]:
    """head_weight.npy / head_bias.npy under `work` (written once, in chunks), memory-mapped."""
    wpath, bpath = work / "head_weight.npy", work / "head_bias.npy"
    if not wpath.exists():
        work.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(1)
        w = np.lib.format.open_memmap(wpath, mode="w+", dtype=np.float32, shape=(classes, dim))
        centers = rng.standard_normal((1000, dim)).astype(np.float32)
        for s in range(0, classes, ROW_CHUNK):
            n = min(ROW_CHUNK, classes - s)
            chunk = rng.standard_normal((n, dim)).astype(np.float32)  # [n, d]
            if rows == "clustered":
                chunk = centers[rng.integers(0, len(centers), n)] + 0.5 * chunk
            w[s:s + n] = chunk / np.sqrt(dim)
        w.flush()
        del w
        np.save(bpath, (0.1 * rng.standard_normal(classes)).astype(np.float32))
    return np.load(wpath, mmap_mode="r", allow_pickle=False), np.load(bpath, mmap_mode="r", allow_pickle=False)


def _recall(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(got, want)]))


def _queries(weight: np.ndarray, batch: int, seed: int = 7) -> dict[str, np.ndarray]:
    """Gaussian queries, and queries near a class row as a trained model's embeddings lie
    (h = 8·W_y/|W_y|² + noise)."""
    rng = np.random.default_rng(seed)
    D, d = weight.shape
    gauss = rng.standard_normal((batch, d)).astype(np.float32)
    wy = np.asarray(weight[np.sort(rng.integers(0, D, batch))], dtype=np.float32)
    near = (8.0 * wy / (wy**2).sum(1, keepdims=True) + 0.5 * rng.standard_normal(wy.shape)).astype(np.float32)
    return {"gaussian": gauss, "near_row": near}


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _search_figures(idx: ClassIndex, weight: np.ndarray, bias: np.ndarray, q: np.ndarray) -> dict:
    t_exact, (_, ex_ids) = _timed(lambda: exact_topk(weight, bias, q, RECALL_K))
    idx.search(q[:2], RECALL_K)  # warm
    t_idx, (_, got) = _timed(lambda: idx.search(q, RECALL_K))
    n1 = min(16, len(q))
    t_one = _timed(lambda: [idx.search(q[i:i + 1], RECALL_K) for i in range(n1)])[0] / n1
    t_exact_one = _timed(lambda: exact_topk(weight, bias, q[:1], RECALL_K))[0]
    return {"recall_at_10": round(_recall(got, ex_ids), 4),
            f"exact_ms_batch{len(q)}": round(1e3 * t_exact, 1), f"index_ms_batch{len(q)}": round(1e3 * t_idx, 1),
            "speedup_batch": round(t_exact / t_idx, 1), "exact_ms_1": round(1e3 * t_exact_one, 1),
            "index_ms_1": round(1e3 * t_one, 2), "speedup_1": round(t_exact_one / t_one, 1)}


def run_index_bench(classes: int, dim: int, rows: str, work: Path, kind: Optional[str] = None,
                    params: Optional[dict] = None, batch: int = 64) -> dict:
    """Open (build or load from cache) the index over a synthetic head and measure it."""
    work = Path(work) / f"{rows}-{classes}x{dim}"
    weight, bias = write_head(work, classes, dim, rows)
    bundle = types.SimpleNamespace(weight=weight, bias=bias, digest=f"bench-{rows}-{classes}x{dim}",
                                   path=work, embed_dim=dim, num_classes=classes)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    open_s, idx = _timed(lambda: ClassIndex.open(bundle, work / "cache", device="cpu", kind=kind, **(params or {})))
    report = {"classes": classes, "dim": dim, "rows": rows, "open_seconds": round(open_s, 2),
              "head_mb": round(weight.nbytes / 2**20, 1), "peak_rss_mb_before_open": round(rss0, 1),
              "peak_rss_mb_after_open": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
              "info": idx.info()}
    for name, q in _queries(weight, batch).items():
        report[name] = _search_figures(idx, weight, bias, q)
    report["peak_rss_mb_end"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    report["memory_now"] = _memory()  # anonymous (index, copies) vs file-backed (the mmap head: page cache)
    return report


def _memory() -> dict:
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key + "_mb"] = round(int(value.split()[0]) / 1024, 1)
    except OSError:
        pass
    return out
