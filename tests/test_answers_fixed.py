"""Answers must not move: every threshold rule, the rule choosers, row adaptation, the defaults each
command applies, and a served bundle's answers, recorded before calibration became one package and
compared after (tests/fixtures/answers.json; SLC_RECORD_ANSWERS=1 writes it again, for a change that
means to move them). The served answers are asked over HTTP and again over gRPC (KServe v2, the
unmodified tritonclient): both must be the recorded ones.

The logits are exact: embeddings and rows are small multiples of 1/8, so h·W + b is the same float64
number on every processor, and the rules see the same input wherever the test runs."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

FIXTURE = Path(__file__).parent / "fixtures" / "answers.json"
D, N, DIM = 12, 240, 8
TARGETS = ({"precision": 0.9}, {"recall": 0.8})
RULES = ({"name": "per_class"}, {"name": "global"}, {"name": "shrink", "kappa": 4.0}, {"name": "tail"}, {"name": "norm"})


def data(seed: int):
    """(h [N, d], y [N], W [D, d], b [D]): every value a multiple of 1/8."""
    rng = np.random.default_rng(seed)
    W = rng.integers(-8, 9, (D, DIM)) / 8
    b = rng.integers(-4, 5, D) / 8
    y = np.repeat(np.arange(D), N // D)
    h = rng.integers(-6, 7, (N, DIM)) / 8 + W[y] * rng.integers(1, 4, (N, 1))
    return h, y, W, b


def rounded(obj):
    """Floats to 9 significant digits (a processor's last bits aside), recursively."""
    if isinstance(obj, dict):
        return {k: rounded(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [rounded(v) for v in obj]
    if isinstance(obj, (float, np.floating)):
        return float(f"{float(obj):.9g}")
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(rounded(obj), sort_keys=True, default=float).encode()).hexdigest()


def thresholds_of(cal: dict) -> list:
    return rounded([e["threshold"] for e in cal["per_class"]])


def rule_answers() -> dict:
    from serving.calibration.estimator import calibrate

    h, y, W, b = data(0)
    ht, yt, _, _ = data(1)
    z, zt = h @ W.T + b, ht @ W.T + b
    out = {}
    for target in TARGETS:
        for rule in RULES:
            if rule["name"] == "tail" and "recall" in target:
                continue
            cal = calibrate(z, y, target, zt, yt, method=rule)
            out[f"{rule['name']}@{json.dumps(target)}"] = {"thresholds": thresholds_of(cal), "digest": digest(cal)}
    return out


def chooser_answers() -> dict:
    from serving.calibration.chunks import dense_chunks
    from serving.calibration.defaults import default_rule as default_method
    from serving.calibration.choose import choose

    h, y, W, b = data(2)
    z = h @ W.T + b
    out = {}
    for target in TARGETS:
        method, record = choose(lambda rows: dense_chunks(z[rows], D), y, D, target)
        out[f"cv@{json.dumps(target)}"] = {"method": method, "digest": digest(record)}
    out["export_default"] = {f"pols={p},shift={s}": default_method(p, s) for p in (True, False)
                             for s in ("style", "none")}
    return out


def adapt_answers() -> dict:
    from serving.calibration.adapt import choose_beta, thresholds

    h, y, W, b = data(3)
    out = {}
    for target in TARGETS:
        beta, record = choose_beta(h, y, W, b, target)
        rows, t = thresholds(h, y, W, b, beta, target)
        out[json.dumps(target)] = {"beta": beta, "record": digest(record), "thresholds": rounded(list(t)),
                                   "rows": digest(np.asarray(rows[:]).tolist())}
    return out


def recalibrate_defaults() -> dict:
    from serving.settings import Settings
    from serving.calibration.options import resolve_options

    old = {"target": {"precision": 0.95}, "method": {"name": "shrink", "kappa": 3.0}}
    opts = resolve_options(old, None, None, None, None, False)
    s = Settings()
    return {"calibrate": {"target": opts.target, "method": opts.method},
            "enroll": {"rule": s.enroll_rule, "threshold": s.enroll_threshold}}


def served_answers(tmp_path: Path) -> dict:
    """A synthetic bundle served in-process: detect, softmax, top-k (exact, index), v2 full; values to 6 digits."""
    from fastapi.testclient import TestClient

    from serving.bundle.synthetic import build_synthetic_bundle
    from serving.http.app import create_app
    from tests.serving.helpers import make_settings, wait_ready

    bundle = build_synthetic_bundle(classes=40, dim=16, input_dim=8, seed=5, out=tmp_path / "b")
    x = np.random.default_rng(9).standard_normal((4, 8)).round(3).astype(np.float32)
    r6 = lambda v: float(f"{v:.6g}")  # noqa: E731
    with TestClient(create_app(make_settings(bundle, tmp_path))) as c:
        wait_ready(c.get)
        det = c.post("/v1/classes/3/detect", json={"inputs": x.tolist()}).json()
        soft = c.post("/v1/classes/3/softmax", json={"inputs": x.tolist()}).json()
        tops = {m: c.post("/v1/topk", json={"inputs": x.tolist(), "k": 5, "mode": m}).json() for m in ("exact", "index")}
    return {"detect": [(r6(r["logit"]), r["match"], r6(r["probability"])) for r in det["results"]],
            "threshold": r6(det["threshold"]),
            "softmax": [(r6(r["probability"]), r["is_top1"]) for r in soft["results"]],
            "topk": {m: [[(e["class_id"], r6(e["logit"])) for e in row] for row in t["results"]] for m, t in tops.items()}}


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> dict:
    return {"rules": rule_answers(), "choosers": chooser_answers(), "adapt": adapt_answers(),
            "defaults": recalibrate_defaults(), "served": served_answers(tmp_path_factory.mktemp("served"))}


def test_answers_are_those_recorded(answers):
    got = json.loads(json.dumps(answers, default=float))  # tuples as lists, numpy scalars as floats
    if os.environ.get("SLC_RECORD_ANSWERS") == "1":
        FIXTURE.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(FIXTURE.read_text())
    for part in want:
        assert got[part] == want[part], part


def grpc_answers(tmp_path: Path) -> dict:
    """The served bundle of `served_answers` asked over KServe v2 gRPC: detect of class 3 (the single-logit
    model) and the exact top 5 (the full model's classification output), to 6 digits."""
    grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[grpc]'")
    from serving.bundle.synthetic import build_synthetic_bundle
    from serving.main import build
    from tests.serving.helpers import free_port, make_settings, uvicorn_in_thread

    bundle = build_synthetic_bundle(classes=40, dim=16, input_dim=8, seed=5, out=tmp_path / "b")
    x = np.random.default_rng(9).standard_normal((4, 8)).round(3).astype(np.float32)
    r6 = lambda v: float(f"{v:.6g}")  # noqa: E731
    port = free_port()
    with uvicorn_in_thread(build(make_settings(bundle, tmp_path, grpc_port=port))[0]):
        client = grpcclient.InferenceServerClient(url=f"127.0.0.1:{port}")
        name = json.loads((bundle / "manifest.json").read_text())["name"]
        inp = grpcclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        ids = grpcclient.InferInput("class_id", [4], "INT64")
        ids.set_data_from_numpy(np.full(4, 3, dtype=np.int64))
        one = client.infer(name, [inp, ids])
        full = client.infer(name + "-full", [inp], outputs=[grpcclient.InferRequestedOutput("logits", class_count=5)])
        client.close()
    entries = [[s.decode().split(":") for s in row] for row in full.as_numpy("logits")]
    return {"detect": [[r6(z), bool(m)] for z, m in zip(one.as_numpy("logit").tolist(), one.as_numpy("match"))],
            "topk": [[[int(i), r6(float(v))] for v, i, _ in row] for row in entries]}


def test_grpc_answers_are_the_recorded_http_answers(tmp_path):
    got = grpc_answers(tmp_path)
    want = json.loads(FIXTURE.read_text())["served"]
    assert got["detect"] == [row[:2] for row in want["detect"]]
    assert got["topk"] == want["topk"]["exact"]
