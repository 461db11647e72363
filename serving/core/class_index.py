"""Top-k classes by logit without scoring all D classes: a faiss index over the class rows.

Scores are logits z_j = W_j · h + b_j, i.e. an inner product of the row [W_j, b_j] with the
query [h, 1]. Kinds:

- ``flat``  faiss ``IndexFlatIP`` over [W, b] (a copy: chosen for D <= EXACT_MAX_CLASSES); used on
            GPU only: on CPU the search is the numpy ``exact`` one (faiss's OpenMP threads spin
            after each call and starve the server's event loop).
- ``exact`` numpy matmul over the memory-mapped head in chunks (no copy; the reference and
            the fallback when no index is wanted).
- ``ivf``   cells over [W_j, s·b_j] queried with [h, 1/s] (same inner product). By default a cell
            holds class ids only and a search scores the probed cells' rows exactly from the
            memory-mapped head (serving/core/class_cells.py: 4 bytes per class, no copy of the rows);
            ``codes=sq4`` keeps faiss's ``IndexIVFScalarQuantizer`` with 4-bit codes instead (an
            eighth of the head's memory, a faster scan; candidates re-scored exactly). The bias matters:
            with b_j spread like the W_j·h (trained and synthetic heads alike) the top logits
            belong to high-bias rows of *many* directions, so cells by direction alone (spherical
            k-means) must probe most lists. Cells therefore come from L2 k-means on [W_j, s·b_j]
            with s chosen so the bias is a leading axis (cells = direction x bias band; rows
            assigned to the nearest centroid), and a cell is probed by the vector
            [mean W of the cell, s · max b in the cell]: [h, 1/s] · that = an optimistic logit of
            the cell, which ranks the cells holding the top rows first. nprobe tuned at build
            time for recall@10 >= RECALL_TARGET on queries like the server's (backbone.onnx on
            random inputs). (The MIPS -> L2 augmentation is wrong for IVF: the extra coordinate
            is shared by all rows, so every centroid leans on it.)
- ``hnsw``  the MIPS -> L2 reduction (Bachrach et al. 2014: rows [W_j, b_j] augmented with
            sqrt(M^2 - |x_j|^2) all have norm M, and for the query [h, 1, 0] the nearest row in
            L2 is the row of largest inner product) with ``IndexHNSWFlat``; only when asked for:
            slow to build at 1M rows on two cores, and it stores a full copy.

Every kind fetches a candidate set and re-scores it exactly from the head (float64 dot
products rounded to float32), so returned scores are the logits, best first.
The built index is cached in ``cache_dir`` keyed by the bundle digest.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from serving.core import head_scan
from serving.bundle.files import atomic_replace
from serving.bundle.session import ort_session
from serving.core.class_cells import HeadLists
from serving.core.device.index import faiss_gpus, place_index

log = logging.getLogger(__name__)
# faiss is imported where an index needs it (about 13 MiB of the server's memory): a server whose
# cached index is cells of class ids (or exact) never loads it.

EXACT_MAX_CLASSES = 50_000
RECALL_K = 10
RECALL_TARGET = 0.97
RECALL_QUERIES = 256
MIN_SPEEDUP = 2.0  # an approximate index slower than this against exact (batched) is dropped
RECALL_MARGIN = 0.01  # tuning aims this far above the target: fresh queries scatter around the tuning recall
BIAS_AXIS_SHARE = 0.4  # s·sd(b) as a share of the rows' spread, sqrt(E|W_j - mean W|^2)
CACHE_FORMAT = 5  # 5: cells of class ids (codes none) by default
_CHUNK_ROWS = 65_536
_GPU_MAX_K = 2048


def _clip_k(k: int, num_classes: int) -> int:
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return min(int(k), num_classes)


def exact_topk(weight: np.ndarray, bias: np.ndarray, h: np.ndarray, k: int,
               chunk_rows: int | None = None, gemm: head_scan.Gemm | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k in one chunked pass over the head (serving/core/head_scan.py), so a memory-mapped head
    is never copied whole.

    Returns (float32 logits [N, k], int64 ids [N, k]) sorted best first; logits as computed
    by the float32 matmul (callers re-score when they need the float64-rounded value).
    """
    h = np.ascontiguousarray(h, dtype=np.float32)  # [N, d]
    k = _clip_k(k, weight.shape[0])
    acc = head_scan.TopK(h.shape[0], k)
    if h.shape[0]:
        head_scan.scan(weight, bias, h, [(slice(None), acc)], chunk_rows, gemm)
    return acc.result()


