"""Training speed of the glyphs3755 recipe: images/s and peak RSS for fp32, bf16, channels_last and
torch.compile, this code against an older commit's (docs/results/trainer-speed.md).

Each configuration runs `slc train` as its own process for a fixed wall time and is then stopped:
images/s come from the progress bar's step count between two readings after a warm-up (start-up,
data loading and compilation left out), peak RSS is the process's VmHWM from /proc just before it
is stopped. A whole epoch (821 steps of 256 at about 400 images/s) would take nine minutes per
configuration on two cores; the steady rate over a couple of minutes is the same number.

    python tools/train_speed.py --seconds 150 --warmup 45 [--before-root /tmp/before] --out docs/results
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ["--dataset", "glyphs3755", "--backbone", "resnet_glyph", "--backbone-param", "width=16", "--loss", "ce",
          "--epochs", "1", "--lr", "0.003", "--batch-size", "256", "--seed", "0"]
CONFIGS = {  # name -> extra options of this code's `slc train`
    "fp32": [],
    "bf16": ["--precision", "bf16"],
    "channels_last": ["--channels-last"],
    "bf16 + channels_last": ["--precision", "bf16", "--channels-last"],
    "compile": ["--compile"],
}
STEP = re.compile(r"(\d+)/(\d+) \[")


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(cmd: list[str], seconds: float, warmup: float, cwd: Path, env: dict) -> dict:
    """Run `cmd` for `seconds`; steps/s between `warmup` and the end, and the peak RSS."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    last = {"step": 0, "t": time.monotonic()}
    readings: list[tuple[float, int]] = []

    def read():
        buf = b""
        while chunk := proc.stderr.read1(4096):
            buf = (buf + chunk)[-4096:]
            found = STEP.findall(buf.decode("utf-8", "replace"))
            if found:
                last["step"], last["t"] = int(found[-1][0]), time.monotonic()

    threading.Thread(target=read, daemon=True).start()
    start = time.monotonic()
    while time.monotonic() - start < seconds and proc.poll() is None:
        time.sleep(0.5)
        if time.monotonic() - start >= warmup:
            readings.append((last["t"], last["step"]))
    peak = _peak_rss_mb(proc.pid) if proc.poll() is None else float("nan")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (t0, s0), (t1, s1) = readings[0], readings[-1]
    if s1 <= s0:
        raise RuntimeError(f"no progress measured for {' '.join(cmd[-6:])}: steps {s0} -> {s1}")
    return {"steps_per_s": (s1 - s0) / (t1 - t0), "steps_measured": s1 - s0, "peak_rss_mb": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=150)
    parser.add_argument("--warmup", type=float, default=45)
    parser.add_argument("--before-root", type=Path, help="a checkout of the older code (git worktree) to measure first")
    parser.add_argument("--before-label", default="before")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma list of: " + ", ".join(CONFIGS))
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        if args.before_root:
            runs.append((f"{args.before_label} fp32", args.before_root, []))
        runs += [(name, ROOT, CONFIGS[name]) for name in args.configs.split(",")]
        for i, (name, root, extra) in enumerate(runs):
            cmd = [sys.executable, "-m", "slc", "train", *RECIPE, *extra, "--out", f"{tmp}/run{i}"]
            run_env = {**env, "PYTHONPATH": str(root)}
            print(f"{name}: {args.seconds:.0f} s ...", file=sys.stderr, flush=True)
            r = measure(cmd, args.seconds, args.warmup, root, run_env)
            r |= {"config": name, "images_per_s": r["steps_per_s"] * 256}
            print(f"  {r['images_per_s']:.0f} images/s, peak RSS {r['peak_rss_mb']:.0f} MB", file=sys.stderr)
            rows.append(r)
    write(rows, args)


def write(rows: list[dict], args) -> None:
    import platform

    import torch

    from tools.report import md_table, write_result

    base = rows[0]["images_per_s"]
    command = "python tools/train_speed.py " + " ".join(sys.argv[1:])
    lines = ["# Training speed: one glyphs3755 epoch's recipe, by precision and layout", "",
             f"Command: `{command}`  ",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, no GPU.  ",
             f"Recipe: `slc train {' '.join(RECIPE)}` (821 steps of 256 images an epoch).  ",
             f"Each row: its own process, stopped after {args.seconds:.0f} s; images/s over the steps after the first "
             f"{args.warmup:.0f} s (start-up, data and compilation left out); peak RSS = VmHWM just before the stop.",
             "", md_table(["configuration", "images/s", "× first row", "epoch (min, at this rate)", "peak RSS (MB)"],
                          [[r["config"], f"{r['images_per_s']:.0f}", f"{r['images_per_s'] / base:.2f}",
                            f"{821 * 256 / r['images_per_s'] / 60:.1f}", f"{r['peak_rss_mb']:.0f}"] for r in rows], "lrrrr")]
    write_result(args.out, "trainer-speed", "\n".join(lines) + "\n", rows)
    print(f"-> {args.out / 'trainer-speed.md'}", file=sys.stderr)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # `python tools/train_speed.py` puts tools/ on the path, not the checkout
    main()
