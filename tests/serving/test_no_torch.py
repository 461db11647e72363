"""The serving package never imports torch (a serving image carries none): checked in a fresh
interpreter that builds an app, runs its start-up and answers a query."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import importlib, json, pkgutil, sys, time
import serving
from serving.app import create_app
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
# every serving module except the torch baseline peer, which is not on the serving path
skipped = {"serving.bench.torch_peer"}
for m in pkgutil.iter_modules(serving.__path__):
    name = "serving." + m.name
    if name not in skipped:
        importlib.import_module(name)
print(json.dumps({"torch": "torch" in sys.modules, "status": status, "topk": topk}))
"""


def test_serving_never_imports_torch(bundle_path, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(bundle_path), str(tmp_path)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"torch": False, "status": 200, "topk": 200}, out.stderr
