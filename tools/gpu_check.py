"""`make gpu-check`: does a GPU machine train, export and serve with the CPU's answers?

Where torch sees no CUDA device it prints one line (with onnxruntime's providers) and exits 0.
Where it sees one:
1. glyphs-latin / resnet_glyph / ce, one epoch, the same seed, trained twice with the CLI: on the
   CPU in fp32 and on CUDA in bf16;
2. their loss curves (history.csv) and test metrics (metrics.json) are compared within the
   tolerances below;
3. the CUDA run is exported (`slc export`) and served (`slc serve --device cuda`) twice: as the
   warm-up chooses, and with SLC_SOFTMAX_IMPL=device (every pass over the D rows on the GPU);
   detect, softmax and exact top-k answers over HTTP are compared with onnxruntime on the CPU
   running the bundle's full.onnx, and GET /v1/model tells which execution providers the server
   really uses and where the head lives;
4. a table of every check; exit 1 when any fails (the work directory is kept then).

Tolerances, and why they are what they are: docs/results/gpu-check.md.
Run: .venv/bin/python tools/gpu_check.py [--workdir DIR [--reuse-runs]] [--seed N] [--keep] [--device cpu]
"""
from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import click
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # tests.serving.helpers: the server process and readiness wait the tests use
    sys.path.insert(0, str(ROOT))

TRAIN = ["--dataset", "glyphs-latin", "--backbone", "resnet_glyph", "--loss", "ce", "--epochs", "1"]
REFERENCE = ("cpu", "fp32")  # (--device, --precision) of the run the GPU's is compared with

# The training comparison: bf16 on the GPU against fp32 on the CPU, same seed. A GPU run may not
# drift from the CPU's further than another seed does; the limits are about twice the largest
# seed-to-seed difference measured on the CPU (AUPRC's, tiny, four times the largest of bf16's
# and the seeds'), docs/results/gpu-check.md; bf16 alone moved the curve 1.3 %, accuracy 0.033
# and AUPRC 0.008 at most.
FIRST_LOSS_REL = 0.02  # step 0's loss: same weights, same batch, only the rounding differs (measured 0.0002)
CURVE_REL = 0.08  # mean |smoothed test curve - smoothed CPU curve| / mean smoothed CPU loss (seeds: 0.040)
METRIC_ABS = {"accuracy": 0.10, "auprc": 0.03}  # test metrics after one epoch, absolute (seeds: 0.045, 0.005)
# The serving comparison: CUDA kernels (TF32 and cuDNN's algorithms allowed) against onnxruntime on
# the CPU, in float64 after the float32 graph. Relative to the input's largest |logit| (at least 1).
LOGIT_REL = 1e-2
PROVIDER = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}  # what the server must run on
READY_TIMEOUT_S = 300.0


@dataclass
class Check:
    name: str
    value: str
    limit: str
    ok: bool


def no_cuda_line() -> str | None:
    """The one line printed where torch sees no CUDA device; None where it sees one."""
    import onnxruntime as ort
    import torch

    if torch.cuda.is_available():
        return None
    return (f"gpu-check: no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False); "
            f"onnxruntime {ort.__version__} providers: {', '.join(ort.get_available_providers())}; nothing checked")


def slc(*args: str) -> int:
    """`python -m slc ARGS` in the repository, its output on the terminal (progress bars included)."""
    click.echo("$ slc " + " ".join(args), err=True)
    return subprocess.run([sys.executable, "-m", "slc", *args], cwd=ROOT).returncode


def train_both(work: Path, seed: int, device: str, reuse: bool = False) -> tuple[list[Check], dict[str, Path]]:
    """The reference run and the one under test ({device} in bf16), the same seed; with `reuse`, runs
    an earlier gpu-check finished in `work` are taken as they are (the serving checks again, no training)."""
    checks, runs = [], {}
    for name, (device, precision) in {"reference": REFERENCE, "test": (device, "bf16")}.items():
        run = work / f"run-{name}"
        if reuse and (run / "metrics.json").exists():
            checks.append(Check(f"train {device} {precision}", "reused", "exit 0", True))
            runs[name] = run
            continue
        shutil.rmtree(run, ignore_errors=True)
        t0 = time.perf_counter()
        code = slc("train", *TRAIN, "--seed", str(seed), "--device", device, "--precision", precision,
                   "--out", str(run))
        took = f"exit {code}, {time.perf_counter() - t0:.0f} s"
        checks.append(Check(f"train {device} {precision}", took, "exit 0", code == 0))
        if code == 0:
            runs[name] = run
    return checks, runs


