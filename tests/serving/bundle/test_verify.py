"""serving.bundle: loading, the Bundle interface, and verify catching every kind of damage.

Bundles here are synthetic (serving.bundle.synthetic, no torch), so these tests run without torch.
Tamper tests on a trained, exported bundle are in tests/trainer/test_export.py.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from serving.bundle import REQUIRED_FILES, BundleError, load_bundle, verify_bundle, write_manifest
from serving.bundle.synthetic import build_synthetic_bundle

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return build_synthetic_bundle(classes=300, dim=32, input_dim=16, seed=3, out=tmp_path_factory.mktemp("b") / "bundle")


@pytest.fixture
def bundle(pristine, tmp_path) -> Path:
    """A private copy each test may damage."""
    return Path(shutil.copytree(pristine, tmp_path / "copy"))


def rewrite_manifest(path: Path) -> None:
    """Re-hash every file, as a careless re-export would: content checks must still catch damage."""
    manifest = json.loads((path / "manifest.json").read_text())
    write_manifest(path, manifest)


def test_pristine_bundle_verifies_and_loads(pristine):
    assert verify_bundle(pristine) == []
    b = load_bundle(pristine)
    cal = json.loads((pristine / "calibration.json").read_text())
    assert b.num_classes == 300 and b.embed_dim == 32 and b.input_shape == (16,)
    assert b.weight.shape == (300, 32) and b.weight.dtype == np.float32 and b.bias.shape == (300,)
    assert isinstance(b.weight, np.memmap) and not b.weight.flags.writeable
    np.testing.assert_array_equal(b.thresholds, np.array([e["threshold"] for e in cal["per_class"]], dtype=np.float32))
    np.testing.assert_array_equal(b.platt_a, np.array([e["platt"]["a"] for e in cal["per_class"]], dtype=np.float32))
    np.testing.assert_array_equal(b.platt_b, np.array([e["platt"]["b"] for e in cal["per_class"]], dtype=np.float32))
    assert b.global_threshold == cal["global"]["threshold"]
    assert b.digest == hashlib.sha256((pristine / "manifest.json").read_bytes()).hexdigest()
    assert b.graph_path("single") == pristine / "single.onnx"
    with pytest.raises(ValueError):
        b.graph_path("nope")


def test_class_id_resolution(pristine, tmp_path):
    b = load_bundle(pristine, verify=False)
    assert b.class_id(7) == 7 and b.class_id("7") == 7 and b.class_id(np.int64(299)) == 299
    for bad in (300, -1, "300", "cat", True):
        with pytest.raises(KeyError):
            b.class_id(bad)
    # names win over ids: a bundle whose class "1" is row 0
    named = Path(shutil.copytree(pristine, tmp_path / "named"))
    manifest = json.loads((named / "manifest.json").read_text())
    manifest["classes"] = [str(j + 1) for j in range(300)]
    write_manifest(named, manifest)
    nb = load_bundle(named)
    assert nb.class_id("1") == 0 and nb.class_id(1) == 1 and nb.class_id("0") == 0


def test_digest_changes_with_manifest(pristine, tmp_path):
    other = build_synthetic_bundle(classes=300, dim=32, input_dim=16, seed=4, out=tmp_path / "other")
    assert load_bundle(other).digest != load_bundle(pristine).digest


def flip_byte(path: Path, where: str) -> None:
    data = bytearray(path.read_bytes())
    i = {"middle": len(data) // 2, "last": len(data) - 1, "early": min(20, len(data) - 1)}[where]
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["early", "middle", "last"])
@pytest.mark.parametrize("name", list(REQUIRED_FILES) + ["manifest.json"])
def test_flipped_byte_is_caught_and_named(bundle, name, where):
    flip_byte(bundle / name, where)
    problems = verify_bundle(bundle)
    assert problems, f"flipping a byte of {name} went unnoticed"
    assert any(name in p for p in problems), problems
    with pytest.raises(BundleError, match=name.replace(".", r"\.")):
        load_bundle(bundle)


def test_missing_and_extra_files(bundle):
    (bundle / "samples.npz").unlink()
    assert any("samples.npz" in p for p in verify_bundle(bundle))
    (bundle / "manifest.json").unlink()
    assert any("manifest.json" in p for p in verify_bundle(bundle))


def test_calibration_content_checked_even_when_rehashed(bundle):
    path = bundle / "calibration.json"
    cal = json.loads(path.read_text())
    cal["per_class"] = cal["per_class"][:-1]  # one class short
    path.write_text(json.dumps(cal))
    rewrite_manifest(bundle)
    assert any(p.startswith("calibration.json") for p in verify_bundle(bundle))
    cal["per_class"].append({"class_id": 299, "threshold": float("nan"), "platt": {"a": 1.0, "b": 0.0}})
    path.write_text(json.dumps(cal))  # NaN literal: not strict JSON
    rewrite_manifest(bundle)
    problems = verify_bundle(bundle)
    assert any(p.startswith("calibration.json") for p in problems), problems
    cal["per_class"][-1]["threshold"] = 0.5
    cal["per_class"][-1]["class_id"] = 7  # wrong id
    path.write_text(json.dumps(cal))
    rewrite_manifest(bundle)
    assert any("per_class[299]" in p for p in verify_bundle(bundle))


def test_head_shape_checked_even_when_rehashed(bundle):
    np.save(bundle / "head_bias.npy", np.zeros(299, dtype=np.float32))
    rewrite_manifest(bundle)
    problems = verify_bundle(bundle)
    assert any(p.startswith("head_bias.npy") for p in problems), problems
    np.save(bundle / "head_bias.npy", np.zeros(300, dtype=np.float64))
    rewrite_manifest(bundle)
    assert any(p.startswith("head_bias.npy") for p in verify_bundle(bundle))


def test_wrong_graph_and_wrong_samples_named(bundle):
    shutil.copy(bundle / "backbone.onnx", bundle / "full.onnx")
    samples = dict(np.load(bundle / "samples.npz"))
    samples["embedding"] = samples["embedding"] + 1e-2
    np.savez(bundle / "samples.npz", **samples)
    rewrite_manifest(bundle)
    problems = verify_bundle(bundle)
    assert any(p.startswith("full.onnx") for p in problems), problems
    assert any(p.startswith("backbone.onnx") and "samples.npz" in p for p in problems), problems


def test_manifest_path_traversal_rejected(bundle):
    """A listed name outside the bundle directory is refused, not opened."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["files"]["../outside"] = {"sha256": "0" * 64, "bytes": 1}
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    problems = verify_bundle(bundle)
    assert any("bad file name '../outside'" in p for p in problems), problems


