"""Quantized heads (serving/bundle/quantize.py, serving/core/quantized_head.py) against float64 truth:
the int8 and bf16 encodings by their definitions, the bundle round trip through `slc verify`
(tampering caught), and the server's answers on the int8 / bf16 head against the float64 logits
within the bounds the encodings give."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from serving.bundle.quantize import bf16_bits, bf16_to_float32, int8_rows
from tests.serving.helpers import quantized_bundle, INPUT_DIM, Offline, make_settings, wait_ready

D_Q, DIM_Q = 3000, 32


def _bf16_reference(x: float) -> float:
    """The bfloat16 nearest to x (ties to even), by enumerating the two neighbours in float64."""
    u = int(np.float32(x).view(np.uint32))
    lo, hi = u & 0xFFFF0000, (u & 0xFFFF0000) + 0x10000
    a, b = (float(np.uint32(v).view(np.float32)) for v in (lo, hi))
    da, db = abs(float(np.float32(x)) - a), abs(b - float(np.float32(x)))
    if da < db or (da == db and (lo >> 16) % 2 == 0):
        return a
    return b


def test_bf16_bits_round_to_the_nearest_bfloat16_ties_to_even():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(size=3000) * 10.0 ** rng.integers(-8, 8, size=3000),
                        [0.0, -0.0, 1.0, 1.00390625, 1.01171875, -3.5e-20, 3.0e38]]).astype(np.float32)
    got = bf16_to_float32(bf16_bits(x))
    assert [float(v) for v in got] == [_bf16_reference(float(v)) for v in x]


def test_int8_rows_dequantize_within_half_a_step_and_use_the_full_range():
    rng = np.random.default_rng(1)
    w = (rng.normal(size=(200, 40)) * rng.uniform(0.01, 10, size=(200, 1))).astype(np.float32)
    w[7] = 0.0
    q, scale = int8_rows(w)
    assert q.dtype == np.int8 and scale.dtype == np.float32 and np.abs(q).max() == 127
    back = scale[:, None].astype(np.float64) * q
    assert (np.abs(back - w) <= scale[:, None] * 0.5 * (1 + 1e-6) + 1e-30).all()
    assert scale[7] == 0 and not q[7].any()
    assert np.allclose(scale, np.abs(w).max(axis=1) / 127, rtol=1e-6)


@pytest.fixture(scope="module")
def qbundle(tmp_path_factory):
    return quantized_bundle(tmp_path_factory.mktemp("qbundle"), D_Q, DIM_Q, 3)


def test_quantized_bundle_verifies_and_lists_its_heads(qbundle):
    from serving.bundle import load_bundle
    from serving.bundle.verify import verify_bundle

    assert verify_bundle(qbundle) == []
    b = load_bundle(qbundle)
    assert set(b.heads) == {"int8", "bf16"}
    assert b.heads["int8"]["weight"].shape == (D_Q, DIM_Q) and b.heads["bf16"]["weight"].dtype == np.uint16


def test_a_tampered_quantized_head_is_caught_by_its_hash(qbundle, tmp_path):
    from serving.bundle.verify import verify_bundle

    bad = tmp_path / "bad"
    shutil.copytree(qbundle, bad)
    with open(bad / "head_int8.npy", "r+b") as f:
        f.seek(-5, 2)
        byte = f.read(1)
        f.seek(-5, 2)
        f.write(bytes([byte[0] ^ 0x40]))
    assert any(p.startswith("head_int8.npy: sha256") for p in verify_bundle(bad))


def test_a_head_quantized_from_other_weights_is_caught_even_when_rehashed(qbundle, tmp_path):
    from serving.bundle.format import write_manifest
    from serving.bundle.verify import verify_bundle

    bad = tmp_path / "bad"
    shutil.copytree(qbundle, bad)
    bits = np.load(bad / "head_bf16.npy")
    bits[::7] ^= 0x0100  # a wrong mantissa bit in every seventh row
    np.save(bad / "head_bf16.npy", bits)
    write_manifest(bad, json.loads((bad / "manifest.json").read_text()))
    assert "head_bf16.npy: is not head_weight.npy rounded to bfloat16" in verify_bundle(bad)


def test_serving_a_precision_the_bundle_lacks_fails_in_one_line(client_factory):
    """The bundle has no int8 head: the load fails with the command that adds one (`slc serve` exits on it)."""
    client = client_factory(wait=False, head_precision="int8")
    for _ in range(200):
        r = client.get("/v1/health/ready")
        if "could not be loaded" in r.text:
            break
        import time

        time.sleep(0.02)
    assert r.status_code == 503
    message = r.json()["error"]["message"]
    assert "no int8 head" in message and "slc bundle quantize" in message and "\n" not in message


def _bound(h: np.ndarray, weight: np.ndarray, heads, precision: str, device: bool = False) -> np.ndarray:
    """|quantized logit − float64 logit| per (input, class) [N, D]: the row's rounding times |h|,
    plus for int8 the input's own rounding by the kernel times |w|; for bf16 on the device (a float16
    GEMM) also h's rounding to float16 and the logit's (2^-11 relative each, counted twice)."""
    h = h.astype(np.float64)
    if precision == "bf16":
        hw = np.abs(h) @ np.abs(weight).T  # [N, D]
        return hw * (2.0 ** -8 + (2 * 2.0 ** -10 if device else 0)) + 1e-5
    scale = heads["int8"]["scale"].astype(np.float64)  # [D]
    wq = np.abs(heads["int8"]["weight"].astype(np.float64)) * scale[:, None]  # |ŵ| [D, d]
    step_h = np.abs(h).max(1) / 127  # [N] the input's int8 step (MatMulNBits); uint8's (DynamicQuantizeMatMul) is smaller
    return np.abs(h).sum(1)[:, None] * scale[None] / 2 + step_h[:, None] / 2 * wq.sum(1)[None] + 1e-4


@pytest.mark.parametrize("n", [1, 6])  # int8: MatMulNBits for one input, DynamicQuantizeMatMul for six
@pytest.mark.parametrize("threads,impl", [(1, "auto"), (2, "auto"), (1, "device")])  # device: the head on the
@pytest.mark.parametrize("precision", ["int8", "bf16"])  # execution device (here the CPU provider; a GPU there)
def test_quantized_passes_answer_within_the_bounds_of_float64(qbundle, tmp_path, precision, threads, impl, n):
    from fastapi.testclient import TestClient

    from serving.http.app import create_app
    from serving.bundle import load_bundle

    b = load_bundle(qbundle)
    offline = Offline(b)
    x = np.random.default_rng(4).standard_normal((n, INPUT_DIM)).astype(np.float32)
    z = offline.logits(x)  # [N, D] float64
    bound = _bound(offline.embed(x), offline.W, b.heads, precision, device=impl == "device")
    settings = make_settings(qbundle, tmp_path, head_precision=precision, intra_op_threads=threads, softmax_impl=impl)
    with TestClient(create_app(settings)) as c:
        wait_ready(c.get)
        model = c.get("/v1/model").json()
        assert model["softmax_impl"] == (precision if impl == "auto" else "device")
        if impl == "device":
            head = model["head_device"]
            assert head["precision"] == precision and head["bytes"] == D_Q * ((2 * DIM_Q + 4) if precision == "bf16" else (DIM_Q + 8))
        full = np.asarray(c.post(f"/v2/models/{b.name}-full/infer", json={"inputs": [
            {"name": "input", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}).json()
            ["outputs"][0]["data"]).reshape(z.shape)
        assert (np.abs(full - z) <= bound).all()
        assert np.abs(full - z).max() > 0  # the quantized head was read, not the float32 one
        top = c.post("/v1/topk", json={"inputs": x.tolist(), "k": 5, "mode": "exact"}).json()["results"]
        soft = c.post("/v1/classes/17/softmax", json={"inputs": x.tolist()}).json()["results"]
    for row, zi in zip(top, z):  # re-scored: the exact top-5 and its exact logits
        assert [e["class_id"] for e in row] == np.argsort(-zi)[:5].tolist()
        assert np.allclose([e["logit"] for e in row], np.sort(zi)[::-1][:5], rtol=1e-5, atol=1e-5)
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    for r, zi, li, bi in zip(soft, z, lse, bound):
        assert r["logit"] == pytest.approx(zi[17], rel=1e-5, abs=1e-5)  # the asked class's own logit: exact
        assert abs(np.log(r["probability"]) - (zi[17] - li)) <= bi.max()  # only the normaliser is quantized


@pytest.mark.parametrize("two_kernels", [True, False])
def test_int8_head_chunks_match_float64_within_bounds_with_one_or_two_kernels(qbundle, monkeypatch, two_kernels):
    """Int8Head directly, 6 inputs (a batch): DynamicQuantizeMatMul with both kernels; MatMulNBits
    alone when the head is above TWO_KERNELS_MAX_VALUES (lowered here to force it)."""
    from serving.core import quantized_head
    from serving.bundle import load_bundle

    if not two_kernels:
        monkeypatch.setattr(quantized_head, "TWO_KERNELS_MAX_VALUES", 0)
    b = load_bundle(qbundle)
    offline = Offline(b)
    h = offline.embed(np.random.default_rng(5).standard_normal((6, INPUT_DIM)).astype(np.float32))
    head = quantized_head.Int8Head(b.heads["int8"]["weight"], b.heads["int8"]["scale"], b.bias, rows=1000)
    batch_kernel = two_kernels and quantized_head.dynamic_kernel_exact()
    assert head.kernels == (("nbits", "dynamic") if batch_kernel else ("nbits",))
    z = np.concatenate([head(h, s, min(s + 1000, D_Q), np.empty((6, min(1000, D_Q - s)), np.float32))
                        for s in range(0, D_Q, 1000)], axis=1)
    exact = h.astype(np.float64) @ offline.W.T + offline.b
    assert (np.abs(z - exact) <= _bound(h, offline.W, b.heads, "int8")).all()


def test_the_batch_kernel_is_used_only_where_it_adds_exactly():
    """dynamic_kernel_exact against a float64 product on full-range rows and large inputs: where it says
    the kernel is exact the kernel is within half a quantization step of the truth, where it says not,
    the kernel is measurably wrong here (the int16 saturation of x86 without VNNI)."""
    import onnxruntime as ort

    from serving.core.quantized_head import _int8_graph, dynamic_kernel_exact

    rng = np.random.default_rng(0)
    q = rng.choice(np.array([-127, 127], np.int8), size=(64, 256))
    scale, bias = np.full(64, 0.01, np.float32), np.zeros(64, np.float32)
    h = np.abs(rng.standard_normal((8, 256))).astype(np.float32) + 1.0  # every input near the top of uint8
    session = ort.InferenceSession(_int8_graph(256, q, scale, bias, "dynamic"), providers=["CPUExecutionProvider"])
    err = np.abs(session.run(None, {"h": h})[0] - h.astype(np.float64) @ (scale[:, None] * q).T)
    bound = (h.max(1, keepdims=True) / 255 / 2) * np.abs(scale[:, None] * q).sum(1)[None] + 1e-4  # h's rounding
    assert (err <= bound).all() == dynamic_kernel_exact()


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_a_quantized_head_on_the_device_lets_go_of_its_host_pages(qbundle, tmp_path, monkeypatch, precision):
    """Once uploaded, the quantized rows' mapped pages are dropped as the float32 ones are (the upload
    read them all: at 10^7 classes that kept 2.6 / 5.1 GB resident on the host, docs/results/gpu-serving.md)."""
    from fastapi.testclient import TestClient

    from serving.core.device import head_pass
    from serving.http.app import create_app

    dropped = []
    monkeypatch.setattr(head_pass, "drop_host_pages", lambda rows: dropped.append(rows))
    settings = make_settings(qbundle, tmp_path, head_precision=precision, softmax_impl="device")
    with TestClient(create_app(settings)) as c:
        wait_ready(c.get)
        bundle = c.app.state.slc.engine.head_pass.bundle
        assert any(rows is bundle.heads[precision]["weight"] for rows in dropped)
        assert any(rows is bundle.weight for rows in dropped)
