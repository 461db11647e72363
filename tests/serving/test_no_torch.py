"""The serving package never imports torch or the trainer (a serving image carries neither): checked in
a fresh interpreter that builds an app, and by running `slc serve`, `slc verify` and `slc bundle
synthetic` where torch and trainer cannot be imported at all."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration  # real processes

SCRIPT = r"""
import importlib, json, pkgutil, sys, time
import serving
from serving.http.app import create_app
from serving.settings import Settings
from fastapi.testclient import TestClient

app = create_app(Settings(bundle=sys.argv[1], data_dir=sys.argv[2], home=sys.argv[2], intra_op_threads=1))
with TestClient(app) as c:
    for _ in range(600):
        if c.get("/v1/health/ready").status_code == 200:
            break
        time.sleep(0.05)
    status = c.post("/v1/classes/0/detect", json={"inputs": [[0.0] * 12]}).status_code
    topk = c.post("/v1/topk", json={"inputs": [[0.0] * 12], "k": 3, "mode": "index"}).status_code
# every serving module, and the server-side tools (load tester, benchmarks): not the torch baseline
# peer, which runs only as a subprocess of its own, nor the trainer's benchmarks (head_train, losses)
import tools.bench, tools.loadtest
skipped = {"tools.bench.torch_peer", "tools.bench.head_train", "tools.bench.losses"}
for pkg in (serving, tools.loadtest, tools.bench):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        if m.name not in skipped:
            importlib.import_module(m.name)
print(json.dumps({"torch": "torch" in sys.modules or "trainer" in sys.modules, "status": status, "topk": topk}))
"""


def test_serving_never_imports_torch(bundle_path, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(bundle_path), str(tmp_path)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"torch": False, "status": 200, "topk": 200}, out.stderr


# --- the commands, in an environment where torch and the trainer cannot be imported at all

BLOCKED = ("torch", "trainer")


@pytest.fixture(scope="module")
def torchless_env(tmp_path_factory) -> dict:
    """PYTHONPATH starts with packages named torch and trainer whose import fails, as in a
    server-only install (pip install slc: no torch), and a trainer that would be found only by mistake."""
    blocker = tmp_path_factory.mktemp("blocker")
    for name in BLOCKED:
        (blocker / name).mkdir()
        (blocker / name / "__init__.py").write_text(f"raise ModuleNotFoundError('no {name} here', name='{name}')\n")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocker), str(ROOT)]), SLC_INTRA_OP_THREADS="1")


def _slc(env: dict, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slc", *map(str, args)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_blocker_really_blocks_torch(torchless_env):
    out = subprocess.run([sys.executable, "-c", "import torch"], env=torchless_env, capture_output=True, text=True)
    assert out.returncode == 1 and "no torch here" in out.stderr


def test_bundle_synthetic_and_verify_run_without_torch(torchless_env, tmp_path):
    built = _slc(torchless_env, "bundle", "synthetic", "--classes", 30, "--dim", 8, "--input-dim", 6, "--out",
                 tmp_path / "b")
    assert built.returncode == 0, built.stderr
    verified = _slc(torchless_env, "verify", tmp_path / "b")
    assert verified.returncode == 0, verified.stderr
    assert verified.stdout.startswith(f"OK {tmp_path / 'b'}: 30 classes")


def test_verify_without_torch_still_catches_a_tampered_file(torchless_env, tmp_path):
    assert _slc(torchless_env, "bundle", "synthetic", "--classes", 10, "--dim", 4, "--input-dim", 3,
                "--out", tmp_path / "b").returncode == 0
    bias = tmp_path / "b" / "head_bias.npy"
    data = bytearray(bias.read_bytes())
    data[-1] ^= 0xFF
    bias.write_bytes(bytes(data))
    out = _slc(torchless_env, "verify", tmp_path / "b")
    assert out.returncode == 1
    assert "head_bias.npy: sha256" in out.stderr


def test_serve_without_torch_answers_like_offline_math(torchless_env, bundle, bundle_path, offline, tmp_path):
    import httpx

    from tests.serving.helpers import free_port, wait_http_ready

    port = free_port()
    env = dict(torchless_env, SLC_HOME=str(tmp_path / "home"))
    proc = subprocess.Popen([sys.executable, "-m", "slc", "serve", str(bundle_path), "--port", str(port),
                             "--data-dir", str(tmp_path / "data")], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(url, proc, timeout=120)
        x = np.random.default_rng(3).standard_normal((3, bundle.input_shape[0])).astype(np.float32)
        r = httpx.post(f"{url}/v1/classes/4/detect", json={"inputs": x.tolist()}, timeout=30)
        assert r.status_code == 200, r.text
        got = np.array([e["logit"] for e in r.json()["results"]])
        np.testing.assert_allclose(got, offline.logits(x)[:, 4], rtol=1e-4, atol=1e-4)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert proc.returncode == 0


def test_trainer_command_without_torch_names_the_extra(torchless_env, tmp_path):
    out = _slc(torchless_env, "train", "--dataset", "digits", "--out", tmp_path / "run")
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'slc[train]'" in lines[0], out.stderr
