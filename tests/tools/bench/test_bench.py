"""tools.bench: the bundle cache, the head kernels against float64 numpy, the process-tree
memory against /proc, and the whole `slc bench scale` pipeline on tiny D (slow)."""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

pytestmark = pytest.mark.integration  # real processes, sockets or files


def test_bench_bundle_cache_key_holds_rows_kind_and_builder(tmp_path, monkeypatch):
    """The bench never reuses a cached synthetic bundle of another rows kind (the index's worst case)."""
    import json

    from tools.bench import run as bench

    monkeypatch.setenv("SLC_HOME", str(tmp_path))
    clustered = bench.cached_bundle(12, 8, rows="clustered")
    gaussian = bench.cached_bundle(12, 8, rows="gaussian")
    assert clustered != gaussian and bench.synthetic_builder_version() in clustered.name
    for path, rows in ((clustered, "clustered"), (gaussian, "gaussian")):
        assert json.loads((path / "manifest.json").read_text())["training"]["rows"] == rows
    assert bench.cached_bundle(12, 8) == clustered  # the default, reused


@pytest.mark.slow
def test_scale_bench_end_to_end_small(tmp_path, monkeypatch):
    """The whole `slc bench scale` pipeline on two tiny D: three result files, consistent numbers."""
    from tools.bench import run as bench
    from tools.bench.server import grpc_available

    monkeypatch.setenv("SLC_HOME", str(tmp_path / "home"))
    res = bench.run_scale_bench([5, 40], dim=8, duration=0.3, out=tmp_path / "out", default_model=False)
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"scale.json", "scale.md", "scale.png"}
    data = json.loads((tmp_path / "out" / "scale.json").read_text())
    assert [r["classes"] for r in data["rows"]] == [5, 40]
    for r in data["rows"]:
        assert r["head_bytes"] == r["classes"] * 8 * 4 + r["classes"] * 4
        assert r["recall"]["recall_at_k"] == 1.0  # tiny D: the index is exact (flat)
        protocols = ("v2", "v2_binary") + (("grpc",) if grpc_available() else ())
        for ep in ("detect", "softmax", "topk_exact", "topk_index", "live") + protocols:
            assert r["slc"]["closed"][ep]["errors"] == {}, (r["classes"], ep)
            assert r["slc"]["closed"][ep]["requests"] > 0, (r["classes"], ep)
        for ep in ("detect",) + protocols:  # the protocols' own one-connection run
            assert r["slc"]["protocols_single"][ep]["errors"] == {} and r["slc"]["protocols_single"][ep]["requests"] > 0
        for key, conns in (("softmax_saturated", 128), ("softmax_one_batch", 64)):
            assert r[key]["errors"] == {} and r[key]["requests"] > 0 and r[key]["concurrency"] == conns
        assert r["peer"]["closed"]["softmax"]["errors"] == {}
        assert r["memory"]["loaded_rss"] > 0
    assert "slc bench scale --classes 5,40" in (tmp_path / "out" / "scale.md").read_text()
    assert res["targets"]


def test_process_tree_memory_sums_the_tree():
    """A shell with one child: the tree's RSS is the sum of both /proc/PID/status VmRSS."""
    import subprocess

    from tools.bench.server import process_tree_memory

    proc = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    try:
        child = None
        def parent_of(pid):
            try:
                return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # the process ended meanwhile
                return None

        for _ in range(100):
            kids = [p for p in os.listdir("/proc") if p.isdigit() and parent_of(p) == proc.pid]
            if kids:
                child = int(kids[0])
                break
            time.sleep(0.05)
        assert child is not None

        def rss(pid):
            line = next(x for x in open(f"/proc/{pid}/status") if x.startswith("VmRSS:"))
            return int(line.split()[1]) * 1024

        got = process_tree_memory(proc.pid)
        assert got["processes"] == 2
        assert got["rss"] == rss(proc.pid) + rss(child)  # idle processes: stable between the two reads
    finally:
        proc.kill()
        proc.wait()


def test_head_kernels_compute_the_right_logits(tmp_path):
    """What head_alone times are the logits of the bundle rows (float64 reference), one or all."""
    from tools.bench.head import head_alone, head_kernels

    rng = np.random.default_rng(0)
    W = rng.standard_normal((30, 8)).astype(np.float32)
    b = rng.standard_normal(30).astype(np.float32)
    H = rng.standard_normal((4, 8)).astype(np.float32)
    ids = rng.integers(0, 30, 4)
    ref = H.astype(np.float64) @ W.T.astype(np.float64) + b  # [4, 30]
    k = head_kernels(W, b, H, ids)
    assert k["one_logit_single"]() == pytest.approx(ref[0, ids[0]], rel=1e-5)
    np.testing.assert_allclose(k["one_logit_batch"](), ref[np.arange(4), ids], rtol=1e-5)
    np.testing.assert_allclose(k["all_logits_single"](), ref[:1], rtol=1e-5)
    np.testing.assert_allclose(k["all_logits_batch"](), ref, rtol=1e-5)
    p = np.exp(ref - ref.max(1, keepdims=True))
    np.testing.assert_allclose(k["softmax_batch"](), p / p.sum(1, keepdims=True), rtol=1e-5)
    np.save(tmp_path / "head_weight.npy", W)
    np.save(tmp_path / "head_bias.npy", b)
    out = head_alone(tmp_path, batch=4)
    assert set(out) >= {"one_logit_per_input_single_us", "all_logits_per_input_batch64_us", "all_over_one_batch64"}


