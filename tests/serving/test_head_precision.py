"""SLC_HEAD_PRECISION=auto (serving/core/head_precision.py): the warm-up times each head the bundle carries
and never serves one slower than float32; GET /v1/model says which serves and why. The timings are
forced (HeadPass.cost replaced), so the choice is known; the answers are checked against float64 numpy
math on each path (the float32 rows, or the int8 head within its rounding bound)."""
from __future__ import annotations

import numpy as np
import pytest

from serving.core import head_precision
from serving.core.compute import HeadPass
from tests.serving.helpers import quantized_bundle, INPUT_DIM, Offline, make_settings, wait_ready
from tests.serving.test_quantized_head import _bound

D, DIM = 2000, 32


@pytest.fixture(scope="module")
def qbundle(tmp_path_factory):
    return quantized_bundle(tmp_path_factory.mktemp("precision"), D, DIM, 5)


def test_decide_keeps_float32_when_the_quantized_head_is_slower():
    name, why = head_precision.decide("auto", {"float32": 1e-4, "int8": 3e-4, "bf16": 2e-4})
    assert name == "float32" and "float32 0.1000 ms" in why and "int8 0.3000 ms" in why


def test_decide_takes_int8_when_it_is_faster_by_more_than_the_tie():
    assert head_precision.decide("auto", {"float32": 1e-4, "int8": 0.5e-4})[0] == "int8"
    name, why = head_precision.decide("auto", {"float32": 1e-4, "int8": 0.95e-4})  # within CHOICE_TIE: float32
    assert name == "float32" and "less than" in why


def test_decide_serves_what_was_asked_for_and_says_so():
    name, why = head_precision.decide("int8", {"int8": 3e-4, "float32": 1e-4})
    assert name == "int8" and why.startswith("asked for") and "float32 measured faster" in why
    assert head_precision.decide("auto", {"bf16": 1e-4, "int8": 2e-4})[0] == "bf16"  # float32 did not fit


def _serve(qbundle, tmp_path, monkeypatch, forced: dict, **settings):
    from fastapi.testclient import TestClient

    from serving.http.app import create_app

    real = HeadPass.cost
    monkeypatch.setattr(HeadPass, "cost", lambda self: forced.get(self.precision, real(self)))
    return TestClient(create_app(make_settings(qbundle, tmp_path, **settings)))


def _answers(c, name: str, x: np.ndarray):
    full = np.asarray(c.post(f"/v2/models/{name}-full/infer", json={"inputs": [
        {"name": "input", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}).json()
        ["outputs"][0]["data"]).reshape(len(x), D)
    soft = c.post("/v1/classes/11/softmax", json={"inputs": x.tolist()}).json()["results"]
    top = c.post("/v1/topk", json={"inputs": x.tolist(), "k": 5, "mode": "exact"}).json()["results"]
    return full, soft, top


@pytest.mark.parametrize("impl", ["auto", "device"])  # device: the head on the execution device (the CPU provider here)
@pytest.mark.parametrize("int8_faster", [False, True])
def test_auto_never_serves_a_head_slower_than_float32(qbundle, tmp_path, monkeypatch, impl, int8_faster):
    from serving.bundle import load_bundle

    forced = {"float32": 1e-4, "bf16": 5e-4, "int8": 0.4e-4 if int8_faster else 3e-4}
    b = load_bundle(qbundle)
    offline = Offline(b)
    x = np.random.default_rng(2).standard_normal((4, INPUT_DIM)).astype(np.float32)
    z = offline.logits(x)  # [N, D] float64
    with _serve(qbundle, tmp_path, monkeypatch, forced, head_precision="auto", softmax_impl=impl) as c:
        wait_ready(c.get)
        info = c.get("/v1/model").json()
        full, soft, top = _answers(c, b.name, x)
    hp = info["head_precision"]
    want = "int8" if int8_faster else "float32"
    assert hp["served"] == want and hp["setting"] == "auto"
    assert set(hp["cost_ms_per_input"]) == {"float32", "int8", "bf16"} and hp["not_timed"] == {}
    assert f"int8 {1e3 * forced['int8']:.4f} ms" in hp["reason"]
    if impl == "device":
        assert info["softmax_impl"] == "device" and info["head_device"]["precision"] == want
    else:
        assert info["softmax_impl"] == ("int8" if int8_faster else info["softmax_impl"])
    if int8_faster:  # the int8 head was read (all logits quantized, within its bound), not the float32 rows
        bound = _bound(offline.embed(x), offline.W, b.heads, "int8")
        assert (np.abs(full - z) <= bound).all() and np.abs(full - z).max() > 0
    else:
        assert np.allclose(full, z, rtol=1e-4, atol=1e-4)
        bound = np.full_like(z, 1e-4)
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    for r, zi, li, bi in zip(soft, z, lse, bound):
        assert r["logit"] == pytest.approx(zi[11], rel=1e-5, abs=1e-5)  # re-scored on the float32 rows either way
        assert abs(np.log(r["probability"]) - (zi[11] - li)) <= bi.max() + 1e-5
    for row, zi in zip(top, z):
        assert [e["class_id"] for e in row] == np.argsort(-zi)[:5].tolist()


def test_an_asked_int8_head_serves_though_slower_and_says_so(qbundle, tmp_path, monkeypatch):
    forced = {"float32": 1e-4, "bf16": 5e-4, "int8": 3e-4}
    with _serve(qbundle, tmp_path, monkeypatch, forced, head_precision="int8") as c:
        wait_ready(c.get)
        hp = c.get("/v1/model").json()["head_precision"]
    assert hp["served"] == "int8" and hp["reason"].startswith("asked for (SLC_HEAD_PRECISION=int8)")
    assert "float32 measured faster" in hp["reason"]


def test_float32_times_nothing_else(qbundle, tmp_path, monkeypatch):
    with _serve(qbundle, tmp_path, monkeypatch, {}) as c:
        wait_ready(c.get)
        hp = c.get("/v1/model").json()["head_precision"]
    assert hp["served"] == "float32" and list(hp["cost_ms_per_input"]) == ["float32"]


def test_auto_where_float32_does_not_fit_the_device_serves_the_fastest_head_that_does(qbundle, tmp_path, monkeypatch):
    """The device admits only the quantized heads (a float32 head too large for it): auto opens on bf16,
    float32 is listed as not timed with the device's one line, and the cheaper quantized head serves."""
    from serving.core.device.head_pass import DevicePass
    from serving.core.device.memory import DeviceMemoryError

    def admit(cls, ctx):
        if ctx.precision == "float32":
            raise DeviceMemoryError("the float32 head needs 9.9 GB on cuda:0 and 1.0 GB is free")

    monkeypatch.setattr(DevicePass, "admit", classmethod(admit))
    forced = {"bf16": 2e-4, "int8": 1e-4}
    with _serve(qbundle, tmp_path, monkeypatch, forced, head_precision="auto", softmax_impl="device") as c:
        wait_ready(c.get)
        info = c.get("/v1/model").json()
    hp = info["head_precision"]
    assert hp["served"] == "int8" and info["head_device"]["precision"] == "int8"
    assert hp["not_timed"] == {"float32": "the float32 head needs 9.9 GB on cuda:0 and 1.0 GB is free"}
    assert "float32 head does not fit" in hp["reason"]