def rescore(weight: np.ndarray, bias: np.ndarray, h: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Exact logits W[ids] · h + b[ids] for candidate ids [N, R] (ids < 0 -> -inf): float64 sums rounded to float32."""
    n, r = ids.shape
    valid = ids >= 0
    safe = np.where(valid, ids, 0)
    flat = safe.reshape(-1)
    uniq, inverse = np.unique(flat, return_inverse=True)  # gather each row of the mmap once
    rows = np.asarray(weight[uniq], dtype=np.float64)  # [U, d]
    rows_b = np.asarray(bias[uniq], dtype=np.float64)  # [U]
    w = rows[inverse].reshape(n, r, -1)  # [N, R, d]
    logits = np.einsum("nrd,nd->nr", w, np.asarray(h, dtype=np.float64)) + rows_b[inverse].reshape(n, r)
    out = logits.astype(np.float32)
    out[~valid] = -np.inf
    return out


def _augmented(weight: np.ndarray, bias: np.ndarray, start: int, stop: int, max_norm: float) -> np.ndarray:
    """Rows [W_j, b_j, sqrt(M^2 - |[W_j, b_j]|^2)] for j in [start, stop): all of norm M. [n, d + 2] float32."""
    x = np.empty((stop - start, weight.shape[1] + 2), dtype=np.float32)
    x[:, :-2] = weight[start:stop]
    x[:, -2] = bias[start:stop]
    sq = np.einsum("ij,ij->i", x[:, :-1].astype(np.float64), x[:, :-1].astype(np.float64))
    x[:, -1] = np.sqrt(np.maximum(max_norm**2 - sq, 0.0))
    return x


def _query_rows(h: np.ndarray, kind: str, bias_scale: float = 1.0) -> np.ndarray:
    """The query in the index's space: [h, 1/s] for inner product (rows hold s·b), [h, 1, 0] for the L2 reduction."""
    h = np.asarray(h, dtype=np.float32)
    extra = 2 if kind == "hnsw" else 1
    q = np.zeros((h.shape[0], h.shape[1] + extra), dtype=np.float32)
    q[:, : h.shape[1]] = h
    q[:, h.shape[1]] = 1.0 / bias_scale if kind == "ivf" else 1.0
    return q


def _max_row_norm(weight: np.ndarray, bias: np.ndarray) -> float:
    best = 0.0
    for start in range(0, weight.shape[0], _CHUNK_ROWS):
        w = np.asarray(weight[start:start + _CHUNK_ROWS], dtype=np.float64)
        sq = np.einsum("ij,ij->i", w, w) + np.asarray(bias[start:start + _CHUNK_ROWS], dtype=np.float64) ** 2
        best = max(best, float(sq.max()))
    # a hair above the largest norm, so float32 rounding never makes M^2 - |x|^2 negative
    return float(np.sqrt(best) * (1 + 1e-6))


MAX_NLIST = 2048  # at 10^6 rows: 4096 lists took 3x the build time of 2048 for the same recall


def default_nlist(num_classes: int) -> int:
    """About 4·sqrt(D) lists, a power of two, at most MAX_NLIST (1024 at 100k, 2048 at 1M)."""
    return min(MAX_NLIST, int(2 ** round(np.log2(max(4 * np.sqrt(num_classes), 16)))))


def backbone_queries(bundle: Any, n: int, seed: int = 0) -> np.ndarray | None:
    """Embeddings of random N(0, 1) inputs of the bundle's input shape through its backbone.onnx: the
    queries the server sees under load (the bench and loadtest send such inputs). None without a backbone."""
    path = getattr(bundle, "path", None)
    shape = getattr(bundle, "input_shape", None)
    model = Path(path) / "backbone.onnx" if path is not None else None
    if model is None or not model.is_file() or not shape:
        return None
    try:
        sess = ort_session(model)
        x = np.random.default_rng(seed).standard_normal((n, *[int(s) for s in shape])).astype(np.float32)
        name = sess.get_inputs()[0].name
        h = np.concatenate([sess.run(None, {name: x[i:i + 64]})[0] for i in range(0, n, 64)])
        return np.ascontiguousarray(h.reshape(n, -1), dtype=np.float32)
    except Exception as exc:  # noqa: BLE001 - no onnxruntime or an odd graph: other queries instead
        log.warning("cannot embed random inputs with %s for recall queries: %s", model, exc)
        return None


def sample_queries(bundle: Any, embed_dim: int, n: int = RECALL_QUERIES, seed: int = 0) -> tuple[np.ndarray, str]:
    """Queries for tuning and measuring recall, most like the server's first:
    the bundle's backbone on random inputs, else Gaussian with the mean/std of samples.npz embeddings, else N(0, I)."""
    rng = np.random.default_rng(seed)
    h = backbone_queries(bundle, n, seed)
    if h is not None and h.shape[1] == embed_dim:
        return h, "backbone.onnx on random N(0, 1) inputs"
    path = getattr(bundle, "path", None)
    samples = Path(path) / "samples.npz" if path is not None else None
    if samples is not None and samples.is_file():
        try:
            with np.load(samples, allow_pickle=False) as z:
                key = next((k for k in ("embedding", "embeddings", "h") if k in z.files), None)
                if key is not None:
                    emb = np.asarray(z[key], dtype=np.float64).reshape(-1, embed_dim)
                    if emb.shape[0] >= 1:
                        mu = emb.mean(0)
                        sd = emb.std(0) if emb.shape[0] > 1 else np.abs(emb[0]) + 1e-3
                        sd = np.where(sd > 0, sd, max(float(sd.mean()), 1e-3))
                        q = mu + sd * rng.standard_normal((n, embed_dim))
                        return np.concatenate([emb[:n], q])[:n].astype(np.float32), "samples.npz"
        except (OSError, ValueError) as exc:  # a broken samples file must not stop serving
            log.warning("cannot read %s for recall queries: %s", samples, exc)
    return rng.standard_normal((n, embed_dim)).astype(np.float32), "gaussian"


@dataclass
class _Meta:
    kind: str
    digest: str
    num_classes: int
    embed_dim: int
    max_norm: float = 0.0
    nlist: int = 0
    nprobe: int = 0
    ef_search: int = 0
    rerank: int = 0
    bias_scale: float = 1.0
    codes: str = ""
    recall_at_k: float | None = None
    recall_queries: str = ""
    build_seconds: float = 0.0
    tuning: list = field(default_factory=list)
    requested: str = ""  # the kind asked for; kind becomes "exact" when the index was not worth it
    fallback_reason: str = ""
    format: int = CACHE_FORMAT


class ClassIndex:
    """Top-k classes by logit for a bundle's head; see the module docstring for the kinds."""

    builds = 0  # how many indexes this process has built (not loaded): tests check cache reuse with it

    def __init__(self, weight: np.ndarray, bias: np.ndarray, meta: _Meta, index: Any = None,
                 device: str = "cpu", loaded_from_cache: bool = False):
        self.weight, self.bias = weight, bias
        self.meta = meta
        self.index = index
        self.device = device
        self.loaded_from_cache = loaded_from_cache

    # ----------------------------------------------------------------------------- building
    @classmethod
    def open(cls, bundle: Any, cache_dir: Path, device: str = "auto", kind: str | None = None,
             **params: Any) -> "ClassIndex":
        """Load the cached index for ``bundle.digest`` or build (and cache) it.

        kind None chooses by D: ``flat`` up to EXACT_MAX_CLASSES, else ``ivf``, and ``hnsw``
        when IVF misses its recall or speed target (a trained head's rows are not spread like random
        ones: IVF's own tuning can reject it), exact search when neither is worth it. ``params`` overrides build
        settings (nlist, nprobe, rerank, train_size, niter, hnsw_m, ...).
        """
        if kind is not None or int(bundle.weight.shape[0]) <= EXACT_MAX_CLASSES:
            return cls._open_kind(bundle, cache_dir, device, kind, **params)
        ivf = cls._open_kind(bundle, cache_dir, device, "ivf", **params)
        if ivf.meta.kind != "exact":
            return ivf
        log.info("class index: ivf not worth it on this head; trying hnsw")
        return cls._open_kind(bundle, cache_dir, device, "hnsw", **params)

    @classmethod
    def _open_kind(cls, bundle: Any, cache_dir: Path, device: str, kind: str | None, **params: Any) -> "ClassIndex":
        """open() for one kind (None: flat or ivf by D)."""
        weight, bias = bundle.weight, bundle.bias
        num_classes, embed_dim = int(weight.shape[0]), int(weight.shape[1])
        digest = str(bundle.digest)
        if kind is None:
            kind = "flat" if num_classes <= EXACT_MAX_CLASSES else "ivf"
        if kind not in ("flat", "exact", "ivf", "hnsw"):
            raise ValueError(f"unknown index kind {kind!r}")
        if kind == "exact":
            meta = _Meta(kind, digest, num_classes, embed_dim, recall_at_k=1.0, recall_queries="exact")
            return cls(weight, bias, meta, None, "cpu")
        if kind == "flat":  # cheap to build: not cached
            meta = _Meta(kind, digest, num_classes, embed_dim, recall_at_k=1.0, recall_queries="exact")
            if device == "cpu" or faiss_gpus() == 0:  # on CPU, search() uses numpy over the mmap head: no copy
                return cls(weight, bias, meta, None, "cpu")
            import faiss

            t0 = time.perf_counter()
            index = faiss.IndexFlatIP(embed_dim + 1)
            for start in range(0, num_classes, _CHUNK_ROWS):
                stop = min(start + _CHUNK_ROWS, num_classes)
                index.add(np.ascontiguousarray(np.column_stack([weight[start:stop], bias[start:stop]]), dtype=np.float32))
            meta = _Meta(kind, digest, num_classes, embed_dim, recall_at_k=1.0, recall_queries="exact",
                         build_seconds=time.perf_counter() - t0)
            cls.builds += 1
            index, dev = place_index(index, device)
            return cls(weight, bias, meta, index, dev)

        cache_dir = Path(cache_dir)
        tag = "-".join(f"{k}={params[k]}" for k in sorted(params))
        stem = f"classindex-{digest[:32]}-{kind}" + (f"-{hashlib.sha256(tag.encode()).hexdigest()[:12]}" if tag else "")
        index_path, meta_path = cache_dir / f"{stem}.faiss", cache_dir / f"{stem}.json"
        loaded = _load_cached(index_path, meta_path, digest, kind, num_classes, embed_dim)
        if loaded is not None:
            index, meta = loaded
            dev = "cpu"
            if index is not None:
                _set_search_params(index, meta)
                index, dev = place_index(index, device, meta)
            where = _lists_path(index_path) if isinstance(index, HeadLists) else index_path
            log.info("class index %s loaded from %s (recall@%d %.3f)", kind, where, RECALL_K, meta.recall_at_k or -1)
            return cls(weight, bias, meta, index, dev, loaded_from_cache=True)

        t0 = time.perf_counter()
        meta = _Meta(kind, digest, num_classes, embed_dim, max_norm=_max_row_norm(weight, bias), requested=kind)
        index = _build(weight, bias, meta, params)
        meta.build_seconds = time.perf_counter() - t0  # training + adding; tuning reported separately
        cls.builds += 1
        self = cls(weight, bias, meta, index, "cpu")
        self._tune(bundle, params)
        _save_cached(self.index, meta, index_path, meta_path)
        if self.index is not None:
            self.index, self.device = place_index(self.index, device, meta)
        log.info("class index %s built in %.1fs: %s", kind, meta.build_seconds, self.info())
        return self

    def _tune(self, bundle: Any, params: dict) -> None:
        """Measure recall@10 against exact on sample queries; for ivf/hnsw raise nprobe/efSearch until it reaches the target."""
        meta = self.meta
        queries, source = sample_queries(bundle, meta.embed_dim, int(params.get("recall_queries", RECALL_QUERIES)))
        meta.recall_queries = source
        k = min(RECALL_K, meta.num_classes)
        target = float(params.get("recall_target", RECALL_TARGET))
        aim = min(target + float(params.get("recall_margin", RECALL_MARGIN)), 1.0)
        if meta.kind == "ivf":
            name, fixed = "nprobe", params.get("nprobe")
            steps = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
            values = [int(fixed)] if fixed else [v for v in steps if v <= meta.nlist] or [meta.nlist]
        else:
            name, fixed = "ef_search", params.get("ef_search")
            values = [int(fixed)] if fixed else [16, 32, 64, 128, 256, 512, 1024]
        t0 = time.perf_counter()
        _, truth = exact_topk(self.weight, self.bias, queries, k)
        exact_ms = 1e3 * (time.perf_counter() - t0) / len(queries)
        min_speedup = float(params.get("min_speedup", MIN_SPEEDUP))
        meta.tuning = [{"exact_ms_per_query": round(exact_ms, 4)}]
        for value in values:
            setattr(meta, name, value)
            _set_search_params(self.index, meta)
            t0 = time.perf_counter()
            _, got = self.search(queries, k)
            ms = 1e3 * (time.perf_counter() - t0) / len(queries)
            recall = _recall(got, truth)
            meta.tuning.append({name: value, "recall": round(recall, 4), "ms_per_query": round(ms, 4)})
            meta.recall_at_k = recall
            if recall >= aim:
                break
            if ms * min_speedup > exact_ms:  # more probes only get slower: no point going on
                break
        last = meta.tuning[-1]
        if not fixed and (last["recall"] < target or last["ms_per_query"] * min_speedup > exact_ms):
            meta.fallback_reason = (f"recall@{k} {last['recall']:.3f} at {last['ms_per_query']:.2f} ms/query vs exact "
                                    f"{exact_ms:.2f} ms/query: below target {target} or under {min_speedup}x faster")
            log.warning("class index %s not worth it (%s): exact search instead", meta.kind, meta.fallback_reason)
            meta.kind, meta.recall_at_k = "exact", 1.0
            self.index = None

    # ----------------------------------------------------------------------------- querying
    @property
    def kind(self) -> str:
        return self.meta.kind

    @property
    def reads_every_row(self) -> bool:
        """Whether a search is a pass over the whole head (exact, or flat on CPU): the engine then
        answers index top-k with its own pass (serving/core/head_scan.py), batched with exact top-k."""
        return self.meta.kind == "exact" or (self.meta.kind == "flat" and self.device == "cpu")

    @property
    def recall_at_k(self) -> float | None:
        return self.meta.recall_at_k

    def search(self, h: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """h [N, d] float32 -> (logits [N, k] float32, class ids [N, k] int64), best first; k is clipped to D."""
        h = np.ascontiguousarray(h, dtype=np.float32)
        if h.ndim != 2 or h.shape[1] != self.meta.embed_dim:
            raise ValueError(f"expected h of shape [N, {self.meta.embed_dim}], got {list(h.shape)}")
        k = _clip_k(k, self.meta.num_classes)
        if h.shape[0] == 0:
            return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
        # flat on CPU: numpy BLAS over the rows gives the same candidates without faiss's OpenMP
        # threads, which spin after each call and take the event loop's core
        if self.meta.kind == "exact" or (self.meta.kind == "flat" and self.device == "cpu") \
                or (self.device != "cpu" and k + 16 > _GPU_MAX_K):
            # a margin of candidates so float32 near-ties at rank k are settled by the exact re-score
            _, cand = exact_topk(self.weight, self.bias, h, min(k + 16, self.meta.num_classes))
        else:
            cand = self._candidates(h, k)
        logits = rescore(self.weight, self.bias, h, cand)  # [N, R]
        order = np.lexsort((cand, -logits), axis=1)[:, :k]
        top_logits, top_ids = np.take_along_axis(logits, order, 1), np.take_along_axis(cand, order, 1)
        short = ~np.isfinite(top_logits).all(axis=1)  # probed lists held fewer than k rows
        if short.any():
            ex_logits, ex_ids = ClassIndex(self.weight, self.bias, _Meta("exact", "", *self.weight.shape)).search(h[short], k)
            top_logits[short], top_ids[short] = ex_logits, ex_ids
        return top_logits, top_ids

    def _candidates(self, h: np.ndarray, k: int) -> np.ndarray:
        """Candidate ids [N, R] of the ivf / hnsw index (-1: none), R >= k, re-scored by search()."""
        if isinstance(self.index, HeadLists):  # scored exactly already: a margin for float32 near-ties
            return self.index.search(self.weight, self.bias, h, min(k + 16, self.meta.num_classes))[1]
        r = min(max(k + 16, 2 * k, self.meta.rerank), self.meta.num_classes)
        if self.device != "cpu":
            r = min(r, _GPU_MAX_K)  # faiss GPU selects at most 2048 per query
        _, cand = self.index.search(_query_rows(h, self.meta.kind, self.meta.bias_scale or 1.0), r)
        return cand.astype(np.int64, copy=False)

    def info(self) -> dict:
        m = self.meta
        out = {"kind": m.kind, "device": self.device, "num_classes": m.num_classes, "embed_dim": m.embed_dim,
               "recall_at_k": m.recall_at_k, "recall_k": RECALL_K, "recall_queries": m.recall_queries,
               "build_seconds": round(m.build_seconds, 3), "loaded_from_cache": self.loaded_from_cache}
        if m.kind == "ivf":
            out.update(nlist=m.nlist, nprobe=m.nprobe, rerank=m.rerank, codes=m.codes, bias_scale=round(m.bias_scale, 4),
                       index_mb=round(_index_bytes(self.index) / 2**20, 1))
        if m.kind == "hnsw":
            out.update(ef_search=m.ef_search, rerank=m.rerank)
        if m.tuning:
            out["tuning"] = m.tuning
        if m.fallback_reason:
            out.update(requested=m.requested, fallback_reason=m.fallback_reason)
        return out


def _recall(got: np.ndarray, truth: np.ndarray) -> float:
    hits = sum(len(np.intersect1d(g, t)) for g, t in zip(got, truth))
    return hits / truth.size


def _build(weight: np.ndarray, bias: np.ndarray, meta: _Meta, params: dict) -> Any:
    """Train and fill an ivf or hnsw index over the augmented rows, reading the head in chunks."""
    import faiss

    dim = meta.embed_dim + 2
    num = meta.num_classes
    rng = np.random.default_rng(int(params.get("seed", 0)))
    if meta.kind == "ivf":
        return _build_ivf(weight, bias, meta, params, rng)
    else:
        meta.rerank = int(params.get("rerank", 4 * RECALL_K))
        index = faiss.IndexHNSWFlat(dim, int(params.get("hnsw_m", 32)), faiss.METRIC_L2)
        index.hnsw.efConstruction = int(params.get("ef_construction", 80))
    for start in range(0, num, _CHUNK_ROWS):
        index.add(_augmented(weight, bias, start, min(start + _CHUNK_ROWS, num), meta.max_norm))
    return index


def _bias_scale(weight: np.ndarray, bias: np.ndarray, sample: np.ndarray) -> float:
    """s with s·sd(b) = BIAS_AXIS_SHARE · the rows' spread, so k-means on [W, s·b] cuts bias bands too."""
    rows = np.asarray(weight[sample], dtype=np.float64)  # [n, d]
    spread = float(np.sqrt(((rows - rows.mean(0)) ** 2).sum(1).mean()))
    sd_b = float(np.asarray(bias[sample], dtype=np.float64).std())
    if sd_b <= 0 or spread <= 0:
        return 1.0
    return float(np.clip(BIAS_AXIS_SHARE * spread / sd_b, 1.0, 1e3))


def _build_ivf(weight: np.ndarray, bias: np.ndarray, meta: _Meta, params: dict, rng: np.random.Generator) -> Any:
    """IVF over [W_j, s·b_j]: L2 k-means cells, rows added to their nearest centroid, cells probed by
    [mean W of the cell, s · max b in the cell] (see the module docstring)."""
    import faiss

    num, d = meta.num_classes, meta.embed_dim
    meta.nlist = min(int(params.get("nlist", default_nlist(num))), max(1, num // 39))
    meta.codes = str(params.get("codes", "none"))
    if meta.codes not in ("none", "flat", "sq4", "sq6", "sq8"):
        raise ValueError(f"codes must be none, flat, sq4, sq6 or sq8, got {meta.codes!r}")
    meta.rerank = 0 if meta.codes == "none" else int(params.get("rerank", 6 * RECALL_K))
    train_size = min(num, int(params.get("train_size", 32 * meta.nlist)))
    sample = np.sort(rng.choice(num, size=train_size, replace=False))
    s = float(params.get("bias_scale", 0) or _bias_scale(weight, bias, sample))
    meta.bias_scale = s

    def rows(ids_or_slice) -> np.ndarray:  # [n, d + 1] float32: [W_j, s·b_j]
        w = weight[ids_or_slice]
        x = np.empty((w.shape[0], d + 1), dtype=np.float32)
        x[:, :d] = w
        x[:, d] = np.asarray(bias[ids_or_slice], dtype=np.float32) * np.float32(s)
        return x

    train = rows(sample)  # [train_size, d + 1], one copy
    log.info("class index: k-means of %d sampled rows into %d cells ...", train_size, meta.nlist)
    kmeans = faiss.Kmeans(d + 1, meta.nlist, niter=int(params.get("niter", 10)), seed=int(params.get("seed", 0)) + 1,
                          max_points_per_centroid=10**9, spherical=False)
    kmeans.train(train)
    centroids = np.ascontiguousarray(kmeans.centroids, dtype=np.float32)  # [nlist, d + 1]
    nearest = faiss.IndexFlatL2(d + 1)
    nearest.add(centroids)
    assign = np.empty(num, dtype=np.int64)
    cell_max_b = np.full(meta.nlist, -np.inf, dtype=np.float32)
    progress = _Progress(f"class index: assigning {num:,} rows to cells", num)
    for start in range(0, num, _CHUNK_ROWS):
        stop = min(start + _CHUNK_ROWS, num)
        x = rows(slice(start, stop))
        assign[start:stop] = nearest.search(x, 1)[1][:, 0]
        np.maximum.at(cell_max_b, assign[start:stop], x[:, d])
        progress.update(stop)
    probe = centroids.copy()
    filled = np.isfinite(cell_max_b)
    probe[filled, d] = cell_max_b[filled]  # empty cells keep their centroid: never read anyway
    if meta.codes == "none":
        return HeadLists.from_assignment(assign, probe, s)
    index = _coded_ivf(probe, meta)
    index.train(train)  # the quantizer is full (nlist vectors): trains the scalar quantiser's code ranges only
    del train
    progress = _Progress(f"class index: encoding {num:,} rows ({meta.codes})", num)
    for start in range(0, num, _CHUNK_ROWS):
        stop = min(start + _CHUNK_ROWS, num)
        x = rows(slice(start, stop))
        index.add_core(stop - start, faiss.swig_ptr(x), None, faiss.swig_ptr(assign[start:stop]))
        progress.update(stop)
    return index


def _coded_ivf(probe: np.ndarray, meta: _Meta) -> Any:
    """An empty faiss IVF index with codes (flat or scalar-quantised) over the probe cells [nlist, d + 1]."""
    import faiss

    dims = probe.shape[1]
    quantizer = faiss.IndexFlatIP(dims)
    quantizer.add(probe)
    if meta.codes == "flat":
        return faiss.IndexIVFFlat(quantizer, dims, meta.nlist, faiss.METRIC_INNER_PRODUCT)
    qtype = {"sq4": faiss.ScalarQuantizer.QT_4bit, "sq6": faiss.ScalarQuantizer.QT_6bit,
             "sq8": faiss.ScalarQuantizer.QT_8bit}[meta.codes]
    return faiss.IndexIVFScalarQuantizer(quantizer, dims, meta.nlist, qtype, faiss.METRIC_INNER_PRODUCT)


class _Progress:
    """A log line at most every PROGRESS_S seconds while a long build step runs (the server's log is
    where a start-up is watched: no terminal bar)."""

    PROGRESS_S = 5.0

    def __init__(self, what: str, total: int):
        self.what, self.total = what, total
        self.t0 = self.last = time.perf_counter()

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if now - self.last >= self.PROGRESS_S or (done >= self.total and now - self.t0 >= self.PROGRESS_S):
            self.last = now
            log.info("%s: %d%% (%.0f s)", self.what, 100 * done // self.total, now - self.t0)


def _index_bytes(index: Any) -> int:
    """Bytes of codes and ids held by an IVF index (its share of the server's memory)."""
    if isinstance(index, HeadLists):
        return index.nbytes
    import faiss

    try:
        ivf = faiss.extract_index_ivf(index)
        return int(ivf.ntotal) * (int(ivf.code_size) + 8) + int(ivf.nlist) * int(ivf.d) * 4
    except Exception:  # noqa: BLE001 - not an IVF index (or on GPU): unknown
        return 0


def _set_search_params(index: Any, meta: _Meta) -> None:
    if isinstance(index, HeadLists):
        index.nprobe = max(1, meta.nprobe)
        return
    import faiss

    if meta.kind == "ivf" and meta.nprobe:
        faiss.extract_index_ivf(index).nprobe = meta.nprobe
    if meta.kind == "hnsw" and meta.ef_search:
        index.hnsw.efSearch = meta.ef_search


def _load_cached(index_path: Path, meta_path: Path, digest: str, kind: str, num_classes: int,
                 embed_dim: int) -> tuple[Any, _Meta] | None:
    if not meta_path.is_file():
        return None
    try:
        meta = _Meta(**json.loads(meta_path.read_text()))
        if (meta.format, meta.digest, meta.requested, meta.num_classes, meta.embed_dim) != (CACHE_FORMAT, digest, kind, num_classes, embed_dim):
            return None
        if meta.kind == "exact":  # built once, found not worth it: remembered, not rebuilt
            return None, meta
        if meta.codes == "none":
            path = _lists_path(index_path)
            return (HeadLists.load(path, num_classes, embed_dim), meta) if path.is_file() else None
        if not index_path.is_file():
            return None
        import faiss

        return faiss.read_index(str(index_path)), meta
    except Exception as exc:  # noqa: BLE001 - a broken cache entry is rebuilt, never fatal
        log.warning("ignoring broken class index cache %s: %s", index_path, exc)
        return None


def _save_cached(index: Any, meta: _Meta, index_path: Path, meta_path: Path) -> None:
    try:
        # the index first: a meta file without its index is never read as a complete entry
        if isinstance(index, HeadLists):
            atomic_replace(_lists_path(index_path), index.save)
        elif index is not None:
            import faiss

            atomic_replace(index_path, lambda p: faiss.write_index(index, p))
        atomic_replace(meta_path, lambda p: Path(p).write_text(json.dumps(meta.__dict__, indent=1)))
        stale = index_path if isinstance(index, HeadLists) else _lists_path(index_path)
        stale.unlink(missing_ok=True)  # this entry's other form, left by an earlier build
    except OSError as exc:  # a read-only cache dir costs a rebuild next time, nothing more
        log.warning("cannot cache the class index in %s: %s", index_path.parent, exc)


def _lists_path(index_path: Path) -> Path:
    """Where cells of class ids are cached: beside the faiss file name, as .npz."""
    return index_path.with_name(index_path.stem + ".npz")