@pytest.mark.slow
def test_fuzz_verdict_on_a_real_server(bundle_path, tmp_path):
    """`slc bench fuzz`'s run on a real server: no 5xx, every response on its schema, no undocumented status."""
    from tools.bench.fuzz import run_fuzz
    from tools.bench.server import slc_server

    with slc_server(bundle_path, tmp_path, "fuzz", tmp_path / "data") as srv:
        srv.wait_ready(120)
        res = run_fuzz(srv.url, 20, 1, tmp_path)
    assert res["operations"]["tested"] >= 15 and res["test_cases"]["generated"] > 100
    assert res["passed"], (res["verdict"], res["output_tail"][-2000:])


@pytest.mark.slow
def test_mixed_bench_measures_detect_alone_and_beside_softmax_on_both_servers(bundle_path, tmp_path):
    """`slc bench mixed` on the test bundle: each server answered detect in both phases and the
    softmax load ran; the report names both settings."""
    from tools.bench.mixed import SETTINGS, mixed_markdown, run_mixed

    phases = []
    r = run_mixed(bundle_path, tmp_path, duration=0.5, softmax_concurrency=4, rounds=1, progress=phases.append)
    assert len(phases) == len(SETTINGS) and set(r["servers"]) == set(SETTINGS)
    for name, s in r["servers"].items():
        assert s["concurrent_batches"] == int(SETTINGS[name])
        assert s["detect_alone"]["count"] > 0 and s["detect_beside_softmax"]["count"] > 0 and s["softmax_rps"] > 0
        assert 0 < s["detect_beside_softmax"]["p50"] <= s["detect_beside_softmax"]["p99"]
    md = mixed_markdown(r, "slc bench mixed", 50)
    assert "SLC_CONCURRENT_BATCHES=1" in md and "SLC_CONCURRENT_BATCHES=2" in md


def test_routes_bench_drives_each_route_and_gets_the_answers_a_client_gets(bundle_path, tmp_path, client_factory):
    """`slc bench routes` times real answers: its first answer on each route equals what an HTTP
    client gets for the same request from another app on the same bundle."""
    from tools.bench.routes import ROUTES, measure_routes, requests_for, routes_markdown

    ticks = []
    r = measure_routes(bundle_path, ROUTES, rounds=2, requests=3, progress=lambda: ticks.append(1))
    assert len(ticks) == 2 * len(ROUTES) and set(r["best_us"]) == set(ROUTES)
    assert all(len(v) == 2 and min(v) > 0 for v in r["all_us"].values())
    client = client_factory()
    for route, (method, path, body, headers) in requests_for(client.app.state.slc.engine, ROUTES).items():
        answer = client.request(method, path, content=body, headers=headers)
        assert answer.status_code == 200
        assert _same_answer(answer.content, r["first_answers"][route].encode("latin-1"), answer.headers), route
    assert "| v2 |" in routes_markdown(r, "slc bench routes")


def _same_answer(a: bytes, b: bytes, headers) -> bool:
    """Equal JSON (numbers to 1e-5: the two apps may run the backbone on different sessions), or for a
    binary v2 answer an equal JSON header and raw outputs."""
    import orjson

    if "inference-header-content-length" in headers:
        cut = int(headers["inference-header-content-length"])
        return a[:cut] == b[:cut] and np.allclose(np.frombuffer(a[cut:cut + 4], "<f4"), np.frombuffer(b[cut:cut + 4], "<f4"),
                                                  rtol=1e-5) and a[cut + 4:] == b[cut + 4:]
    return _close(orjson.loads(a), orjson.loads(b))


def _close(x, y) -> bool:
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_close(x[k], y[k]) for k in x)
    if isinstance(x, list):
        return isinstance(y, list) and len(x) == len(y) and all(_close(u, v) for u, v in zip(x, y))
    if isinstance(x, float) and not isinstance(y, bool):
        return bool(np.isclose(x, y, rtol=1e-5, atol=1e-7))
    return x == y


def test_enroll_bench_enrolls_them_all_and_meets_the_limit_and_a_race(tmp_path, monkeypatch):
    """slc bench enroll at toy size: every enrollment 201 and served, the probe answered throughout,
    one past the limit is 507 enrolled_limit, a race on one name leaves one class (one 201)."""
    from tools.bench.enroll_scale import enroll_markdown, run_enroll_bench

    monkeypatch.setenv("SLC_HOME", str(tmp_path / "home"))
    r = run_enroll_bench(classes=500, enroll=12, examples=3, duration=0.3, negatives=32, log_dir=tmp_path, dim=16)
    assert r["statuses"] == {201: 12} and r["served_enrolled"] == 12 and r["rule"] == "fitted"
    assert r["enroll_ms"]["n"] == 12 and not r["probe_errors"] and r["probe_ms"]["alone"]["n"] > 0
    assert r["back_to_back"] + r["paced"] == 12 and r["paced"] == 6
    assert r["abuse"]["over_limit"] == {"status": 507, "code": "enrolled_limit"}
    assert r["abuse"]["same_name_statuses"].count(201) == 1 and r["abuse"]["same_name_classes"] == 1
    assert "12 classes enrolled into a 500-class server" in enroll_markdown(r, "slc bench enroll")
