"""`slc bench gpu` (`make gpu-check`): the one prepared GPU check of issue 52, made so that a GPU machine
answers it in one call within a budget (8 minutes by default).

Phases, in the order they run, each skipped (and said so) when the budget left cannot hold it:
1. correctness: tools/gpu_check.py (train on CUDA and the CPU, export, serve, answers against offline
   math) in a subprocess, under what is left of its share of the budget;
2. at the middle D (10^6 by default): slc (float32) and the onnxruntime peer (tools/bench/ort_peer.py:
   FastAPI over full.onnx and single.onnx) on the same device, by the same client: one-connection p50 of
   detect, softmax p(j) and exact top-k, saturated softmax and saturated detect; and the one-connection
   breakdown: detect through the batcher's worker (SLC_INLINE_MAX_MS=0) against inline (the hop), the
   device pass alone (tools/bench/device_profile.py), and what neither accounts for;
3. the other D, the largest first (10^7, then 10^5): slc and the peer in float32;
4. the bf16 and int8 heads at each D in the same order (slc; the peer has no quantized graphs).

Without CUDA (`--device cuda`, the default) it prints one line and exits 0. `--device cpu` runs the same
phases on the CPU provider at tiny D (SLC_SOFTMAX_IMPL=device: the device pass's graphs on the CPU), a
smoke run of the whole script that a test runs; its figures say nothing about a GPU.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from tools.report import fmt, md_table

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CLASSES = {"cuda": (100_000, 1_000_000, 10_000_000), "cpu": (2_000, 20_000)}
DEFAULT_DIM = {"cuda": 256, "cpu": 32}
BUDGET_S = 480.0
CHECK_SHARE = 0.45  # of the budget, at most, for the correctness phase (trainings on the CPU and the GPU)
SATURATE = {"cuda": 128, "cpu": 16}
ORDER = ("float32", "bf16", "int8")


def reserve_s(classes: int, device: str) -> float:
    """Seconds one server at D classes needs at least (bundle, start, warm-up, the measured runs): a
    measurement is not started with less left. On the H200, 10^6 was ready in 9 s and 10^7 in 68 s
    (docs/results/gpu-serving.md); the bundles themselves are built on first use."""
    return (25.0 + 1.2e-5 * classes) if device == "cuda" else 12.0


def build_s(classes: int, dim: int, precision: str) -> float:
    """Seconds to build the synthetic bundle (and add a quantized head) where the cache lacks it: about
    15 s per 10^6 rows of d = 256 (an estimate: writing the rows and hashing them), 0 when cached."""
    import json as _json

    from tools.bench.run import bundle_cache_path

    path = bundle_cache_path(classes, dim)
    per_row = 1.5e-5 * dim / 256
    if not (path / "manifest.json").exists():
        return per_row * classes * (2 if precision != "float32" else 1)
    heads = _json.loads((path / "manifest.json").read_text()).get("heads") or {}
    return 0.0 if precision == "float32" or precision in heads else per_row * classes


def no_cuda_line() -> Optional[str]:
    """The one line printed where no onnxruntime CUDA session opens; None where one does."""
    import onnxruntime as ort

    from serving.core.device.backend import preload_cuda, usable_providers

    preload_cuda()
    usable = usable_providers()
    if "CUDAExecutionProvider" in usable:
        return None
    return (f"gpu-check: no CUDA device (onnxruntime {ort.__version__}: a session gets {', '.join(usable)}); "
            "nothing measured")


class Budget:
    """Seconds left of the whole check; `skipped` lists what did not fit, and why."""

    def __init__(self, total: float):
        self.total, self.t0, self.skipped = total, time.monotonic(), []

    def left(self) -> float:
        return self.total - (time.monotonic() - self.t0)

    def allows(self, what: str, need: float) -> bool:
        if self.left() >= need:
            return True
        self.skipped.append(f"{what}: needs about {need:.0f} s, {max(0.0, self.left()):.0f} s left")
        log.warning("skipped %s", self.skipped[-1])
        return False


def correctness(device: str, timeout: float, work: Path) -> dict:
    """tools/gpu_check.py in a subprocess: its exit status, its last line and the seconds it took."""
    t0 = time.monotonic()
    argv = [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--device", device, "--workdir", str(work)]
    # a session of its own: on time-out its trainings and servers are stopped with it, not left beside the bench
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"rc": None, "summary": f"not finished within {timeout:.0f} s", "table": [],
                "seconds": time.monotonic() - t0}
    lines = [line for line in (stdout + stderr).splitlines() if line.startswith("gpu-check:")]
    table = [line for line in stdout.splitlines() if line.rstrip().endswith((" ok", " FAIL"))]
    return {"rc": proc.returncode, "summary": lines[-1] if lines else (stdout + stderr).strip()[-300:],
            "table": table, "seconds": time.monotonic() - t0}


def measure_peer(bundle: Path, device: str, duration: float, log_dir: Path, saturate: int) -> dict:
    """The onnxruntime peer on `device`, measured as device.measure measures slc (no all-logits route)."""
    from tools import loadtest as lt
    from tools.bench.device import SINGLE, _model, saturated
    from tools.bench.server import ort_peer_server, process_tree_memory
    from tools.loadtest.stats import endpoint_summary

    with ort_peer_server(bundle, log_dir, f"{bundle.name}-{device}", "cuda" if device == "cuda" else "cpu") as peer:
        ready_s = peer.wait_ready(1800)
        model = _model(peer.url)
        one = lt.run_loadtest(peer.url, SINGLE, concurrency=1, duration=duration * len(SINGLE), warmup=1.0,
                              interleave="request")
        sat, sat_cpu = saturated(peer, "softmax", saturate, duration, 2.0)
        sat_detect, detect_cpu = saturated(peer, "detect", saturate, duration, 1.0)
        rss = process_tree_memory(peer.proc.pid)["rss"]
    single = endpoint_summary(one.report)
    return {"device": device, "precision": "float32", "ready_s": ready_s, "rss": rss,
            "chosen": {"providers": model["providers"]},
            "p50_ms": {name: single[name]["p50_ms"] for name in SINGLE} | {"all_logits": None},
            "errors": sum(sum(s["errors"].values()) for s in single.values()),
            "saturated_softmax_rps": endpoint_summary(sat.report)["softmax"]["rps"], "saturated_softmax_cpu": sat_cpu,
            "saturated_detect_rps": endpoint_summary(sat_detect.report)["detect"]["rps"],
            "saturated_detect_cpu": detect_cpu}


def breakdown(bundle: Path, classes: int, dim: int, device: str, duration: float, log_dir: Path, env: dict,
              slc_row: dict, precisions: Sequence[str] = ("float32",)) -> dict:
    """Where one connection's softmax time goes at D = classes: detect inline (slc_row's), detect through
    the worker (a second server, SLC_INLINE_MAX_MS=0), the device pass alone (device_profile, float32; and
    each other precision's pass alone, `passes`), and the rest."""
    from tools.bench import device_profile
    from tools.bench.device import measure

    worker = measure(bundle, device, duration, log_dir, "float32", env={**env, "SLC_INLINE_MAX_MS": "0"},
                     saturate=SATURATE[device])
    prof = device_profile.profile(classes, dim, device, "float32")
    passes = {"float32": prof["ms"]} | {p: device_profile.profile(classes, dim, device, p)["ms"]
                                        for p in precisions if p != "float32"}
    p, w = slc_row["p50_ms"], worker["p50_ms"]
    hop = w["detect"] - p["detect"]
    out = {"classes": classes, "detect_inline_p50_ms": p["detect"], "detect_worker_p50_ms": w["detect"],
           "hop_ms": hop, "softmax_p50_ms": p["softmax"], "softmax_worker_server_p50_ms": w["softmax"],
           "device_pass_softmax_1_ms": prof["ms"]["softmax_1"],
           "gemm_alone_ms": prof["ms"]["gemm_alone_output_left_on_device"],
           "softmax_graph_run_us": prof["profile"]["model_run_us"], "profile": prof, "passes": passes}
    out["unlocated_ms"] = p["softmax"] - p["detect"] - prof["ms"]["softmax_1"] - max(hop, 0.0)
    return out


def run_suite(device: str, classes: Sequence[int], dim: int, precisions: Sequence[str], duration: float,
              budget_s: float, check: bool, log_dir: Path, peer_max_classes: int,
              correctness_fn: Callable[[str, float, Path], dict] = correctness) -> dict:
    """Every phase that fits the budget; the rows measured and what was skipped."""
    from tools.bench.device import device_bandwidth, measure, with_heads
    from tools.bench.run import INPUT_DIM, cached_bundle, machine_info
    from serving.core.device.head import resident_bytes

    budget = Budget(budget_s)
    env = {} if device == "cuda" else {"SLC_SOFTMAX_IMPL": "device"}  # the device pass's graphs on the CPU provider
    saturate = SATURATE[device]
    res: dict = {"device": device, "machine": machine_info(), "input_dim": INPUT_DIM, "dim": dim,
                 "duration_s": duration, "budget_s": budget_s, "rows": [], "breakdown": None, "correctness": None}
    if check:
        res["correctness"] = correctness_fn(device, max(1.0, min(CHECK_SHARE * budget_s, budget.left())), log_dir / "check")
    bandwidth = device_bandwidth() if device == "cuda" else None
    res["device_read_bytes_per_s"] = bandwidth
    classes = sorted(classes)
    mid = 1_000_000 if 1_000_000 in classes else classes[len(classes) // 2]
    order = [mid] + [D for D in reversed(classes) if D != mid]  # the middle D, then the largest, then down
    plan = [(D, "float32") for D in order] + [(D, p) for p in precisions if p != "float32" for D in order]
    for D, precision in plan:
        servers = 1 + (precision == "float32" and D <= peer_max_classes) + (D == mid and precision == "float32")
        if not budget.allows(f"D={D:,} {precision}", build_s(D, dim, precision) + servers * reserve_s(D, device)):
            continue
        t_build = time.monotonic()
        bundle = with_heads(cached_bundle(D, dim), [precision])
        head_bytes = resident_bytes(D, dim, precision)
        row = {"classes": D, "dim": dim, "precision": precision, "head_bytes": head_bytes,
               "floor_ms": 1e3 * head_bytes / bandwidth if bandwidth else None, "servers": [],
               "bundle_s": time.monotonic() - t_build}
        res["rows"].append(row)
        try:
            slc_row = measure(bundle, device, duration, log_dir, precision, env=env, saturate=saturate,
                              saturated_detect=precision == "float32")
        except Exception as exc:  # noqa: BLE001 - one failed server is a row that says so, not a lost report
            row["servers"].append({"server": "slc", "error": str(exc)[-500:]})
            continue
        row["servers"].append({"server": "slc", **slc_row})
        if precision == "float32" and D <= peer_max_classes and budget.allows(f"peer at D={D:,}", reserve_s(D, device)):
            try:
                row["servers"].append({"server": "ort-peer", **measure_peer(bundle, device, duration, log_dir, saturate)})
            except Exception as exc:  # noqa: BLE001
                row["servers"].append({"server": "ort-peer", "error": str(exc)[-500:]})
        if D == mid and precision == "float32" and budget.allows(f"breakdown at D={D:,}", reserve_s(D, device)):
            try:
                res["breakdown"] = breakdown(bundle, D, dim, device, duration, log_dir, env, slc_row, precisions)
            except Exception as exc:  # noqa: BLE001
                res["breakdown"] = {"error": str(exc)[-500:]}
    res["skipped"] = budget.skipped
    res["elapsed_s"] = budget_s - budget.left()
    return res


def _server(row: dict, name: str, precision: Optional[str] = None) -> Optional[dict]:
    for s in row["servers"]:
        if s.get("server") == name and "error" not in s:
            return s
    return None


def auto_choice(res: dict, classes: int) -> Optional[str]:
    """What SLC_HEAD_PRECISION=auto would serve at D = classes: decided from the warm-up costs a server of an
    asked quantized head measured (GET /v1/model head_precision: it times float32 and the bundle's other
    heads beside the one asked for); None where no such server ran."""
    from serving.core.head_precision import decide

    best: dict[str, float] = {}
    for row in res["rows"]:
        s = _server(row, "slc") if row["classes"] == classes and row["precision"] != "float32" else None
        cost = ((s or {}).get("chosen") or {}).get("head_precision") or {}
        if len(cost.get("cost_ms_per_input", {})) > len(best):
            best = cost["cost_ms_per_input"]
    return decide("auto", {p: ms / 1e3 for p, ms in best.items()})[0] if "float32" in best else None


def goals(res: dict) -> list[list[str]]:
    """Issue 52's goals against this run: [goal, measured, met] (met: yes / no / not measured)."""
    def row_at(D: int, precision: str = "float32") -> Optional[dict]:
        return next((r for r in res["rows"] if r["classes"] == D and r["precision"] == precision), None)

    def verdict(ok: Optional[bool]) -> str:
        return "not measured" if ok is None else ("yes" if ok else "**no**")

    out = []
    r6, r7 = row_at(1_000_000), row_at(10_000_000)
    s6 = _server(r6, "slc") if r6 else None
    s7 = _server(r7, "slc") if r7 else None
    soft6 = s6["p50_ms"]["softmax"] if s6 else None
    out.append(["softmax p(j) one-connection p50 <= 1.0 ms at D = 10^6", fmt(soft6, 3),
                verdict(None if soft6 is None else soft6 <= 1.0)])
    soft7 = s7["p50_ms"]["softmax"] if s7 else None
    out.append(["softmax p50 <= 3 ms at D = 10^7, float32", fmt(soft7, 3), verdict(None if soft7 is None else soft7 <= 3.0)])
    sat, det = (s6.get("saturated_softmax_rps"), s6.get("saturated_detect_rps")) if s6 else (None, None)
    ok = None if sat is None or det is None else (sat >= 10_000 and sat >= 0.9 * det)
    out.append(["saturated softmax at 10^6 >= 10,000 req/s and >= 0.9 x saturated detect",
                f"{fmt(sat, 0)} / {fmt(det, 0)}", verdict(ok)])
    ahead: list[bool] = []
    for r in res["rows"]:
        slc, peer = _server(r, "slc"), _server(r, "ort-peer")
        if slc and peer:
            for k in ("detect", "softmax", "topk_exact"):
                ahead.append(slc["p50_ms"][k] <= peer["p50_ms"][k])
            ahead.append(slc["saturated_softmax_rps"] >= peer["saturated_softmax_rps"])
    out.append(["ahead of the same-card peer on every row (p50s and saturated softmax)",
                f"{sum(ahead)} of {len(ahead)}", verdict(all(ahead) if ahead else None)])
    chosen_slower = []  # per D where auto's warm-up would serve a quantized head: is it slower over HTTP?
    for D in sorted({r["classes"] for r in res["rows"]}):
        pick = auto_choice(res, D)
        f32, q = row_at(D), (row_at(D, pick) if pick and pick != "float32" else None)
        a, b = (_server(f32, "slc") if f32 else None), (_server(q, "slc") if q else None)
        if a and b:
            chosen_slower.append(b["p50_ms"]["softmax"] > a["p50_ms"]["softmax"])
    out.append(["int8 / bf16 never slower than float32 where SLC_HEAD_PRECISION=auto chooses it (softmax p50)",
                f"chosen at {len(chosen_slower)} D, slower at {sum(chosen_slower)}",
                verdict(None if not chosen_slower else not any(chosen_slower))])
    return out


def suite_markdown(res: dict, command: str) -> str:
    bw = res.get("device_read_bytes_per_s")
    lines = ["# The prepared GPU check: slc and a same-card peer, by D and head precision\n",
             f"Command: `{command}`  \nDevice: {res['device']}  \nMachine: {res['machine']}  \n"
             f"Device read bandwidth: {fmt(bw / 1e12 if bw else None, 2)} TB/s (floor = head bytes / bandwidth)  \n"
             f"Took {res['elapsed_s']:.0f} s of a {res['budget_s']:.0f} s budget.\n"]
    if res["device"] != "cuda":
        lines.append("**A smoke run on the CPU provider: these figures say nothing about a GPU.**\n")
    c = res.get("correctness")
    if c is not None:
        lines.append(f"**Correctness (tools/gpu_check.py):** exit {c['rc']}, {c['seconds']:.0f} s: {c['summary']}\n")
        if c.get("table"):
            lines += ["```", *c["table"], "```", ""]
    head = ["D", "head", "server", "providers", "detect p50", "softmax p50", "top-k exact p50", "all logits p50",
            "floor", "sat. softmax req/s", "sat. detect req/s", "RSS MB", "ready s"]
    body = []
    for row in sorted(res["rows"], key=lambda r: (ORDER.index(r["precision"]), r["classes"])):
        for s in row["servers"]:
            if "error" in s:
                body.append([f"{row['classes']:,}", row["precision"], s["server"], "error: " + s["error"][-120:].replace("|", "/")]
                            + [""] * (len(head) - 4))
                continue
            p = s["p50_ms"]
            body.append([f"{row['classes']:,}", row["precision"], s["server"], ", ".join(s["chosen"]["providers"][:1]),
                         fmt(p["detect"], 3), fmt(p["softmax"], 3), fmt(p["topk_exact"], 3), fmt(p["all_logits"], 3),
                         fmt(row["floor_ms"], 3), fmt(s["saturated_softmax_rps"], 0),
                         fmt(s.get("saturated_detect_rps"), 0), fmt(s["rss"] / 1e6, 0), fmt(s["ready_s"], 1)])
    lines += ["## Side by side\n", md_table(head, body),
              "\nOne-connection p50 in ms over HTTP with the load test's client; saturated: "
              f"{SATURATE[res['device']]} connections. slc: `slc serve` (exact top-k, no class index); ort-peer: "
              "tools/bench/ort_peer.py, FastAPI over onnxruntime sessions of full.onnx and single.onnx on the same "
              "device. All logits: slc's KServe v2 `<model>-full`, binary output (the peer has no such route).\n"]
    bound_rows = []
    for row in sorted(res["rows"], key=lambda r: (ORDER.index(r["precision"]), r["classes"])):
        for s in row["servers"]:
            for route in ("softmax", "detect"):
                use = s.get(f"saturated_{route}_cpu")
                if use:
                    c = use["cores"]
                    bound_rows.append([f"{row['classes']:,}", row["precision"], s["server"], route,
                                       fmt(s[f"saturated_{route}_rps"], 0), fmt(c["loop"], 2), fmt(c["workers"], 2),
                                       fmt(c["client"], 2), fmt(use["idle_share"], 2)])
    if bound_rows:
        lines += ["## What bounds the saturated routes\n", md_table(
            ["D", "head", "server", "route", "req/s", "event loop cores", "other threads cores", "client cores",
             "machine idle"], bound_rows),
            "\nCores each part used during the saturated run (tools/bench/cpu.py, /proc). The event loop is one "
            "thread: near 1.0 it is the front that bounds the route. slc's other threads are the batch workers, "
            "and one of them runs the pass over the head, so near 1.0 there the batcher's worker bounds it. "
            "Neither near 1.0 while the machine still has idle cores: the device, or the client (its own column).\n"]
    by_d: dict[int, dict[str, dict]] = {}
    for row in res["rows"]:
        s = _server(row, "slc")
        if s:
            by_d.setdefault(row["classes"], {})[row["precision"]] = s
    precs = [p for p in ("float32", "bf16", "int8") if any(p in v for v in by_d.values())]
    if len(precs) > 1:
        ph = ["D"] + [f"{p} softmax p50" for p in precs] + [f"{p} sat. req/s" for p in precs] + ["auto serves"]
        pb = [[f"{D:,}"] + [fmt(v[p]["p50_ms"]["softmax"], 3) if p in v else "-" for p in precs]
              + [fmt(v[p]["saturated_softmax_rps"], 0) if p in v else "-" for p in precs]
              + [auto_choice(res, D) or "-"] for D, v in sorted(by_d.items())]
        lines += ["## slc by head precision\n", md_table(ph, pb),
                  "\nauto serves: what SLC_HEAD_PRECISION=auto's warm-up picks from the per-input costs the quantized "
                  "servers' warm-ups measured for every head (GET /v1/model head_precision).\n"]
    b = res.get("breakdown")
    if b and "error" not in b:
        lines += [f"## One connection's softmax at D = {b['classes']:,}, taken apart\n", md_table(
            ["part", "ms"], [["detect p50 (HTTP, JSON, backbone; inline on the event loop)", fmt(b["detect_inline_p50_ms"], 3)],
                             ["the hop to the worker thread (detect through it, SLC_INLINE_MAX_MS=0, minus inline)", fmt(b["hop_ms"], 3)],
                             ["the device pass alone (softmax, one input; device_profile)", fmt(b["device_pass_softmax_1_ms"], 3)],
                             ["  of it, the GEMM alone", fmt(b["gemm_alone_ms"], 3)],
                             ["not located (softmax p50 minus the three above)", fmt(b["unlocated_ms"], 3)],
                             ["softmax p50", fmt(b["softmax_p50_ms"], 3)]]), ""]
        if len(b.get("passes", {})) > 1:
            keys = ["softmax_1", "softmax_8", "topk10_1", "logits_1", "gemm_alone_output_left_on_device"]
            lines += [f"The device pass alone at D = {b['classes']:,} by head precision (ms, median; device_profile):\n",
                      md_table(["head", *keys], [[p, *(fmt(ms.get(k), 3) for k in keys)] for p, ms in b["passes"].items()]),
                      ""]
    elif b:
        lines.append(f"Breakdown: error: {b['error'][-200:]}\n")
    lines += ["## Issue 52's goals in this run\n", md_table(["goal", "measured", "met"], goals(res)), ""]
    if res.get("skipped"):
        lines += ["## Not measured (the budget)\n"] + [f"- {s}" for s in res["skipped"]] + [""]
    return "\n".join(lines)


def main(device: str, classes: Optional[Sequence[int]], dim: Optional[int], precisions: Sequence[str], duration: float,
         budget_s: float, check: bool, peer_max_classes: int, out: Path, command: str) -> Optional[dict]:
    """The whole check (None after the one line where CUDA is asked for and absent)."""
    from tools.report import write_result

    if device == "cuda" and (line := no_cuda_line()) is not None:
        print(line)
        return None
    classes = list(classes or DEFAULT_CLASSES[device])
    dim = dim or DEFAULT_DIM[device]
    with tempfile.TemporaryDirectory(prefix="slc-gpu-suite-") as tmp:
        res = run_suite(device, classes, dim, precisions, duration, budget_s, check, Path(tmp), peer_max_classes)
    write_result(out, "gpu-bench", lambda: suite_markdown(res, command), res, default=str)
    return res
