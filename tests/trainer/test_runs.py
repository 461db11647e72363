"""Runs a user can trust: exact resume, Ctrl-C, refusing to overwrite, the learning curve, the best
weights, early stopping, warmup, devices and precision."""
import csv
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.loader import EpochBatches, batch_loader
from trainer.train import TrainConfig, TrainingInterrupted, resume_config, train
from trainer.runs import load_run, model_metrics

ROOT = Path(__file__).resolve().parents[2]
SLC = [sys.executable, "-m", "slc"]


def _cfg(**kw) -> TrainConfig:
    base = dict(dataset="digits", backbone="mlp", backbone_params={"hidden": 32}, loss="ce", epochs=2, lr=0.01,
                seed=5, batch_size=64)
    return TrainConfig(**{**base, **kw})


def _weights(run: Path, name: str = "checkpoint.pt") -> dict:
    return torch.load(run / name, map_location="cpu", weights_only=True)


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _history(run: Path, timings: bool = True) -> list[dict]:
    with open(run / "history.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return rows if timings else [{k: v for k, v in r.items() if k not in ("images_per_s", "val_seconds")} for r in rows]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Two epochs in one go: the reference the interrupted runs must equal."""
    return train(_cfg(), tmp_path_factory.mktemp("straight") / "run", progress=False)


def test_one_epoch_then_resume_equals_two_epochs_straight(straight, tmp_path):
    steps_per_epoch = json.loads((straight / "config.json").read_text())["steps_per_epoch"]
    with pytest.raises(TrainingInterrupted):
        train(_cfg(), tmp_path / "run", progress=False, stop_at_step=steps_per_epoch)
    train(resume_config(tmp_path / "run"), tmp_path / "run", progress=False, resume=True)
    _assert_same_weights(_weights(straight), _weights(tmp_path / "run"))
    _assert_same_weights(_weights(straight, "best.pt"), _weights(tmp_path / "run", "best.pt"))
    assert _history(straight, timings=False) == _history(tmp_path / "run", timings=False)


def test_resume_mid_epoch_equals_straight(straight, tmp_path):
    with pytest.raises(TrainingInterrupted):
        train(_cfg(), tmp_path / "run", progress=False, stop_at_step=3)
    train(resume_config(tmp_path / "run"), tmp_path / "run", progress=False, resume=True)
    _assert_same_weights(_weights(straight), _weights(tmp_path / "run"))


def test_ctrl_c_saves_and_prints_the_resume_command(straight, tmp_path):
    """A real SIGINT to `slc train`: exit 130, one line naming the resume command, and resuming
    gives the straight run's weights."""
    run = tmp_path / "run"
    args = ["train", "--dataset", "digits", "--backbone", "mlp", "--backbone-param", "hidden=32", "--loss", "ce",
            "--epochs", "2", "--lr", "0.01", "--seed", "5", "--batch-size", "64", "--checkpoint-every", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(SLC + args + ["--out", str(run)], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list((run / "checkpoints").glob("step-*.pt")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("the run finished before the signal landed")
    assert proc.returncode == 130, err
    assert f"slc train --resume {run}" in err.strip().splitlines()[-1]
    assert "Traceback" not in err
    assert json.loads((run / "config.json").read_text())["status"] == "interrupted"
    done = subprocess.run(SLC + ["train", "--resume", str(run)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    _assert_same_weights(_weights(straight), _weights(run))


def test_out_onto_an_existing_run_is_refused_in_one_line(straight):
    before = (straight / "checkpoint.pt").stat().st_mtime_ns
    r = subprocess.run(SLC + ["train", "--dataset", "digits", "--epochs", "1", "--out", str(straight)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "already holds a run" in r.stderr and "--overwrite" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert (straight / "checkpoint.pt").stat().st_mtime_ns == before


def test_overwrite_replaces_the_run(straight, tmp_path):
    run = shutil.copytree(straight, tmp_path / "run")
    (run / "notes.txt").write_text("mine")
    train(_cfg(epochs=1), run, progress=False, overwrite=True)
    assert json.loads((run / "config.json").read_text())["epochs"] == 1 and (run / "checkpoint.pt").is_file()
    assert (run / "notes.txt").read_text() == "mine"  # not the run's: kept


def test_history_has_every_step_and_epoch_and_a_plot(straight):
    config = json.loads((straight / "config.json").read_text())
    rows = _history(straight)
    steps = [r for r in rows if r["kind"] == "step"]
    epochs = [r for r in rows if r["kind"] == "epoch"]
    assert [int(r["step"]) for r in steps] == list(range(1, config["steps"] + 1))
    assert [int(r["step"]) for r in epochs] == [config["steps_per_epoch"], 2 * config["steps_per_epoch"]]
    assert all(math.isfinite(float(r["loss"])) and float(r["grad_norm"]) > 0 for r in steps)
    assert (straight / "curves.png").stat().st_size > 10_000


def test_best_weights_are_the_best_validated_epoch(tmp_path):
    """best.pt recomputed on the calibration split gives the history's best accuracy, and the run's
    checkpoint.pt is those weights."""
    run = train(_cfg(epochs=3, lr=0.05), tmp_path / "run", progress=False)
    epochs = [r for r in _history(run) if r["kind"] == "epoch"]
    best = max(float(r["cal_accuracy"]) for r in epochs)
    model, _, _ = load_run(run)
    from trainer.data import load_dataset

    recomputed = model_metrics(model, *load_dataset("digits").calibration)["accuracy"]
    assert recomputed == pytest.approx(best, abs=1e-6)  # history.csv keeps 6 significant digits
    _assert_same_weights(_weights(run), _weights(run, "best.pt"))


def test_early_stopping_stops_after_patience_validations_without_gain(tmp_path):
    """With a learning rate of 0 nothing changes, so accuracy never improves after the first
    validation: patience 1 stops after the second epoch. (A tiny rate is not nothing: from the
    zero head, the first steps alone decide every argmax.)"""
    run = train(_cfg(epochs=5, lr=0.0, schedule="constant", warmup_steps=0, patience=1), tmp_path / "run",
                progress=False)
    config = json.loads((run / "config.json").read_text())
    assert config["stopped_early"] and config["step"] == 2 * config["steps_per_epoch"]


def test_lr_follows_warmup_then_cosine(straight):
    config = json.loads((straight / "config.json").read_text())
    warm, total, lr = config["warmup_steps_resolved"], config["steps"], config["lr"]
    logged = [float(r["lr"]) for r in _history(straight) if r["kind"] == "step"]
    want = [lr * ((s + 1) / (warm + 1) if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))
            for s in range(total)]
    np.testing.assert_allclose(logged, want, rtol=1e-5)


def test_loader_gives_the_same_batches_with_0_and_2_workers():
    x = np.lib.format.open_memmap(Path(os.environ.get("TMPDIR", "/tmp")) / f"loader-{os.getpid()}.npy", mode="w+",
                                  dtype=np.uint8, shape=(103, 1, 4, 4))
    x[:] = np.random.default_rng(0).integers(0, 255, x.shape)
    y = np.arange(103) % 7

    def batches(workers):
        sampler = EpochBatches(len(y), 16, seed=3, epoch=2)
        return [(b[0].numpy(), b[1].numpy(), b[2].numpy()) for b in batch_loader(x, y, sampler, workers=workers)]

    zero, two = batches(0), batches(2)
    assert len(zero) == 103 // 16
    for (x0, y0, i0), (x2, y2, i2) in zip(zero, two, strict=True):
        np.testing.assert_array_equal(x0, x2)
        np.testing.assert_array_equal(y0, y2)
        np.testing.assert_array_equal(x0, x[i0].astype(np.float32))  # the rows the indices name
        np.testing.assert_array_equal(y0, y[i0])
    seen = np.concatenate([i for _, _, i in zero])
    assert len(set(seen.tolist())) == len(seen)  # an epoch never repeats an example


def test_device_cuda_without_cuda_is_one_line_exit_2(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: make gpu-check covers the GPU path")
    r = subprocess.run(SLC + ["train", "--dataset", "digits", "--device", "cuda", "--out", str(tmp_path / "r")],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "CUDA is not available" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists()


def test_bf16_on_cpu_learns_like_fp32(straight, tmp_path):
    """bf16 autocast on the CPU: the loss curve stays close to fp32's and the test accuracy too."""
    run = train(_cfg(precision="bf16", device="cpu"), tmp_path / "run", progress=False)
    fp32 = [float(r["loss"]) for r in _history(straight) if r["kind"] == "step"]
    bf16 = [float(r["loss"]) for r in _history(run) if r["kind"] == "step"]
    assert np.mean(np.abs(np.array(fp32) - np.array(bf16))) < 0.05
    acc = {r: json.loads((r / "metrics.json").read_text())["test"]["accuracy"] for r in (straight, run)}
    assert abs(acc[straight] - acc[run]) < 0.03 and acc[run] > 0.8


def test_max_steps_is_a_budget_that_ends_the_schedule(tmp_path):
    """--max-steps 5 of a 2-epoch run: 5 steps, the cosine schedule reaching 0 at the last, then one
    validation and the final files as for any run."""
    run = train(_cfg(max_steps=5, warmup_steps=0), tmp_path / "run", progress=False)
    rows = _history(run)
    steps = [r for r in rows if r["kind"] == "step"]
    assert [int(r["step"]) for r in steps] == [1, 2, 3, 4, 5]
    want = [0.01 * 0.5 * (1 + math.cos(math.pi * s / 5)) for s in range(5)]
    np.testing.assert_allclose([float(r["lr"]) for r in steps], want, rtol=1e-5)
    assert [int(r["step"]) for r in rows if r["kind"] == "epoch"] == [5]
    assert json.loads((run / "config.json").read_text())["status"] == "completed"


def test_the_run_cache_key_changes_with_the_config_and_with_the_code(monkeypatch):
    """One key for every experiment: a changed option or a changed loss module is a new run."""
    import tools.experiments.run_cache as rc

    base = rc.run_key(_cfg())
    assert rc.run_key(_cfg()) == base
    assert rc.run_key(_cfg(lr=0.02)) != base
    monkeypatch.setattr(rc, "code_fingerprint", lambda loss: "edited")
    assert rc.run_key(_cfg()) != base
