"""tools/gpu_check.py (`make gpu-check`) where torch sees no CUDA device: one line, exit 0. The GPU
path itself needs a GPU; `--device cpu` runs the same pipeline with the CPU in bf16 (slow test)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "gpu_check.py"


def _run(*args: str, timeout: float, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **env))


def test_without_cuda_it_says_so_in_one_line_with_onnxruntimes_providers_and_exits_0():
    """CUDA_VISIBLE_DEVICES="" hides any GPU from torch, so this path is taken on every machine."""
    import onnxruntime as ort

    result = _run(timeout=120, CUDA_VISIBLE_DEVICES="")
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.splitlines()
    assert line.startswith("gpu-check: no CUDA device") and "torch.cuda.is_available() is False" in line
    assert line.endswith(f"providers: {', '.join(ort.get_available_providers())}; nothing checked")


@pytest.mark.slow
def test_the_whole_pipeline_passes_with_the_cpu_in_bf16_standing_in_for_the_gpu(tmp_path):
    """Two one-epoch trainings, export, a real server and its HTTP answers against full.onnx: every
    check passes (the table says ok on every row), so the GPU run differs only in its device."""
    result = _run("--device", "cpu", "--workdir", str(tmp_path), timeout=1800, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.rstrip().endswith((" ok", " FAIL"))]
    assert len(rows) >= 10 and all(r.rstrip().endswith(" ok") for r in rows), result.stdout
    for name in ("loss at step 0", "smoothed loss curve", "test accuracy", "server providers", "detect", "softmax"):
        assert any(r.startswith(name) for r in rows), (name, result.stdout)


def test_the_server_process_keeps_the_pythonpath_it_was_given(tmp_path, monkeypatch):
    """A second process started with the server's environment imports both the repository and a
    package found only through the caller's PYTHONPATH (how the GPU machine's packages were installed;
    replacing PYTHONPATH made `slc serve` exit at once there)."""

    from tests.serving.helpers import ROOT, server_env

    site = tmp_path / "site"
    site.mkdir()
    (site / "only_on_the_callers_path.py").write_text("VALUE = 7\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    env = server_env(tmp_path)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)
    code = "import only_on_the_callers_path as m, serving; print(m.VALUE, serving.__file__)"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    value, where = out.stdout.split()
    assert value == "7" and where.startswith(str(ROOT))
