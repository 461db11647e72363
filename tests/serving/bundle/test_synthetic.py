"""Synthetic bundles: graphs agree with each other and with the .npy rows; thresholds are the quantile they claim."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from serving.bundle import load_bundle, verify_bundle
from serving.bundle.npy import NPY_ALIGN, NpyStream
from serving.bundle.synthetic import QUANTILE, build_synthetic_bundle

ROOT = Path(__file__).resolve().parents[3]


def session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def moderate(tmp_path_factory) -> Path:
    return build_synthetic_bundle(classes=5000, dim=64, input_dim=24, seed=11, out=tmp_path_factory.mktemp("s") / "b")


def test_moderate_bundle_passes_verify(moderate):
    assert verify_bundle(moderate) == []


def test_single_equals_full_column_equals_rows(moderate):
    """single.onnx(x, j) == full.onnx(x)[:, j] == embedding @ W.T + b (float64 numpy on the .npy rows)."""
    b = load_bundle(moderate)
    x = np.random.default_rng(0).standard_normal((6, 24)).astype(np.float32)
    emb = session(moderate / "backbone.onnx").run(None, {"input": x})[0]  # [6, d]
    full = session(moderate / "full.onnx").run(None, {"input": x})[0]  # [6, D]
    ref = emb.astype(np.float64) @ np.asarray(b.weight, dtype=np.float64).T + b.bias  # [6, D]
    np.testing.assert_allclose(full, ref, rtol=1e-4, atol=1e-5)
    single = session(moderate / "single.onnx")
    for class_ids in ([0, 1, 2, 3, 4, 4999], [4999, 17, 17, 2500, 0, 1234]):
        cid = np.array(class_ids, dtype=np.int64)
        got = single.run(None, {"input": x, "class_id": cid})[0]  # [6]
        np.testing.assert_allclose(got, full[np.arange(6), cid], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, rtol=1e-5)  # the backbone L2-normalises


def test_graphs_share_the_npy_rows_instead_of_copying(moderate):
    w_bytes = 5000 * 64 * 4
    for name in ("full.onnx", "single.onnx"):
        assert (moderate / name).stat().st_size < w_bytes / 4
        model = onnx.load(str(moderate / name), load_external_data=False)
        ext = {t.name: {e.key: e.value for e in t.external_data} for t in model.graph.initializer if t.external_data}
        assert ext["head_weight"]["location"] == "head_weight.npy"
        assert int(ext["head_weight"]["offset"]) % NPY_ALIGN == 0
        assert ext["head_bias"]["location"] == "head_bias.npy"
    ops = {n.op_type for n in onnx.load(str(moderate / "single.onnx"), load_external_data=False).graph.node}
    assert "Gather" in ops and "GatherND" not in ops


def test_thresholds_are_near_the_claimed_quantile(tmp_path):
    """Brute force: the share of random inputs at or above each class's threshold is about 1 - 0.999.

    The rule is a Gaussian approximation of the logit over random inputs (see serving.bundle.synthetic);
    with normalised embeddings the true tails are a little lighter, so allow a factor ~3.
    """
    p = build_synthetic_bundle(classes=200, dim=256, input_dim=32, seed=5, out=tmp_path / "q")
    b = load_bundle(p)
    x = np.random.default_rng(123).standard_normal((40000, 32)).astype(np.float32)
    z = session(p / "full.onnx").run(None, {"input": x})[0]  # [40000, 200]
    rate = (z >= b.thresholds).mean(axis=0)  # [200]
    assert (1 - QUANTILE) / 3 < rate.mean() < (1 - QUANTILE) * 2
    # Platt: probability one half exactly at the threshold, increasing in the logit
    np.testing.assert_allclose(b.platt_a * b.thresholds + b.platt_b, 0.0, atol=1e-4)
    assert (b.platt_a > 0).all()


def test_same_seed_same_bundle(tmp_path):
    a = build_synthetic_bundle(classes=50, dim=8, input_dim=4, seed=1, out=tmp_path / "a")
    b = build_synthetic_bundle(classes=50, dim=8, input_dim=4, seed=1, out=tmp_path / "b")
    c = build_synthetic_bundle(classes=50, dim=8, input_dim=4, seed=2, out=tmp_path / "c")
    assert (a / "head_weight.npy").read_bytes() == (b / "head_weight.npy").read_bytes()
    assert (a / "head_weight.npy").read_bytes() != (c / "head_weight.npy").read_bytes()


def test_npy_stream_round_trip(tmp_path):
    data = np.random.default_rng(0).standard_normal((1000, 7)).astype(np.float32)
    s = NpyStream(tmp_path / "x.npy", data.shape)
    for i in range(0, 1000, 300):
        s.write(data[i:i + 300])
    digest, size = s.close()
    import hashlib

    assert digest == hashlib.sha256((tmp_path / "x.npy").read_bytes()).hexdigest()
    loaded = np.load(tmp_path / "x.npy", mmap_mode="r", allow_pickle=False)
    assert loaded.offset % NPY_ALIGN == 0
    np.testing.assert_array_equal(loaded, data)
    short = NpyStream(tmp_path / "y.npy", (5, 7))
    short.write(data[:4])
    with pytest.raises(ValueError):
        short.close()


def test_building_imports_no_torch(tmp_path):
    code = (
        "import sys\n"
        "from serving.bundle.synthetic import build_synthetic_bundle\n"
        f"build_synthetic_bundle(classes=20, dim=8, input_dim=4, seed=0, out={str(tmp_path / 'nt')!r})\n"
        "assert 'torch' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
