"""ClassIndex against brute-force top-k computed in float64 with numpy (the independent truth)."""
from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest

from serving.core.class_index import ClassIndex


def make_bundle(tmp_path: Path, num_classes: int, dim: int, *, clustered: bool, seed: int = 0, digest: str | None = None):
    """A stand-in for serving.bundle.Bundle: memory-mapped head files and a digest."""
    rng = np.random.default_rng(seed)
    if clustered:
        centers = rng.standard_normal((max(num_classes // 100, 2), dim))
        weight = centers[rng.integers(0, len(centers), num_classes)] + 0.3 * rng.standard_normal((num_classes, dim))
    else:
        weight = rng.standard_normal((num_classes, dim))
    bias = 0.5 * rng.standard_normal(num_classes)
    path = tmp_path / f"bundle-{num_classes}-{dim}-{seed}"
    path.mkdir(parents=True, exist_ok=True)
    np.save(path / "head_weight.npy", weight.astype(np.float32))
    np.save(path / "head_bias.npy", bias.astype(np.float32))
    return types.SimpleNamespace(
        path=path, weight=np.load(path / "head_weight.npy", mmap_mode="r", allow_pickle=False),
        bias=np.load(path / "head_bias.npy", mmap_mode="r", allow_pickle=False), embed_dim=dim,
        num_classes=num_classes, digest=digest or f"digest-{num_classes}-{dim}-{seed}-{clustered}",
        thresholds=np.zeros(num_classes, np.float32))


def brute_force(bundle, h: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact logits in float64, rounded to float32 as the index reports them; best first, ties by id."""
    logits = h.astype(np.float64) @ np.asarray(bundle.weight, np.float64).T + np.asarray(bundle.bias, np.float64)
    order = np.lexsort((np.broadcast_to(np.arange(logits.shape[1]), logits.shape), -logits), axis=1)[:, :k]
    return np.take_along_axis(logits, order, 1).astype(np.float32), order.astype(np.int64)


def recall(got: np.ndarray, truth: np.ndarray) -> float:
    return sum(len(np.intersect1d(g, t)) for g, t in zip(got, truth)) / truth.size


@pytest.mark.parametrize("kind", ["flat", "exact"])
def test_exact_kinds_equal_brute_force(tmp_path, kind):
    bundle = make_bundle(tmp_path, 3000, 24, clustered=False)
    index = ClassIndex.open(bundle, tmp_path / "cache", device="cpu", kind=kind)
    h = np.random.default_rng(1).standard_normal((17, 24)).astype(np.float32)
    logits, ids = index.search(h, 10)
    want_logits, want_ids = brute_force(bundle, h, 10)
    assert logits.dtype == np.float32 and ids.dtype == np.int64 and ids.shape == (17, 10)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(logits, want_logits)
    assert index.kind == kind and index.recall_at_k == 1.0


def test_default_kind_is_flat_for_small_D(tmp_path):
    bundle = make_bundle(tmp_path, 500, 8, clustered=False)
    index = ClassIndex.open(bundle, tmp_path / "cache", device="cpu")
    assert index.kind == "flat" and index.info()["device"] == "cpu"


def test_k_is_clipped_and_shapes_checked(tmp_path):
    bundle = make_bundle(tmp_path, 7, 5, clustered=False)
    index = ClassIndex.open(bundle, tmp_path / "cache", device="cpu")
    h = np.random.default_rng(2).standard_normal((3, 5)).astype(np.float32)
    logits, ids = index.search(h, 50)
    want_logits, want_ids = brute_force(bundle, h, 7)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(logits, want_logits)
    assert index.search(np.zeros((0, 5), np.float32), 3)[1].shape == (0, 3)
    with pytest.raises(ValueError):
        index.search(np.zeros((2, 4), np.float32), 3)
    with pytest.raises(ValueError):
        index.search(h, 0)


@pytest.mark.parametrize("codes", ["none", "sq4"])
def test_ivf_recall_and_exact_scores(tmp_path, codes):
    bundle = make_bundle(tmp_path, 20_000, 32, clustered=True)
    index = ClassIndex.open(bundle, tmp_path / "cache", device="cpu", kind="ivf", min_speedup=0, recall_target=0.98,
                            codes=codes)
    assert index.kind == "ivf" and index.info()["codes"] == codes
    assert index.recall_at_k >= 0.98
    h = np.random.default_rng(5).standard_normal((200, 32)).astype(np.float32)  # fresh queries, not the tuning set
    logits, ids = index.search(h, 10)
    _, want_ids = brute_force(bundle, h, 10)
    assert recall(ids, want_ids) >= 0.95
    # scores are the exact logits of the returned classes, best first
    exact = (np.einsum("nkd,nd->nk", np.asarray(bundle.weight, np.float64)[ids], h.astype(np.float64))
             + np.asarray(bundle.bias, np.float64)[ids]).astype(np.float32)
    np.testing.assert_array_equal(logits, exact)
    assert (np.diff(logits, axis=1) <= 0).all()
    assert index.info()["nprobe"] >= 1 and index.info()["nlist"] >= 1


def test_hnsw_recall(tmp_path):
    bundle = make_bundle(tmp_path, 4000, 16, clustered=True)
    index = ClassIndex.open(bundle, tmp_path / "cache", device="cpu", kind="hnsw", min_speedup=0, hnsw_m=16)
    assert index.kind == "hnsw"
    h = np.random.default_rng(6).standard_normal((100, 16)).astype(np.float32)
    _, ids = index.search(h, 10)
    assert recall(ids, brute_force(bundle, h, 10)[1]) >= 0.95


def test_cache_reuse_loads_without_rebuilding(tmp_path):
    bundle = make_bundle(tmp_path, 5000, 16, clustered=True)
    cache = tmp_path / "cache"
    builds = ClassIndex.builds
    first = ClassIndex.open(bundle, cache, device="cpu", kind="ivf", min_speedup=0)
    assert ClassIndex.builds == builds + 1 and not first.info()["loaded_from_cache"]
    files = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert any(name.endswith(".npz") for name in files) and not any(".tmp" in name for name in files)

    second = ClassIndex.open(bundle, cache, device="cpu", kind="ivf", min_speedup=0)
    assert ClassIndex.builds == builds + 1 and second.info()["loaded_from_cache"]
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == files
    assert second.info()["nprobe"] == first.info()["nprobe"] and second.recall_at_k == first.recall_at_k
    h = np.random.default_rng(3).standard_normal((20, 16)).astype(np.float32)
    for a, b in zip(first.search(h, 5), second.search(h, 5)):
        np.testing.assert_array_equal(a, b)

    other = make_bundle(tmp_path, 5000, 16, clustered=True, seed=1)  # another digest: its own entry
    ClassIndex.open(other, cache, device="cpu", kind="ivf", min_speedup=0)
    assert ClassIndex.builds == builds + 2


def test_index_not_worth_it_falls_back_to_exact_and_remembers(tmp_path):
    bundle = make_bundle(tmp_path, 4000, 16, clustered=False)
    builds = ClassIndex.builds
    index = ClassIndex.open(bundle, tmp_path / "cache", device="cpu", kind="ivf", recall_target=1.01, min_speedup=0)
    assert index.kind == "exact" and "fallback_reason" in index.info()
    h = np.random.default_rng(4).standard_normal((9, 16)).astype(np.float32)
    want_logits, want_ids = brute_force(bundle, h, 10)
    logits, ids = index.search(h, 10)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(logits, want_logits)
    again = ClassIndex.open(bundle, tmp_path / "cache", device="cpu", kind="ivf", recall_target=1.01, min_speedup=0)
    assert again.kind == "exact" and ClassIndex.builds == builds + 1


def test_recall_queries_come_from_samples_npz(tmp_path):
    bundle = make_bundle(tmp_path, 3000, 8, clustered=True)
    emb = np.random.default_rng(9).standard_normal((12, 8)).astype(np.float32) + 3.0
    np.savez(bundle.path / "samples.npz", input=np.zeros((12, 4), np.float32), embedding=emb)
    index = ClassIndex.open(bundle, tmp_path / "cache", device="cpu", kind="ivf", min_speedup=0)
    assert index.info()["recall_queries"] == "samples.npz"


def test_serving_index_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, serving.core.class_index, serving.gallery; sys.exit(int('torch' in sys.modules))"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_ivf_finds_high_bias_rows_when_the_bias_dominates(tmp_path):
    """Biases spread wider than W·h put the top logits in high-bias rows of many directions:
    cells by direction alone miss them; the bias-banded cells must still reach the recall."""
    rng = np.random.default_rng(11)
    num, dim = 30_000, 32
    centers = rng.standard_normal((300, dim))
    weight = (centers[rng.integers(0, 300, num)] + 0.5 * rng.standard_normal((num, dim))) / np.sqrt(1.25 * dim)
    bias = 0.1 * rng.standard_normal(num)  # sd 0.1 vs sd(W·h) ~ 0.18 / sqrt(dim) for unit h
    path = tmp_path / "biased"
    path.mkdir()
    np.save(path / "head_weight.npy", weight.astype(np.float32))
    np.save(path / "head_bias.npy", bias.astype(np.float32))
    bundle = types.SimpleNamespace(path=path, weight=np.load(path / "head_weight.npy", mmap_mode="r"),
                                   bias=np.load(path / "head_bias.npy", mmap_mode="r"), embed_dim=dim,
                                   num_classes=num, digest="biased")
    index = ClassIndex.open(bundle, tmp_path / "cache", device="cpu", kind="ivf", min_speedup=0, nlist=256)
    assert index.kind == "ivf" and index.info()["bias_scale"] > 1
    h = rng.standard_normal((200, dim))
    h = (h / np.linalg.norm(h, axis=1, keepdims=True)).astype(np.float32)  # unit embeddings, like an L2-normalised backbone
    _, ids = index.search(h, 10)
    truth = brute_force(bundle, h, 10)[1]
    assert recall(ids, truth) >= 0.95
    assert index.info()["nprobe"] < index.info()["nlist"] // 2  # an index, not a scan of everything


def test_recall_is_tuned_on_backbone_embeddings_of_random_inputs(tmp_path):
    """With a backbone.onnx the tuning queries are what the server embeds; recall holds on fresh ones."""
    ort = pytest.importorskip("onnxruntime")
    from serving.bundle import load_bundle
    from serving.bundle.synthetic import build_synthetic_bundle

    path = build_synthetic_bundle(classes=20_000, dim=32, input_dim=8, seed=3, out=tmp_path / "synthetic")
    bundle = load_bundle(path, False)
    index = ClassIndex.open(bundle, tmp_path / "cache", device="cpu", kind="ivf", min_speedup=0)
    assert index.kind == "ivf" and index.info()["recall_queries"].startswith("backbone.onnx")
    x = np.random.default_rng(99).standard_normal((150, 8)).astype(np.float32)
    h = ort.InferenceSession(str(path / "backbone.onnx"), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    _, ids = index.search(h, 10)
    assert recall(ids, brute_force(bundle, h, 10)[1]) >= 0.95


def test_engine_searches_the_index_once_per_batch(tmp_path):
    """All topk-index jobs of a batch share one search (largest k); each gets its own rows, best first."""
    from serving.core.batcher import Job
    from serving.core.engine import Engine

    bundle = make_bundle(tmp_path, 3000, 16, clustered=False)
    index = ClassIndex.open(bundle, tmp_path / "cache", device="cpu", kind="exact")
    calls = []

    class CountingIndex:
        def search(self, h, k):
            calls.append((h.shape[0], k))
            return index.search(h, k)

    engine = Engine.__new__(Engine)  # no runtime or batcher: the backbone is the identity here
    engine.index = CountingIndex()
    engine.head_pass = types.SimpleNamespace(needs_embedding=True)  # no pass in this batch
    engine.runtime = types.SimpleNamespace(embed=lambda x, one_thread=False: np.asarray(x, np.float32))
    rng = np.random.default_rng(8)
    hs = [rng.standard_normal((n, 16)).astype(np.float32) for n in (3, 1, 4)]

    def topk_reduce(k):
        def reduce(found):
            logits, ids = found
            return logits[:, :k], ids[:, :k]
        return reduce

    # a job carries its parameters (its k), not its reduce function
    jobs = [Job(x=hs[0], kind="index", reduce=topk_reduce(5), k=5), Job(x=hs[1], kind="embed"),
            Job(x=hs[2], kind="index", reduce=topk_reduce(12), k=12)]
    results = engine._compute(jobs)
    assert calls == [(7, 12)]
    for h, k, (logits, ids) in ((hs[0], 5, results[0]), (hs[2], 12, results[2])):
        want_logits, want_ids = brute_force(bundle, h, k)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(logits, want_logits)
    np.testing.assert_array_equal(results[1], hs[1])


def test_an_automatic_choice_tries_hnsw_when_ivf_is_not_worth_it(monkeypatch):
    """Above EXACT_MAX_CLASSES: ivf first; if its tuning falls back to exact, hnsw; ivf kept when it holds."""
    import types

    from serving.core import class_index as index_mod

    asked = []

    def fake_open(cls, bundle, cache_dir, device, kind, **params):
        asked.append(kind)
        return types.SimpleNamespace(meta=types.SimpleNamespace(kind=outcome[kind]))

    monkeypatch.setattr(index_mod.ClassIndex, "_open_kind", classmethod(fake_open))
    big = types.SimpleNamespace(weight=np.zeros((index_mod.EXACT_MAX_CLASSES + 1, 2), np.float32))
    outcome = {"ivf": "exact", "hnsw": "hnsw"}
    assert index_mod.ClassIndex.open(big, None).meta.kind == "hnsw" and asked == ["ivf", "hnsw"]
    asked.clear()
    outcome = {"ivf": "ivf", "hnsw": "hnsw"}
    assert index_mod.ClassIndex.open(big, None).meta.kind == "ivf" and asked == ["ivf"]
    asked.clear()
    small = types.SimpleNamespace(weight=np.zeros((10, 2), np.float32))
    outcome = {None: "flat"}
    assert index_mod.ClassIndex.open(small, None).meta.kind == "flat" and asked == [None]


def test_ivf_without_codes_holds_ids_not_rows(tmp_path):
    """The default ivf keeps 4 bytes per class and its probe vectors: no copy of the rows."""
    bundle = make_bundle(tmp_path, 20_000, 32, clustered=True)
    lists = ClassIndex.open(bundle, tmp_path / "a", device="cpu", kind="ivf", min_speedup=0)
    sq4 = ClassIndex.open(bundle, tmp_path / "b", device="cpu", kind="ivf", min_speedup=0, codes="sq4")
    nlist = lists.info()["nlist"]
    assert lists.info()["codes"] == "none"
    assert lists.info()["index_mb"] * 2**20 <= 20_000 * 4 + (nlist + 1) * 8 + nlist * 33 * 4 + 2**20 * 0.05
    assert lists.info()["index_mb"] < sq4.info()["index_mb"]


def test_class_cells_score_the_probed_cells_exactly(tmp_path):
    """Against brute force over the classes of the probed cells (float64): the r best of them."""
    from serving.core.class_cells import HeadLists

    bundle = make_bundle(tmp_path, 3000, 12, clustered=True)
    rng = np.random.default_rng(7)
    assign = rng.integers(0, 40, 3000)
    lists = HeadLists.from_assignment(assign, rng.standard_normal((40, 13)).astype(np.float32), bias_scale=2.0)
    lists.nprobe = 3
    h = rng.standard_normal((25, 12)).astype(np.float32)
    logits, ids = lists.search(bundle.weight, bundle.bias, h, r=7)
    w, b = np.asarray(bundle.weight, np.float64), np.asarray(bundle.bias, np.float64)
    for i, cells in enumerate(lists.cells(h)):
        members = np.flatnonzero(np.isin(assign, cells))
        z = w[members] @ h[i].astype(np.float64) + b[members]
        want = members[np.argsort(-z, kind="stable")[:7]]
        assert set(ids[i]) == set(want)
        np.testing.assert_allclose(logits[i], w[ids[i]] @ h[i].astype(np.float64) + b[ids[i]], rtol=1e-5, atol=1e-5)
    q = np.column_stack([h, np.full(25, 0.5, np.float32)]).astype(np.float64)  # [h, 1/s]
    best_cells = np.argsort(-(q @ lists.probe.T.astype(np.float64)), axis=1)[:, :3]
    assert all(set(a) == set(b) for a, b in zip(lists.cells(h), best_cells))


def test_class_cells_pad_when_the_probed_cells_are_small(tmp_path):
    from serving.core.class_cells import HeadLists

    bundle = make_bundle(tmp_path, 50, 4, clustered=False)
    lists = HeadLists.from_assignment(np.arange(50) % 10, np.eye(10, 5, dtype=np.float32), bias_scale=1.0)
    logits, ids = lists.search(bundle.weight, bundle.bias, np.ones((2, 4), np.float32), r=8)  # one cell: 5 classes
    assert (ids[:, 5:] == -1).all() and np.isneginf(logits[:, 5:]).all() and (ids[:, :5] >= 0).all()


def test_a_damaged_lists_cache_is_rebuilt(tmp_path):
    bundle = make_bundle(tmp_path, 5000, 16, clustered=True)
    cache = tmp_path / "cache"
    first = ClassIndex.open(bundle, cache, device="cpu", kind="ivf", min_speedup=0)
    (npz,) = cache.glob("*.npz")
    npz.write_bytes(npz.read_bytes()[:100])
    builds = ClassIndex.builds
    again = ClassIndex.open(bundle, cache, device="cpu", kind="ivf", min_speedup=0)
    assert ClassIndex.builds == builds + 1 and not again.info()["loaded_from_cache"]
    h = np.random.default_rng(3).standard_normal((20, 16)).astype(np.float32)
    for a, b in zip(first.search(h, 5), again.search(h, 5)):
        np.testing.assert_array_equal(a, b)


def test_a_cached_lists_index_and_an_empty_gallery_never_import_faiss(tmp_path):
    """faiss costs the server about 13 MiB: a process that opens a cached ivf of class ids (and an
    empty gallery) must not load it; building the index does."""
    import subprocess
    import sys

    bundle = make_bundle(tmp_path, 5000, 16, clustered=True)
    ClassIndex.open(bundle, tmp_path / "cache", device="cpu", kind="ivf", min_speedup=0)
    code = f"""
import sys, types, numpy as np
from serving.core.class_index import ClassIndex
from serving.gallery.range_search import VectorIndex
p = {str(bundle.path)!r}
b = types.SimpleNamespace(path=None, weight=np.load(p + "/head_weight.npy", mmap_mode="r"),
                          bias=np.load(p + "/head_bias.npy", mmap_mode="r"), digest={bundle.digest!r})
index = ClassIndex.open(b, {str(tmp_path / 'cache')!r}, device="auto", kind="ivf", min_speedup=0)
assert index.info()["loaded_from_cache"] and index.kind == "ivf"
index.search(np.ones((3, 16), np.float32), 5)
g = VectorIndex(16)
assert g.ntotal == 0 and len(g.search(np.ones(16), 0.0, 0.0, None)[0]) == 0
print("faiss" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
