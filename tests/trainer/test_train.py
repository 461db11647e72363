"""The training recipe: run files, recomputed metrics, determinism, schedules, NaN, data-parallel."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from trainer.data import load_dataset
from trainer.losses import list_losses, register_loss
from trainer.metrics import slc_metrics
from trainer.train import TrainConfig, train
from trainer.runs import evaluate_run, load_run, run_logits

ROOT = Path(__file__).resolve().parents[2]


def _register_test_losses():
    """Two losses only these tests use: one records set_progress, one turns NaN (registered once;
    a name that starts with `_` is not listed, so the CLI never offers them)."""
    from trainer.losses import loss_class

    try:
        return loss_class("_test_progress")
    except KeyError:
        pass

    @register_loss("_test_progress")
    class ProgressRecorder(nn.Module):
        pols = False
        seen: list[float] = []

        def __init__(self, num_classes: int):
            super().__init__()
            type(self).seen = []

        def set_progress(self, fraction: float) -> None:
            type(self).seen.append(fraction)

        def forward(self, logits, target):
            return nn.functional.cross_entropy(logits, target)

    @register_loss("_test_nan")
    class NaNLoss(nn.Module):
        pols = False

        def __init__(self, num_classes: int):
            super().__init__()

        def forward(self, logits, target):
            return logits.sum() * float("nan")

    return ProgressRecorder


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cfg = TrainConfig(dataset="digits", backbone="mlp", backbone_params={"hidden": 32}, loss="ce", epochs=2, lr=0.01, seed=3)
    return train(cfg, out, progress=False)


def test_run_writes_every_file(digits_run):
    for name in ("config.json", "checkpoint.pt", "data.json", "metrics.json"):
        assert (digits_run / name).is_file(), name
    config = json.loads((digits_run / "config.json").read_text())
    assert config["loss"] == "ce" and config["seed"] == 3 and config["backbone_params"] == {"hidden": 32}
    assert config["versions"]["torch"] == torch.__version__
    info = json.loads((digits_run / "data.json").read_text())
    splits = load_dataset("digits")
    assert info["input_shape"] == [64] and info["classes"] == splits.classes
    assert info["mean"] == pytest.approx(float(splits.train[0].mean()), rel=1e-5)


def test_metrics_json_matches_recomputation(digits_run):
    stored = json.loads((digits_run / "metrics.json").read_text())
    for split in ("calibration", "test"):
        again = evaluate_run(digits_run, split=split)
        assert again.keys() == stored[split].keys()
        for key in again:
            assert again[key] == pytest.approx(stored[split][key], abs=1e-12), (split, key)
    # And independently of evaluate_run: the loaded model's logits through slc_metrics.
    model, _, _ = load_run(digits_run)
    x, y = load_dataset("digits").test
    assert slc_metrics(run_logits(model, x), y)["auprc"] == pytest.approx(stored["test"]["auprc"], abs=1e-12)
    assert stored["test"]["accuracy"] > 0.5  # 2 epochs of an MLP on digits learn something


def test_run_logits_batches_equal_one_pass(digits_run):
    model, _, _ = load_run(digits_run)
    x = load_dataset("digits").test[0]
    with torch.no_grad():
        whole = model(torch.tensor(x)).numpy()
    np.testing.assert_allclose(run_logits(model, x, batch_size=7), whole, rtol=1e-5, atol=1e-5)
    assert not model.training


def test_training_is_deterministic_for_a_seed(tmp_path):
    def weights(seed, name):
        cfg = TrainConfig(dataset="digits", backbone="linear", loss="batch_ce", epochs=2, lr=0.05, seed=seed)
        return torch.load(train(cfg, tmp_path / name, progress=False) / "checkpoint.pt", weights_only=True)

    a, b, c = weights(0, "a"), weights(0, "b"), weights(1, "c")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["head.weight"], c["head.weight"])


def test_set_progress_called_every_step_from_0_towards_1(tmp_path):
    recorder = _register_test_losses()
    cfg = TrainConfig(dataset="digits", backbone="linear", loss="_test_progress", epochs=3, batch_size=100, seed=0)
    train(cfg, tmp_path / "p", progress=False)
    steps = 3 * (len(load_dataset("digits").train[1]) // 100)
    assert recorder.seen == pytest.approx([s / steps for s in range(steps)])


def test_nan_loss_fails_loudly(tmp_path):
    _register_test_losses()
    cfg = TrainConfig(dataset="digits", backbone="linear", loss="_test_nan", epochs=1, seed=0)
    with pytest.raises(FloatingPointError):
        train(cfg, tmp_path / "nan", progress=False)
    assert not (tmp_path / "nan" / "metrics.json").exists()


def _run(cmd: list[str], env: dict) -> None:
    """Run a training command; a failure shows the end of its output (a CalledProcessError alone hides it)."""
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        pytest.fail(f"exit {done.returncode}: {' '.join(cmd[2:6])} ...\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("head_sample", [None, "0.5"], ids=["full-head", "sampled-head"])
def test_two_rank_data_parallel_equals_single_process(tmp_path, head_sample):
    """torchrun with 2 gloo ranks, each half of every batch, gives the single-process weights
    (linear backbone, per-example loss: DDP's mean of shard means is the batch mean); with a
    sampled head both ranks draw the same columns from the global batch."""
    args = ["--dataset", "digits", "--backbone", "linear", "--loss", "ce", "--epochs", "2", "--lr", "0.05",
            "--batch-size", "64", "--optimizer", "sgd", "--seed", "0"] + (["--head-sample", head_sample] if head_sample else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    _run([sys.executable, "-m", "slc", "train", *args, "--out", str(tmp_path / "one")], env)
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
          "slc", "train", *args, "--out", str(tmp_path / "two")], env)
    one = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=True)
    two = torch.load(tmp_path / "two" / "checkpoint.pt", weights_only=True)
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-5)
    assert json.loads((tmp_path / "two" / "config.json").read_text())["world_size"] == 2


@pytest.mark.integration
@pytest.mark.parametrize("loss", [pytest.param("ce", marks=pytest.mark.slow), "batch_ce"])
def test_two_rank_sharded_head_trains_the_single_process_head(tmp_path, loss):
    """torchrun, 2 ranks, --head-shard (each rank 5 of the 10 class rows): the checkpoint holds
    the one full head, equal to the head a single process trains without sharding."""
    args = ["--dataset", "digits", "--backbone", "linear", "--loss", loss, "--epochs", "2", "--lr", "0.05",
            "--batch-size", "64", "--optimizer", "sgd", "--seed", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    _run([sys.executable, "-m", "slc", "train", *args, "--out", str(tmp_path / "one")], env)
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
          "slc", "train", *args, "--head-shard", "--out", str(tmp_path / "two")], env)
    one = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=True)
    two = torch.load(tmp_path / "two" / "checkpoint.pt", weights_only=True)
    assert two["head.weight"].shape == (10, 64)
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-5)
    assert json.loads((tmp_path / "two" / "config.json").read_text())["head_shard"] is True


def test_table1_rows_are_means_of_their_runs(tmp_path, monkeypatch):
    """table1.json rows = mean/std over seeds of independently recomputed run metrics;
    normalized_ce = metrics of the ce models' softmax; the markdown prints 1 − x."""
    from tools.experiments.table1 import table1

    monkeypatch.setenv("SLC_CACHE_DIR", str(tmp_path / "cache"))
    result = table1(dataset="digits", seeds=2, epochs=1, lrs=[0.1], losses=["ce", "batch_ce"], out=tmp_path / "t1")
    saved = json.loads((tmp_path / "t1" / "table1.json").read_text())
    assert saved["rows"] == result["rows"] and saved["dataset"] == "digits" and saved["seeds"] == [0, 1]
    rows = {r["loss"]: r for r in saved["rows"]}
    assert list(rows) == ["ce", "batch_ce", "normalized_ce"]
    assert rows["batch_ce"]["pols"] and not rows["ce"]["pols"]

    runs = {loss: sorted((tmp_path / "cache").glob(f"digits-{loss}-R1-lr0.1-s*")) for loss in ("ce", "batch_ce")}
    x, y = load_dataset("digits").test
    for loss in ("ce", "batch_ce"):
        values = [evaluate_run(run)["p_at_r99"] for run in runs[loss]]
        assert rows[loss]["p_at_r99"] == pytest.approx(np.mean(values), abs=1e-12)
        assert rows[loss]["p_at_r99_std"] == pytest.approx(np.std(values, ddof=1), abs=1e-12)
    softmax_auprc = []
    for run in runs["ce"]:
        logits = run_logits(load_run(run)[0], x).astype(np.float64)
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        softmax_auprc.append(slc_metrics(probs / probs.sum(axis=1, keepdims=True), y)["auprc"])
    assert rows["normalized_ce"]["auprc"] == pytest.approx(np.mean(softmax_auprc), abs=1e-9)

    md = (tmp_path / "t1" / "table1.md").read_text()
    assert f"{1 - rows['ce']['auprc']:.3f} ± {rows['ce']['auprc_std']:.3f}" in md
    assert (tmp_path / "t1" / "pr_curve.png").stat().st_size > 1000


def test_sampled_head_trains_and_keeps_the_full_head(tmp_path):
    """--head-sample 0.3 on 30 synthetic classes: it learns (well above chance), the checkpoint holds
    all D rows, and the config records R."""
    cfg = TrainConfig(dataset="synthetic:C=30,d=16,n=40,sep=4", backbone="mlp", backbone_params={"hidden": 32},
                      loss="ce", epochs=6, lr=0.05, batch_size=32, optimizer="sgd", seed=1, head_sample=0.3)
    run = train(cfg, tmp_path / "run", progress=False)
    metrics = json.loads((run / "metrics.json").read_text())["test"]
    assert metrics["accuracy"] > 0.5  # chance is 1/30
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert state["head.weight"].shape[0] == 30
    assert json.loads((run / "config.json").read_text())["head_sample"] == 0.3


def test_streaming_model_metrics_equal_the_dense_ones(tmp_path, monkeypatch):
    """Past DENSE_METRICS_MAX the metrics stream over class chunks: the same numbers."""
    import trainer.runs as train_mod
    from trainer.data import load_dataset

    cfg = TrainConfig(dataset="digits", backbone="mlp", backbone_params={"hidden": 16}, loss="ce", epochs=1, seed=0)
    run = train(cfg, tmp_path / "run", progress=False)
    model, _, data_info = load_run(run)
    x, y = load_dataset("digits").test
    dense = train_mod.model_metrics(model, x, y)
    monkeypatch.setattr(train_mod, "DENSE_METRICS_MAX", 0)
    streamed = train_mod.model_metrics(model, x, y)
    for key, value in dense.items():
        assert streamed[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key


def test_sampled_nce_computes_only_the_targets_and_noise_columns(tmp_path, monkeypatch):
    """Training nce in sampled mode asks the head for the batch's targets and its t draws per
    example, never for all D columns; the run still learns (accuracy above chance)."""
    from models import ClassHead

    widths = []
    forward = ClassHead.forward

    def spy(self, h, cols=None):
        widths.append(self.weight.shape[0] if cols is None else len(cols))
        return forward(self, h, cols)

    monkeypatch.setattr(ClassHead, "forward", spy)
    cfg = TrainConfig(dataset="synthetic:C=300,d=16,n=12,sep=3.0", loss="nce", loss_params={"mode": "sampled", "t": 2},
                      epochs=3, batch_size=32, lr=0.01, val_every=0)  # no per-epoch full-head validation
    train(cfg, tmp_path / "run", progress=False)
    steps = 3 * (len(load_dataset(cfg.dataset).train[1]) // 32)
    training = widths[:steps]
    assert len(training) == steps and max(training) <= 32 * 3 < 300
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["test"]["accuracy"] > 10 / 300


@pytest.mark.slow
def test_two_node_torchrun_with_c10d_rendezvous_trains_the_sharded_head(tmp_path):
    """The multi-node command of docs/guide.md, its two 'nodes' as two torchrun processes here:
    c10d rendezvous, one rank each, --head-shard; rank 0 writes a run with the full head."""
    from tests.serving.helpers import free_port

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=test", "-m", "slc", "train", "--dataset", "digits",
           "--backbone", "linear", "--loss", "batch_ce", "--epochs", "1", "--batch-size", "64", "--head-shard",
           "--out", str(tmp_path / "run")]
    nodes = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(2)]
    assert [p.wait(300) for p in nodes] == [0, 0]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["world_size"] == 2 and config["head_shard"] is True
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["head.weight"].shape == (10, 64)


def test_losses_registered_by_tests_are_not_listed():
    """A name that starts with `_` builds but is never offered (the CLI's --loss choices, docs/cli.md)."""
    from trainer.losses import build_loss

    _register_test_losses()
    assert not [name for name in list_losses() if name.startswith("_")]
    assert build_loss("_test_nan", num_classes=3).forward is not None
    assert {"batch_ce", "bce", "ce"} <= set(list_losses())
