"""The device-resident head (serving/core/device/head.py) on the CPU provider, against float64 numpy:
the two-stage log-sum-exp, argmax and top-k over padded blocks (D below, at and above a block's
width; ties; non-finite rows), the server's answers with SLC_SOFTMAX_IMPL=device (softmax, exact
top-k, all logits over KServe v2), the memory check that refuses a head too large for the GPU in
one line, and a device error: 503 in the envelope, readiness 503 until a probe passes again.
The numeric tests also run on CUDA where onnxruntime has it (a GPU machine: TF32 off, so the same
tolerances hold), and skip there with the reason elsewhere; the server on a GPU is tools/gpu_check.py
(make gpu-check)."""
from __future__ import annotations

import numpy as np
import pytest

from serving.core import head_scan
from serving.core.device import head as device_head
from serving.core.device.memory import DeviceMemoryError, check_fits, needed_bytes
from tests.serving.helpers import D


def _has_cuda() -> bool:
    """A CUDA session really opens here (onnxruntime-gpu lists CUDA on machines without a GPU too)."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False
    from serving.core.device.backend import preload_cuda, usable_providers

    preload_cuda()
    return "CUDAExecutionProvider" in usable_providers()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not _has_cuda(), reason="no CUDA session opens here (onnxruntime-gpu and a GPU)"))])
def where(request) -> str:
    """The device the head lives on: the CPU provider everywhere, CUDA where a CUDA session opens."""
    return request.param


def _head(num_classes: int, d: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((num_classes, d)).astype(np.float32), rng.standard_normal(num_classes).astype(np.float32)


def _z64(h, w, b) -> np.ndarray:
    return h.astype(np.float64) @ w.T.astype(np.float64) + b.astype(np.float64)


def _lse64(z: np.ndarray) -> np.ndarray:
    m = z.max(axis=1)
    return m + np.log(np.exp(z - m[:, None]).sum(axis=1))


@pytest.mark.parametrize("num_classes,max_k", [(1, 1), (7, 3), (1023, 5), (1024, 16), (1025, 1), (5000, 1000), (200_003, 10)])
def test_softmax_topk_and_logits_equal_float64(num_classes, max_k, where):
    w, b = _head(num_classes, 24, seed=num_classes)
    h = np.random.default_rng(1).standard_normal((9, 24)).astype(np.float32)
    head = device_head.DeviceHead(w, b, where, max_k=max_k)
    assert head.blocks * head.width >= num_classes and head.width >= min(max_k, num_classes)
    j = np.array([0, num_classes - 1, num_classes // 2])
    soft, top, full = head_scan.SoftmaxStats(3, j), head_scan.TopK(3, min(max_k, num_classes)), head_scan.AllLogits(3, num_classes)
    head.run(h, [(slice(0, 3), soft), (slice(3, 6), top), (slice(6, 9), full)])
    z = _z64(h, w, b)
    p, zj, is_top = soft.result()
    np.testing.assert_allclose(p, np.exp(z[np.arange(3), j] - _lse64(z[:3])), rtol=2e-5, atol=1e-9)
    np.testing.assert_allclose(zj, z[np.arange(3), j], rtol=1e-5, atol=1e-4)
    assert is_top.tolist() == (z[:3].argmax(axis=1) == j).tolist() and soft.finite.all()
    values, ids = top.result()
    want = np.argsort(-z[3:6], axis=1, kind="stable")[:, :top.k]
    assert ids.tolist() == want.tolist()
    np.testing.assert_allclose(values, np.take_along_axis(z[3:6], want, axis=1), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(full.result(), z[6:9], rtol=1e-5, atol=1e-4)


def _quantized(w: np.ndarray, precision: str) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """(the rows as the bundle stores them, int8 scales or None, the float64 rows they stand for)."""
    from serving.bundle.quantize import bf16_bits, bf16_to_float32, int8_rows

    if precision == "bf16":
        bits = bf16_bits(w)
        return bits, None, bf16_to_float32(bits).astype(np.float64)
    q, scale = int8_rows(w)
    return q, scale, scale[:, None].astype(np.float64) * q


@pytest.mark.parametrize("precision", ["bf16", "int8"])
@pytest.mark.parametrize("num_classes", [7, 5000])
def test_quantized_rows_answer_like_float64_of_what_they_store(precision, num_classes, where):
    """bf16 (a float16 GEMM on the device) within float16's rounding of the sums and the logit; int8 (an
    integer GEMM of h rounded to int8 per input) exact but for float32's last bits. The logits, the
    softmax and the top-k, against float64 over the rows the bundle stores."""
    w, b = _head(num_classes, 24, seed=5)
    rows, scale, w64 = _quantized(w, precision)
    h = np.random.default_rng(2).standard_normal((9, 24)).astype(np.float32)
    head = device_head.DeviceHead(rows, b, where, max_k=5, precision=precision, scale=scale)
    if precision == "bf16":
        hr = h.astype(np.float16).astype(np.float64)
        z = hr @ w64.T
        # float16's rounding of the sums (2^-11 of |h||w| where the kernel sums in float16, as the CPU
        # provider's does; cuBLAS sums in float32) and of the logit
        tol = (np.abs(z) + np.abs(hr) @ np.abs(w64).T) * 2.0 ** -10 + 1e-6  # [M, D]
        z = z + b
    else:
        hs = np.abs(h).max(axis=1, keepdims=True).astype(np.float64) / 127
        z = hs * (np.rint(h / hs) @ w64.T) + b
        tol = np.abs(z) * 1e-6 + 1e-6
    j = np.array([0, num_classes - 1, num_classes // 2])
    soft, top, full = head_scan.SoftmaxStats(3, j), head_scan.TopK(3, 5 if num_classes > 5 else 3), head_scan.AllLogits(3, num_classes)
    head.run(h, [(slice(0, 3), soft), (slice(3, 6), top), (slice(6, 9), full)])
    assert (np.abs(full.result() - z[6:9]) <= tol[6:9]).all()
    p, zj, _ = soft.result()
    assert (np.abs(zj - z[np.arange(3), j]) <= tol[np.arange(3), j]).all()
    assert (np.abs(np.log(p) - (z[np.arange(3), j] - _lse64(z[:3]))) <= 2 * tol[:3].max(axis=1) + 1e-6).all()
    values, ids = top.result()
    ref = np.sort(z[3:6], axis=1)[:, ::-1][:, :top.k]
    assert (np.abs(values - ref) <= tol[3:6].max(axis=1, keepdims=True)).all()
    assert (np.abs(np.take_along_axis(z[3:6], ids, axis=1) - values) <= tol[3:6].max(axis=1, keepdims=True)).all()
    assert head.resident_bytes == num_classes * ((2 * 24 + 4) if precision == "bf16" else (24 + 8))


def test_a_bf16_head_beyond_float16s_range_is_refused_in_one_line():
    w, b = _head(10, 8)
    w[3, 2] = 7e4
    rows, _, _ = _quantized(w, "bf16")
    with pytest.raises(ValueError, match="beyond float16's range"):
        device_head.DeviceHead(rows, b, "cpu", precision="bf16")


def test_an_int8_input_that_is_not_finite_is_flagged_like_float32():
    w, b = _head(50, 8)
    rows, scale, _ = _quantized(w, "int8")
    head = device_head.DeviceHead(rows, b, "cpu", max_k=3, precision="int8", scale=scale)
    h = np.random.default_rng(3).standard_normal((3, 8)).astype(np.float32)
    h[0, 1], h[1, 4] = np.nan, np.inf
    soft = head_scan.SoftmaxStats(3, 2)
    top = head_scan.TopK(3, 3)
    head.run(np.concatenate([h, h]), [(slice(0, 3), soft), (slice(3, 6), top)])
    assert soft.finite.tolist() == [False, False, True] and top.finite.tolist() == [False, False, True]


def test_ties_go_to_the_smaller_id_across_blocks(where):
    """Equal rows in two blocks (ids 5 and 2050): argmax and top-k both name the smaller id first."""
    w, b = _head(3000, 8)
    w[2050], b[2050] = w[5], b[5]
    w[5] *= 50  # far above every other row for h = w[5] direction
    w[2050] = w[5]
    h = w[5:6] / np.linalg.norm(w[5])
    head = device_head.DeviceHead(w, b, where, max_k=4)
    assert head.blocks >= 2
    soft, top = head_scan.SoftmaxStats(1, 2050), head_scan.TopK(1, 2)
    head.run(np.concatenate([h, h]), [(slice(0, 1), soft), (slice(1, 2), top)])
    assert soft.top.tolist() == [5] and not soft.result()[2][0]
    assert top.result()[1].tolist() == [[5, 2050]]


def test_rows_with_a_nan_or_an_infinity_are_flagged(where):
    w, b = _head(2000, 8)
    b[1500] = np.inf
    h = np.random.default_rng(2).standard_normal((3, 8)).astype(np.float32)
    h[0, 0] = np.nan
    head = device_head.DeviceHead(w, b, where, max_k=3)
    soft = head_scan.SoftmaxStats(3, 0)
    head.run(h, [(slice(0, 3), soft)])
    assert soft.finite.tolist() == [False, False, False]  # NaN in row 0; +inf in every row's column 1500
    b[1500] = 0.0
    head = device_head.DeviceHead(w, b, where, max_k=3)
    top = head_scan.TopK(3, 2)
    head.run(h, [(slice(0, 3), top)])
    assert top.finite.tolist() == [False, True, True]


def test_inputs_beyond_one_group_are_taken_in_groups(monkeypatch, where):
    monkeypatch.setattr(device_head, "GROUP_VALUES", 3 * 2048)  # 3 rows of a 2,000-class head per run
    w, b = _head(2000, 8)
    h = np.random.default_rng(3).standard_normal((10, 8)).astype(np.float32)
    head = device_head.DeviceHead(w, b, where, max_k=2)
    assert head._groups(10) == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 10)]
    soft, full = head_scan.SoftmaxStats(10, 7), head_scan.AllLogits(10, 2000)
    head.run(np.concatenate([h, h]), [(slice(0, 10), soft), (slice(10, 20), full)])
    z = _z64(h, w, b)
    np.testing.assert_allclose(soft.result()[0], np.exp(z[:, 7] - _lse64(z)), rtol=2e-5, atol=1e-9)
    np.testing.assert_allclose(full.result(), z, rtol=1e-5, atol=1e-4)


# ------------------------------------------------------------------------------ memory
def test_a_head_too_large_for_the_gpu_is_one_line_naming_bytes_and_precisions():
    D, d = 10_000_000, 256
    rows, work = needed_bytes(D, d, 64, 1000)
    assert rows == 4 * D * (d + 1)
    assert needed_bytes(D, d, 64, 1000, "bf16") == (D * (2 * d + 4), work)  # float16 rows + float32 bias
    assert needed_bytes(D, d, 64, 1000, "int8") == (D * (d + 8), work)  # int8 rows + scale + bias
    gb = 1_000_000_000
    with pytest.raises(DeviceMemoryError) as err:  # 8 GB free: both smaller precisions fit
        check_fits("cuda", D, d, 64, 1000, memory=lambda device_id: (8 * gb, 80 * gb))
    msg = str(err.value)
    assert "\n" not in msg and "10.3 GB of rows" in msg and "8.0 GB of 80.0 GB is free" in msg
    assert f"bf16 ({(D * (2 * d + 4) + work) / gb:.1f} GB)" in msg and f"int8 ({(D * (d + 8) + work) / gb:.1f} GB)" in msg
    with pytest.raises(DeviceMemoryError) as err:  # 6 GB: int8 alone
        check_fits("cuda", D, d, 64, 1000, memory=lambda device_id: (6 * gb, 80 * gb))
    assert "SLC_HEAD_PRECISION=int8" in str(err.value) and "bf16" not in str(err.value)
    with pytest.raises(DeviceMemoryError) as err:  # 3 GB: nothing fits, the int8 head itself refused
        check_fits("cuda", D, d, 64, 1000, memory=lambda device_id: (3 * gb, 80 * gb), precision="int8")
    assert str(err.value).startswith("the int8 head") and "no precision of the head fits" in str(err.value)
    check_fits("cuda", D, d, 64, 1000, memory=lambda device_id: (rows + work, 80 * gb))  # just fits
    check_fits("cuda", D, d, 64, 1000, memory=lambda device_id: (6 * gb, 80 * gb), precision="int8")
    check_fits("cpu", D, d, 64, 1000, memory=lambda device_id: (0, 0))  # the CPU: not asked
    check_fits("cuda", D, d, 64, 1000, memory=lambda device_id: None)  # no driver to ask


# ------------------------------------------------------------------------------ the server
def test_the_server_serves_all_logits_from_the_device_head(client_factory, offline, inputs, bundle):
    client = client_factory(softmax_impl="device")
    info = client.get("/v1/model").json()
    where = "cuda" if client.app.state.slc.engine.head_pass.runtime.uses_cuda else "cpu"  # auto: a GPU where one is
    assert info["softmax_impl"] == "device" and info["head_device"]["resident"] == where
    assert info["head_device"]["bytes"] == 4 * D * (bundle.embed_dim + 1) and info["head_device"]["healthy"]
    body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(inputs.shape),
                        "data": inputs.ravel().tolist()}]}
    r = client.post(f"/v2/models/{bundle.name}-full/infer", json=body)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    np.testing.assert_allclose(np.array(out["data"]).reshape(out["shape"]), offline.logits(inputs), rtol=1e-5, atol=1e-4)


def test_a_device_error_is_503_and_readiness_follows_the_device(client_factory, inputs):
    client = client_factory(softmax_impl="device")
    head_pass = client.app.state.slc.engine.head_pass
    head = head_pass.device_head()
    real, broken = head.run, {"on": True}

    def run(h, parts):
        if broken["on"]:
            raise RuntimeError("CUDA failure 700: an illegal memory access was encountered\nmore")
        return real(h, parts)

    head.run = run
    r = client.post("/v1/classes/3/softmax", json={"inputs": inputs.tolist()})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert err["code"] == "device_error" and "illegal memory access" in err["message"] and "\n" not in err["message"]
    assert client.get("/v1/health/live").status_code == 200
    ready = client.get("/v1/health/ready")
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "device_error"
    assert client.get("/v2/health/ready").status_code == 503
    assert client.get("/v1/model").json()["head_device"]["healthy"] is False
    broken["on"] = False  # the device works again: the probe of the next readiness check says so
    assert client.get("/v1/health/ready").status_code == 200
    assert client.post("/v1/classes/3/softmax", json={"inputs": inputs.tolist()}).status_code == 200


def test_the_host_lets_go_of_the_rows_once_they_live_on_the_device(tmp_path):
    """drop_host_pages: the mapped rows' resident pages released (they stay readable from the file)."""
    from serving.core.device.head_pass import drop_host_pages

    def resident() -> int:  # this process's resident bytes
        import os

        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    np.save(tmp_path / "w.npy", np.full((16_384, 1024), 0.5, np.float32))  # 64 MiB
    w = np.load(tmp_path / "w.npy", mmap_mode="r")
    before = resident()
    assert float(w.sum(dtype=np.float64)) == 0.5 * w.size
    assert resident() - before > 48 << 20
    drop_host_pages(w)
    assert resident() - before < 16 << 20
    assert float(w[123, 7]) == 0.5


def test_on_cuda_the_auto_class_index_is_the_devices_exact_top_k():
    """lifecycle.index_kind: auto on CUDA (the device pass allowed) opens no index;
    elsewhere auto chooses by D as before, and a named kind is always kept."""
    from serving.core.lifecycle import index_kind
    from serving.settings import Settings

    def kind(device, **kw):
        return index_kind(Settings(**kw), device)

    assert kind("cuda") == "exact" and kind("cuda", softmax_impl="device") == "exact"
    assert kind("cpu") is None and kind("cuda", softmax_impl="ort") is None
    assert kind("cuda", head_precision="int8") == "exact"  # the int8 head on the device
    assert kind("cuda", head_precision="bf16", softmax_impl="ort") is None
    assert kind("cuda", class_index="ivf") == "ivf" and kind("cpu", class_index="hnsw") == "hnsw"
