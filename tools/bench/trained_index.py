"""`slc bench index --bundle B`: top-k index recall on a trained head, with real queries.

Random heads flatter or mislead an index: a trained head has clusters of similar classes (水 and
永 sit close) and the queries are embeddings of real inputs, near their class's row. Here:
- queries: h(x) of real inputs (the bundle's samples, or `--inputs FILE.npy` of raw inputs,
  e.g. a dataset's test split), computed with the bundle's own backbone graph;
- heads: the trained head as it is, and the trained head grown to `--grow` rows by perturbed
  copies of its rows (W_j + σ·|W_j|·u/√d, u Gaussian; b_j + σ·std(b)·g), which keeps the
  trained geometry at 10⁵–10⁶ classes;
- for each head and index kind: recall@1 and recall@10 of the index's top-10 against exact
  top-10 (exact_topk), build seconds, and per-batch search time against exact.
"""
from __future__ import annotations

import time
import types
from pathlib import Path
from typing import Optional

import numpy as np

from serving.bundle import load_bundle
from serving.bundle.session import ort_session
from serving.core.class_index import ClassIndex, exact_topk
from tools.report import md_table

K = 10


def embed_inputs(bundle, inputs: np.ndarray, batch: int = 256) -> np.ndarray:
    """h(x) [N, d] float32 with the bundle's backbone graph."""
    session = ort_session(bundle.graph_path("backbone"), threads=2)
    return np.concatenate([session.run(None, {"input": np.asarray(inputs[i:i + batch], np.float32)})[0]
                           for i in range(0, len(inputs), batch)])


def grow_head(weight: np.ndarray, bias: np.ndarray, rows: int, sigma: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The trained rows first, then perturbed copies of them up to `rows` rows."""
    rng = np.random.default_rng(seed)
    D, d = weight.shape
    src = rng.integers(0, D, rows - D)
    norms = np.linalg.norm(weight, axis=1, keepdims=True)  # [D, 1]
    noise = rng.standard_normal((rows - D, d)).astype(np.float32)
    extra_w = weight[src] + sigma * norms[src] * noise / np.sqrt(d)
    extra_b = bias[src] + sigma * float(bias.std()) * rng.standard_normal(rows - D).astype(np.float32)
    return (np.concatenate([weight, extra_w]).astype(np.float32), np.concatenate([bias, extra_b]).astype(np.float32))


def _recalls(got: np.ndarray, want: np.ndarray) -> dict:
    at1 = float(np.mean(got[:, 0] == want[:, 0]))
    at10 = float(np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(got, want)]))
    return {"recall_at_1": round(at1, 4), "recall_at_10": round(at10, 4)}


def measure_head(name: str, weight: np.ndarray, bias: np.ndarray, h: np.ndarray, kinds: tuple[str, ...],
                 work: Path) -> list[dict]:
    t0 = time.perf_counter()
    _, truth = exact_topk(weight, bias, h, K)
    t_exact = time.perf_counter() - t0
    rows = []
    for kind in kinds:
        ns = types.SimpleNamespace(weight=weight, bias=bias, digest=f"trained-{name}-{kind}-{len(weight)}",
                                   path=work, embed_dim=weight.shape[1], num_classes=len(weight))
        t0 = time.perf_counter()
        idx = ClassIndex.open(ns, work / "cache", device="cpu", kind=kind)
        build = time.perf_counter() - t0
        t0 = time.perf_counter()
        _, got = idx.search(h, K)
        rows.append({"head": name, "classes": len(weight), "kind": kind, "info": idx.info(),
                     "build_seconds": round(build, 1), "queries": len(h), "exact_seconds": round(t_exact, 3),
                     "index_seconds": round(time.perf_counter() - t0, 3), **_recalls(got, truth)})
    return rows


def run(bundle_dir: Path, inputs: Optional[Path], grow: list[int], sigma: float, kinds: tuple[str, ...],
        work: Path, max_queries: int = 2000) -> dict:
    bundle = load_bundle(bundle_dir, verify=False)
    if inputs is not None:
        x = np.load(inputs, mmap_mode="r")
        x = x[np.linspace(0, len(x) - 1, min(max_queries, len(x))).astype(int)]
        source = f"{len(x)} inputs of {inputs.name}"
    else:
        with np.load(bundle.path / "samples.npz") as s:
            x = s["input"]
        source = f"the bundle's {len(x)} samples"
    h = embed_inputs(bundle, x)
    weight, bias = np.asarray(bundle.weight, np.float32), np.asarray(bundle.bias, np.float32)
    rows = measure_head("trained", weight, bias, h, kinds, work)
    for n in grow:
        w, b = grow_head(weight, bias, n, sigma)
        rows += measure_head(f"grown σ={sigma:g}", w, b, h, kinds, work)
    return {"bundle": bundle.name, "queries": source, "sigma": sigma, "rows": rows}


def markdown(result: dict, command: str) -> str:
    lines = [f"# Top-k index on a trained head: `{result['bundle']}`", "", f"Command: `{command}`", "",
             f"Queries: h(x) of {result['queries']} (the bundle's backbone graph). Heads: the trained head, and the "
             f"trained head grown with perturbed copies of its rows (σ = {result['sigma']:g}; "
             "tools/bench/trained_index.py). Recall of the index's top-10 against the exact top-10 over the same head; "
             "times for the whole query batch on 2 shared cores.", ""]
    rows = []
    for r in result["rows"]:
        info = {k: v for k, v in r["info"].items() if k in ("nlist", "nprobe", "rerank", "hnsw_m", "ef_search", "codes")}
        used = r["info"].get("kind", r["kind"])
        asked = r["kind"] if used == r["kind"] else f"{r['kind']} → {used} (not worth it)"
        rows.append([r["head"], f"{r['classes']:,}", asked, f"{r['recall_at_1']:.4f}", f"{r['recall_at_10']:.4f}",
                     f"{r['build_seconds']}", f"{r['index_seconds']}", f"{r['exact_seconds']}", f"{info or '—'}"])
    lines.append(md_table(["head", "classes", "index", "recall@1", "recall@10", "build s", "index s", "exact s",
                           "index parameters"], rows, "lrlrrrrrl"))
    return "\n".join(lines + [""])
