"""The prepared GPU check on the CPU: the onnxruntime peer (tools/bench/ort_peer.py) answers as slc and
float64 numpy do for the same bundle and inputs; `slc bench gpu` prints one line and exits 0 without
CUDA; a budget too small for anything lists what it skipped; and the whole check runs end to end on
the CPU provider at a tiny D (`--device cpu`, a smoke run: its figures are not asserted)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def peer(bundle_path):
    from fastapi.testclient import TestClient

    from tools.bench.ort_peer import create_peer_app

    with TestClient(create_peer_app(bundle_path, "cpu")) as c:
        yield c


def test_the_peer_answers_as_slc_and_numpy_do(peer, client, offline, inputs, bundle):
    """detect (single.onnx + calibration.json), softmax p(j) and exact top-k (full.onnx + numpy): the same
    logits, probabilities and ids as slc's answers, and as float64 numpy over the bundle's rows."""
    z = offline.logits(inputs)  # [N, D] float64
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    body = {"inputs": inputs.tolist()}
    assert peer.get("/v1/model").json()["providers"] == ["CPUExecutionProvider"]
    for j in (0, 3, bundle.num_classes - 1):
        name = bundle.classes[j]
        ours, theirs = (c.post(f"/v1/classes/{name}/detect", json=body).json() for c in (client, peer))
        assert theirs["class_id"] == ours["class_id"] == j
        assert theirs["threshold"] == pytest.approx(ours["threshold"], abs=1e-6)
        for a, b, zi in zip(ours["results"], theirs["results"], z[:, j]):
            assert b["logit"] == pytest.approx(a["logit"], rel=1e-5, abs=1e-5) == pytest.approx(zi, rel=1e-4, abs=1e-4)
            assert b["probability"] == pytest.approx(a["probability"], rel=1e-4, abs=1e-6)
            assert b["match"] == a["match"] or abs(zi - ours["threshold"]) < 1e-4
        ours, theirs = (c.post(f"/v1/classes/{name}/softmax", json=body).json() for c in (client, peer))
        for a, b, pi, top in zip(ours["results"], theirs["results"], p[:, j], z.argmax(1) == j):
            assert b["probability"] == pytest.approx(a["probability"], rel=1e-4, abs=1e-9)
            assert b["probability"] == pytest.approx(pi, rel=1e-4, abs=1e-9)
            assert b["is_top1"] == a["is_top1"] == bool(top)
    body["k"], body["mode"] = 5, "exact"
    ours, theirs = (c.post("/v1/topk", json=body).json()["results"] for c in (client, peer))
    for a, b, zi in zip(ours, theirs, z):
        assert [e["class_id"] for e in b] == [e["class_id"] for e in a] == np.argsort(-zi)[:5].tolist()
        assert np.allclose([e["logit"] for e in b], [e["logit"] for e in a], rtol=1e-5, atol=1e-5)


def test_an_unknown_class_is_404_at_the_peer(peer):
    assert peer.post("/v1/classes/no-such-class/softmax", json={"inputs": [[0.0]]}).status_code == 404


def test_without_cuda_the_check_prints_one_line_and_exits_0(tmp_path):
    """CUDA_VISIBLE_DEVICES="" hides any GPU, so this path is taken on every machine."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", SLC_HOME=str(tmp_path / "home"))
    result = subprocess.run([sys.executable, "-m", "slc", "bench", "gpu", "--out", str(tmp_path / "out")], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.splitlines()
    assert line.startswith("gpu-check: no CUDA device") and line.endswith("nothing measured")
    assert not (tmp_path / "out" / "gpu-bench.json").exists()


def test_the_correctness_phase_reports_gpu_checks_own_line(tmp_path, monkeypatch):
    """tools/gpu_check.py run as the first phase; here (no CUDA for torch) its one line, exit 0."""
    from tools.bench import gpu_suite

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the subprocess inherits it: torch sees no GPU anywhere
    res = gpu_suite.correctness("cuda", 300, tmp_path)
    assert res["rc"] == 0 and res["summary"].startswith("gpu-check: no CUDA device"), res


def test_a_budget_too_small_skips_every_measurement_and_says_which(tmp_path, monkeypatch):
    from tools.bench import gpu_suite

    monkeypatch.setenv("SLC_HOME", str(tmp_path / "home"))
    seen = []
    res = gpu_suite.run_suite("cpu", [300, 100], 8, ("float32", "int8"), 0.2, budget_s=5.0, check=True,
                              log_dir=tmp_path, peer_max_classes=10**7,
                              correctness_fn=lambda device, timeout, work: seen.append(timeout) or {
                                  "rc": 0, "summary": "gpu-check: all 3 checks passed", "seconds": 0.0})
    assert res["rows"] == [] and res["correctness"]["rc"] == 0 and 0 < seen[0] <= 5.0
    assert [s.split(":")[0] for s in res["skipped"]] == ["D=300 float32", "D=100 float32", "D=300 int8", "D=100 int8"]
    md = gpu_suite.suite_markdown(res, "slc bench gpu --device cpu")
    assert "not measured" in md and "D=300 float32: needs about" in md and "all 3 checks passed" in md


@pytest.mark.integration  # about 35 s on two cores
def test_the_whole_check_runs_on_the_cpu_provider_at_a_tiny_d(tmp_path):
    """`slc bench gpu --device cpu`: slc in float32 and int8 and the peer, each measured; the breakdown;
    the report's sections. The correctness phase is tools/gpu_check.py's own (tests/tools/test_gpu_check.py)."""
    from tools.bench import gpu_suite

    env = dict(os.environ, SLC_HOME=str(tmp_path / "home"))
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "slc", "bench", "gpu", "--device", "cpu", "--no-check",
                             "--classes", "2000", "--precision", "float32,int8", "--duration", "0.3", "--out", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    res = json.loads((out / "gpu-bench.json").read_text())
    servers = [(r["classes"], r["precision"], s["server"]) for r in res["rows"] for s in r["servers"]]
    assert servers == [(2000, "float32", "slc"), (2000, "float32", "ort-peer"), (2000, "int8", "slc")]
    for r in res["rows"]:
        for s in r["servers"]:
            assert "error" not in s and s["errors"] == 0 and s["saturated_softmax_rps"] > 0, s
    slc_int8 = res["rows"][1]["servers"][0]
    assert slc_int8["chosen"]["head_precision"]["served"] == "int8"
    assert slc_int8["chosen"]["softmax_impl"] == "device"  # the device pass's graphs on the CPU provider
    b = res["breakdown"]
    assert b["classes"] == 2000 and b["device_pass_softmax_1_ms"] > 0 and "unlocated_ms" in b
    assert set(b["passes"]) == {"float32", "int8"}
    assert gpu_suite.auto_choice(res, 2000) in ("float32", "int8")  # the int8 server timed float32 beside it
    md = (out / "gpu-bench.md").read_text()
    assert set(res["rows"][0]["servers"][0]["saturated_softmax_cpu"]["cores"]) == {"loop", "workers", "client"}
    for section in ("## Side by side", "## slc by head precision", "taken apart", "## What bounds", "## Issue 52's goals"):
        assert section in md
    assert res["skipped"] == []


def _fake_row(D: int, precision: str, softmax_ms: float, cost_ms: dict | None = None) -> dict:
    server = {"server": "slc", "p50_ms": {"detect": 0.5, "softmax": softmax_ms, "topk_exact": 1.0, "all_logits": 2.0},
              "saturated_softmax_rps": 100.0, "chosen": {"providers": ["CUDAExecutionProvider"],
                                                         "head_precision": {"cost_ms_per_input": cost_ms or {}}}}
    return {"classes": D, "precision": precision, "servers": [server]}


@pytest.mark.parametrize("int8_cost,verdict", [(0.05, "**no**"), (0.3, "not measured")])
def test_the_int8_goal_reads_what_auto_would_serve_from_the_warm_up_costs(int8_cost, verdict):
    """The int8 server's warm-up timed float32 beside it: where auto would pick int8 but its HTTP softmax is
    slower than float32's, the goal is missed; where auto keeps float32, int8 is never chosen."""
    from tools.bench import gpu_suite

    res = {"rows": [_fake_row(10**6, "float32", 1.5),
                    _fake_row(10**6, "int8", 2.0, {"float32": 0.1, "int8": int8_cost})]}
    assert gpu_suite.auto_choice(res, 10**6) == ("int8" if int8_cost < 0.1 else "float32")
    row = next(g for g in gpu_suite.goals(res) if g[0].startswith("int8 / bf16 never slower"))
    assert row[2] == verdict