def test_single_class_bundle(tmp_path):
    p = build_synthetic_bundle(classes=1, dim=4, input_dim=3, seed=0, out=tmp_path / "one")
    assert verify_bundle(p) == []
    assert load_bundle(p).class_id("0") == 0


def test_serving_bundle_imports_no_torch(pristine):
    code = (
        "import sys\n"
        "from serving.bundle import load_bundle, verify_bundle\n"
        f"assert verify_bundle({str(pristine)!r}) == []\n"
        f"b = load_bundle({str(pristine)!r})\n"
        "assert 'torch' not in sys.modules, 'serving.bundle pulled in torch'\n"
        "print('ok', b.num_classes)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok 300"


# --- bundle files are opened only as regular files


def _replace_with(bundle: Path, name: str, kind: str, tmp_path: Path) -> None:
    target = bundle / name
    original = target.read_bytes()
    target.unlink()
    if kind == "symlink_same_content":
        twin = tmp_path / f"twin-{name}"
        twin.write_bytes(original)
        target.symlink_to(twin)
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "directory":
        target.mkdir()


@pytest.mark.parametrize("name", ["samples.npz", "manifest.json", "head_weight.npy", "calibration.json"])
@pytest.mark.parametrize("kind,word", [("symlink_same_content", "a symlink"), ("fifo", "a FIFO"),
                                       ("directory", "a directory")])
def test_a_file_that_is_not_regular_is_named_and_never_opened(bundle, tmp_path, name, kind, word):
    """Checked in a subprocess with a timeout: a FIFO that was opened would block it for ever."""
    _replace_with(bundle, name, kind, tmp_path)
    code = f"from serving.bundle import verify_bundle; print('\\n'.join(verify_bundle({str(bundle)!r})))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"{name}: is {word}, not a regular file" in out.stdout


def test_load_refuses_a_symlinked_file_too(bundle, tmp_path):
    _replace_with(bundle, "head_bias.npy", "symlink_same_content", tmp_path)
    with pytest.raises(BundleError, match="head_bias.npy: is a symlink"):
        load_bundle(bundle, verify=False)


def test_a_samples_file_that_unpacks_huge_is_refused_unread(bundle):
    """A real decompression bomb (a 300 MB member of zeros, about 300 KB packed) is named from the
    zip directory, before anything is decompressed."""
    import zipfile

    bomb = bundle / "samples.npz"
    bomb.unlink()
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as z:
        with z.open("input.npy", "w", force_zip64=True) as member:
            zeros = bytes(1 << 20)
            for _ in range(300):
                member.write(zeros)
    assert bomb.stat().st_size < 2 << 20
    problems = verify_bundle(bundle)
    assert any(p.startswith("samples.npz: cannot be read (it unpacks to 314572800 bytes") for p in problems), problems