def loss_curve(run: Path) -> np.ndarray:
    """Training loss per step [steps] from history.csv (its `step` rows; the per-epoch ones have no loss)."""
    with open(run / "history.csv", newline="") as f:
        by_step = {int(float(r["step"])): float(r["loss"]) for r in csv.DictReader(f)
                   if r.get("kind", "step") == "step" and r.get("loss")}
    return np.array([by_step[s] for s in sorted(by_step)], dtype=np.float64)


def smooth(curve: np.ndarray) -> np.ndarray:
    """Moving mean over an eighth of the epoch: batch-to-batch noise out, the trend kept."""
    w = max(1, len(curve) // 8)
    return np.convolve(curve, np.ones(w) / w, mode="valid")


def compare_training(cpu: Path, cuda: Path, label: str) -> list[Check]:
    """The run under test (`label`, e.g. "cpu / cuda") against the reference: curves and test metrics."""
    a, b = loss_curve(cpu), loss_curve(cuda)  # [steps] each
    checks = [Check("loss curves: steps, all finite", f"{len(a)} / {len(b)}", "equal, finite",
                    len(a) == len(b) > 0 and bool(np.isfinite(a).all() and np.isfinite(b).all()))]
    if not checks[0].ok:
        return checks
    first = abs(b[0] - a[0]) / abs(a[0])
    checks.append(Check("loss at step 0 (rel. diff)", f"{first:.4f}", f"<= {FIRST_LOSS_REL}", first <= FIRST_LOSS_REL))
    sa, sb = smooth(a), smooth(b)
    curve = float(np.abs(sb - sa).mean() / sa.mean())
    checks.append(Check("smoothed loss curve (mean rel. diff)", f"{curve:.4f}", f"<= {CURVE_REL}", curve <= CURVE_REL))
    ma, mb = (json.loads((r / "metrics.json").read_text())["test"] for r in (cpu, cuda))
    for key, limit in METRIC_ABS.items():
        d = abs(float(mb[key]) - float(ma[key]))
        checks.append(Check(f"test {key}: {label}", f"{ma[key]:.4f} / {mb[key]:.4f}", f"|diff| <= {limit}", d <= limit))
    return checks


def probe_inputs(bundle: Path, seed: int) -> np.ndarray:
    """[24, *input] float32: the bundle's 8 sample inputs (real images), their pairwise means, and
    those means with a little seeded noise."""
    x = np.load(bundle / "samples.npz")["input"].astype(np.float32)  # [8, *input]
    rng = np.random.default_rng(seed)
    mixed = (x + np.roll(x, 1, axis=0)) / 2
    noisy = mixed + rng.normal(0, 0.05 * float(x.std()), size=x.shape).astype(np.float32)
    return np.concatenate([x, mixed, noisy]).astype(np.float32)


def offline_logits(bundle: Path, x: np.ndarray) -> np.ndarray:
    """All D logits [N, D] in float64 from full.onnx under onnxruntime on the CPU."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(bundle / "full.onnx"), providers=["CPUExecutionProvider"])
    return session.run(None, {"input": x})[0].astype(np.float64)


def check_detect(post, b, x: np.ndarray, z: np.ndarray, tol: np.ndarray, classes: list[int]) -> Check:
    """Logit, probability and match of detect for each class against the offline logits."""
    worst, bad = 0.0, []
    for j in classes:
        r = post(b, j, "detect", {"inputs": x.tolist()})
        got = np.array([e["logit"] for e in r["results"]])  # [N]
        worst = max(worst, float((np.abs(got - z[:, j]) / tol).max()))
        a, c = float(b.platt_a[j]), float(b.platt_b[j])
        p = 1 / (1 + np.exp(-(a * z[:, j] + c)))  # [N], sigmoid' <= 1/4
        if (np.abs(np.array([e["probability"] for e in r["results"]]) - p) > abs(a) * tol / 4 + 1e-6).any():
            bad.append(f"probability of class {j}")
        cut = r["threshold"]
        clear = np.abs(z[:, j] - cut) > tol  # decisions not within rounding of the threshold
        match = np.array([e["match"] for e in r["results"]])
        if (match[clear] != (z[clear, j] >= cut)).any() or abs(cut - float(b.thresholds[j])) > 1e-6:
            bad.append(f"match of class {j}")
    return Check(f"detect x {len(classes)} classes (worst |dz| / tol)", _value(worst, bad), "<= 1",
                 worst <= 1 and not bad)


def _value(worst: float, bad: list[str]) -> str:
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    return f"{worst:.3f}" + (f"; {', '.join(bad[:3])}{more}" if bad else "")


def check_softmax(post, b, x: np.ndarray, z: np.ndarray, tol: np.ndarray, classes: list[int]) -> Check:
    """Softmax probability and is_top1 for each class against the float64 softmax of the offline logits."""
    e = np.exp(z - z.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)  # [N, D]
    top2 = np.sort(z, axis=1)[:, -2:]  # [N, 2]
    clear = top2[:, 1] - top2[:, 0] > 2 * tol  # the top class is not within rounding of the runner-up
    worst, bad = 0.0, []
    for j in classes:
        r = post(b, j, "softmax", {"inputs": x.tolist()})
        got = np.array([e["probability"] for e in r["results"]])  # [N]
        limit = 2.2 * tol * p[:, j] + 1e-6  # [N]: |d log p| <= 2 max|dz|
        worst = max(worst, float((np.abs(got - p[:, j]) / limit).max()))
        top1 = np.array([e["is_top1"] for e in r["results"]])
        if (top1[clear] != (z[clear].argmax(axis=1) == j)).any():
            bad.append(f"is_top1 of class {j}")
    return Check(f"softmax x {len(classes)} classes (worst |dp| / tol)", _value(worst, bad), "<= 1",
                 worst <= 1 and not bad)


def check_topk(url: str, x: np.ndarray, z: np.ndarray, tol: np.ndarray, k: int = 5) -> Check:
    """Exact top-k ids against the offline logits (where the k-th and (k+1)-th are apart by more than rounding)."""
    import httpx

    r = httpx.post(url + "/v1/topk", json={"inputs": x.tolist(), "k": k, "mode": "exact"}, timeout=120)
    r.raise_for_status()
    got = [[e["class_id"] for e in row] for row in r.json()["results"]]
    srt = np.sort(z, axis=1)[:, ::-1]  # [N, D] descending
    clear = (srt[:, :k][:, :-1] - srt[:, 1:k] > 2 * tol[:, None]).all(axis=1)
    if z.shape[1] > k:
        clear &= srt[:, k - 1] - srt[:, k] > 2 * tol
    want = np.argsort(-z, axis=1, kind="stable")[:, :k].tolist()
    wrong = [i for i in range(len(x)) if clear[i] and got[i] != want[i]]
    return Check(f"top-{k} exact ids ({int(clear.sum())} inputs clear of rounding)", f"{len(wrong)} wrong", "0",
                 not wrong)


def serve(bundle: Path, work: Path, seed: int, device: str, **env: str) -> list[Check]:
    """The bundle served with --device DEVICE (env: more SLC_* settings); its providers and its answers
    against offline math. With SLC_SOFTMAX_IMPL=device: the head resident on the device too."""
    import httpx

    from serving.bundle import load_bundle
    from tests.serving.helpers import free_port, serve_process

    port = free_port()
    tag = "-".join(env.values() or ["default"])
    proc = serve_process(bundle, work / ("serve-" + tag), port, "--device", device, **env)
    log: list[str] = []
    log_path = work / f"serve-{tag}.log"  # the server's whole output, kept with the work folder

    def drain() -> None:  # a full pipe would stall the server
        with open(log_path, "w") as f:
            for line in proc.stdout:
                log.append(line)
                f.write(line)
                f.flush()

    threading.Thread(target=drain, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    click.echo(f"serving {bundle} with --device {device} {' '.join(f'{k}={v}' for k, v in env.items())} "
               f"(log: {log_path})", err=True)
    try:
        failed = wait_serving(url, proc, log, READY_TIMEOUT_S)
        if failed:
            return [Check(f"slc serve --device {device} ready", failed[:200], "ready", False)]
        info = httpx.get(url + "/v1/model", timeout=30).json()
        first = PROVIDER[device]
        checks = [Check("server providers in use", ", ".join(info["providers"]), f"{first} first",
                        info["providers"][:1] == [first] and info["device"] == device)]
        if env.get("SLC_SOFTMAX_IMPL") == "device":
            where = info.get("head_device", {})
            checks.append(Check("head resident on the device", f"{info['softmax_impl']}, {where}",
                                f"device, resident {device}",
                                info["softmax_impl"] == "device" and where.get("resident") == device))
        b = load_bundle(bundle)
        x = probe_inputs(bundle, seed)
        z = offline_logits(bundle, x)  # [N, D]
        tol = LOGIT_REL * np.maximum(np.abs(z).max(axis=1), 1.0)  # [N]
        classes = sorted({int(j) for j in z.argmax(axis=1)} | {0, b.num_classes - 1})[:10]

        def post(b, j: int, route: str, body: dict) -> dict:
            """POST /v1/classes/{name}/route: by name (a glyph class named "7" is not class id 7)."""
            r = httpx.post(f"{url}/v1/classes/{quote(b.classes[j], safe='')}/{route}", json=body, timeout=120)
            r.raise_for_status()
            assert r.json()["class_id"] == j, (j, r.json()["class_id"])
            return r.json()

        return checks + [check_detect(post, b, x, z, tol, classes), check_softmax(post, b, x, z, tol, classes),
                         check_topk(url, x, z, tol)]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_serving(url: str, proc: subprocess.Popen, log: list[str], timeout: float) -> str | None:
    """Wait for readiness, saying every 20 s what the server last logged; None once ready, else why not
    (the process exited, or the time ran out), with its last lines."""
    import httpx

    t0 = time.monotonic()
    said = t0
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            time.sleep(0.2)  # the drain thread's last lines
            return f"exited ({proc.returncode}): " + " | ".join(x.strip() for x in log[-4:])
        try:
            if httpx.get(url + "/v1/health/ready", timeout=1).status_code == 200:
                click.echo(f"  ready in {time.monotonic() - t0:.0f} s", err=True)
                return None
        except httpx.TransportError:
            pass
        if time.monotonic() - said >= 20:
            said = time.monotonic()
            click.echo(f"  not ready after {said - t0:.0f} s; last logged: {log[-1].strip() if log else '-'}", err=True)
        time.sleep(0.1)
    return f"not ready after {timeout:.0f} s: " + " | ".join(x.strip() for x in log[-4:])


def table(checks: list[Check]) -> str:
    rows = [("check", "value", "limit", "")] + [(c.name, c.value, c.limit, "ok" if c.ok else "FAIL") for c in checks]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows)


def gpu_checks(work: Path, seed: int, device: str, reuse: bool = False) -> list[Check]:
    import onnxruntime as ort
    import torch

    name = torch.cuda.get_device_name(0) if device == "cuda" else "none: the CPU in bf16 stands in (--device cpu)"
    checks = [Check("device under test", name, "-", True)]
    train_checks, runs = train_both(work, seed, device, reuse)
    checks += train_checks
    if len(runs) == 2:
        checks += compare_training(runs["reference"], runs["test"], f"{REFERENCE[0]} / {device}")
    if "test" not in runs:
        return checks
    available = ort.get_available_providers()
    checks.append(Check(f"onnxruntime has {PROVIDER[device]}", ", ".join(available),
                        "listed (make setup: onnxruntime-gpu where nvidia-smi works)", PROVIDER[device] in available))
    bundle = work / "bundle"
    code = slc("export", str(runs["test"]), "--out", str(bundle))
    checks.append(Check(f"export the {device} run", f"exit {code}", "exit 0", code == 0))
    if code == 0 and checks[-2].ok:
        checks += serve(bundle, work, seed, device)
        checks += serve(bundle, work, seed, device, SLC_SOFTMAX_IMPL="device")  # every pass over D on the device
    return checks


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="runs, bundle and server data [default: a new temporary folder]")
@click.option("--seed", type=int, default=0, show_default=True, help="training seed of both runs")
@click.option("--keep", is_flag=True, help="keep the work folder when every check passes")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="cpu: the same checks with the CPU in bf16 standing in for the GPU (tries this tool without one)")
@click.option("--reuse-runs", is_flag=True,
              help="with --workdir: take the runs an earlier gpu-check finished there instead of training again")
def main(workdir: Path | None, seed: int, keep: bool, device: str, reuse_runs: bool) -> None:
    """Train, export and serve on CUDA against the CPU (exit 1 on a mismatch); one line without CUDA."""
    try:
        line = no_cuda_line() if device == "cuda" else None
    except ImportError as exc:
        raise click.UsageError(f"gpu-check needs the train extra ({exc.name} is not installed): make setup") from None
    if line is not None:
        click.echo(line)
        return
    if reuse_runs and workdir is None:
        raise click.UsageError("--reuse-runs needs --workdir (the folder of an earlier gpu-check)")
    work = workdir or Path(tempfile.mkdtemp(prefix="slc-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    checks = gpu_checks(work, seed, device, reuse_runs)
    click.echo(table(checks))
    failed = [c.name for c in checks if not c.ok]
    if failed or keep or workdir:
        click.echo(f"work folder: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    if failed:
        click.echo(f"gpu-check: {len(failed)} check(s) failed: {'; '.join(failed)}", err=True)
        sys.exit(1)
    click.echo(f"gpu-check: all {len(checks)} checks passed")


if __name__ == "__main__":
    main()
