"""Command-line messages that say what to do (issue 50, part 6): `slc serve` on a run folder says
`slc export` first; a port in use is one line and exit 2 before the bundle loads; next-command hints
name the program as the user can run it (`.venv/bin/slc` when no `slc` is on PATH); `slc train`
says what it chose as it starts, and warns when a timm backbone has no weights."""
from __future__ import annotations

import logging
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_cli import run

ROOT = Path(__file__).resolve().parents[2]


def _bundle(capsys, tmp_path: Path) -> Path:
    assert run(capsys, "bundle", "synthetic", "--classes", 5, "--dim", 4, "--input-dim", 3, "--out", tmp_path / "b")[0] == 0
    return tmp_path / "b"


def test_serving_a_run_folder_says_export_it_first(tmp_path, capsys, monkeypatch):
    import shutil

    folder = tmp_path / "runs" / "letters"
    folder.mkdir(parents=True)
    for name in ("config.json", "checkpoint.pt"):
        (folder / name).write_text("{}")
    monkeypatch.setattr(shutil, "which", lambda name: sys.argv[0] if name == "slc" else None)
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/slc"])
    code, _, err = run(capsys, "serve", folder)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{folder} is a training run, not a bundle: export it first with `slc export {folder} --out BUNDLE`" in err


def test_the_run_markers_are_the_trainers_run_files():
    from serving.bundle.cliopts import RUN_MARKERS
    from trainer.run_dir import RUN_FILES

    assert set(RUN_MARKERS) <= set(RUN_FILES)


@pytest.mark.integration
def test_a_port_in_use_is_one_line_and_exit_2_before_the_bundle_loads(tmp_path, capsys):
    from tests.serving.helpers import server_env

    bundle = _bundle(capsys, tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "slc", "serve", str(bundle), "--port", str(port),
                               "--data-dir", str(tmp_path / "data")], cwd=ROOT, env=server_env(tmp_path),
                              capture_output=True, text=True, timeout=120)
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2, (done.returncode, lines)
    assert lines == [f"error: port {port} on 127.0.0.1 is already in use (another slc serve?): pick another with "
                     f"--port {port + 1} (or SLC_PORT), or stop what listens there"]


@pytest.mark.parametrize("argv0,on_path,want", [
    ("/opt/app/.venv/bin/slc", None, "/opt/app/.venv/bin/slc"),  # the README's .venv/bin/slc, no slc on PATH
    ("{cwd}/.venv/bin/slc", None, ".venv/bin/slc"),  # under the working directory: as the user typed it
    ("/opt/app/.venv/bin/slc", "/opt/app/.venv/bin/slc", "slc"),  # PATH finds this very program
    ("/opt/app/.venv/bin/slc", "/usr/bin/slc", "/opt/app/.venv/bin/slc"),  # PATH finds another slc
])
def test_next_command_hints_name_the_program_as_the_user_runs_it(argv0, on_path, want, monkeypatch, tmp_path):
    import shutil

    from serving.bundle.cliopts import slc_command

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [argv0.format(cwd=tmp_path)])
    monkeypatch.setattr(shutil, "which", lambda name: on_path)
    assert slc_command() == want


def test_python_m_slc_hints_name_the_interpreter(monkeypatch):
    import shutil

    from serving.bundle.cliopts import slc_command

    monkeypatch.setattr(sys, "argv", [str(ROOT / "slc" / "__main__.py")])
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert slc_command().endswith(" -m slc") and Path(slc_command().split(" -m ")[0]).name.startswith("python")


def test_a_commands_hint_uses_the_running_program(tmp_path, capsys, monkeypatch):
    import shutil

    monkeypatch.setattr(sys, "argv", ["/opt/app/.venv/bin/slc"])
    monkeypatch.setattr(shutil, "which", lambda name: None)
    code, out, _ = run(capsys, "bundle", "synthetic", "--classes", 5, "--dim", 4, "--input-dim", 3, "--out", tmp_path / "b")
    assert code == 0
    assert f"-> /opt/app/.venv/bin/slc verify {tmp_path / 'b'}; /opt/app/.venv/bin/slc serve {tmp_path / 'b'}" in out


def test_the_start_line_says_what_was_chosen_and_warns_of_random_timm_weights():
    from trainer.start_line import start_lines

    resolved = {"backbone": "timm:resnet18", "weights": None, "input_shape": [3, 64, 64], "num_classes": 12,
                "loss": "ce", "batch_size": 32, "epochs": 30, "steps": 900, "steps_per_epoch": 30,
                "optimizer": "adam", "lr": 0.001, "schedule": "cosine", "device_resolved": "cpu", "precision": "fp32"}
    line, warning = start_lines(resolved)
    assert line == ("training: backbone timm:resnet18 (random init), input 3x64x64, 12 classes, loss ce, batch 32, "
                    "30 epochs (900 steps of 30/epoch), optimizer adam lr 0.001 (cosine), device cpu fp32")
    assert warning.startswith("warning: --backbone timm:resnet18 without --weights trains from random "
                              "initialisation, not from pretrained weights")
    weighted = start_lines({**resolved, "weights": "/w/resnet18.safetensors"})
    assert weighted == [line.replace("(random init)", "(pretrained weights /w/resnet18.safetensors)")]
    assert len(start_lines({**resolved, "backbone": "mlp"})) == 1


@pytest.mark.integration
def test_slc_train_prints_the_start_line_before_training(tmp_path, capsys, caplog):
    with caplog.at_level(logging.INFO, logger="trainer"):
        code, out, _ = run(capsys, "train", "--dataset", "digits", "--epochs", 1, "--batch-size", 64,
                           "--optimizer", "sgd", "--lr", 0.05, "--device", "cpu", "--out", tmp_path / "r")
    assert code == 0
    starts = [r.getMessage() for r in caplog.records if r.getMessage().startswith("training: ")]
    assert len(starts) == 1, [r.getMessage() for r in caplog.records]
    assert starts[0].startswith("training: backbone mlp (random init), input 64, 10 classes, loss batch_ce, "
                                "batch 64, 1 epochs (")
    assert starts[0].endswith("optimizer sgd lr 0.05 (cosine), device cpu fp32")
