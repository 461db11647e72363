"""`slc bench ab`: this checkout's server against another checkout's, both up at once, asked in
alternating short blocks.

Sequential runs minutes apart on a shared machine mostly measure its drift (on the 2-core test
machines one server's closed-loop throughput moves by ±10 % between runs). Two live servers
asked in alternating blocks see the same drift, so their ratio is what the code changed. Both
are loaded by this checkout's client; the block order flips every round. The interval is a
bootstrap over rounds, so a ratio whose interval holds 1 is within this machine's noise.
"""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from tools import loadtest as lt
from tools.bench import cpu
from tools.bench.server import ServerProcess, free_port
from tools.report import md_table

SIDES = ("base", "head")
BOOTSTRAP = 2000
MIN_ROUNDS = 6  # fewer rounds give a bootstrap interval too narrow to trust


def check_checkout(tree: Path) -> Path:
    """The checkout's root if `python -m slc serve` can run from it; ValueError otherwise (before any work)."""
    tree = tree.expanduser().resolve()
    missing = [p for p in ("slc/__main__.py", "serving/__init__.py") if not (tree / p).is_file()]
    if missing:
        raise ValueError(f"{tree} is not an slc checkout (no {', '.join(missing)})")
    return tree


def describe(tree: Path) -> str:
    """`<short commit>[+dirty]` of a git checkout, or its path when git cannot tell."""
    try:
        rev = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return str(tree)
    return rev + ("+dirty" if dirty else "")


def checkout_server(tree: Path, bundle: Path, work: Path, tag: str, grpc: bool) -> ServerProcess:
    """`python -m slc serve BUNDLE` of the checkout at `tree` (its slc/ and serving/ first on the path)."""
    port = free_port()
    argv = [sys.executable, "-m", "slc", "serve", str(bundle), "--port", str(port), "--data-dir", str(work / f"data-{tag}")]
    grpc_port = free_port() if grpc else None
    if grpc_port:
        argv += ["--grpc-port", str(grpc_port)]
    srv = ServerProcess(argv, port, work / f"server-{tag}.log", cwd=tree,
                        env={"SLC_LOG_LEVEL": "warning", "PYTHONPATH": str(tree)})
    srv.grpc_port = grpc_port
    return srv


def _block(srv: ServerProcess, endpoint: str, concurrency: int, block: float) -> dict:
    """One measured block: successful requests, its window and the server's CPU seconds."""
    before = cpu.snapshot(srv.proc.pid)
    res = lt.run_loadtest(srv.url, [endpoint], concurrency=concurrency, duration=block, warmup=0.0,
                          grpc_port=srv.grpc_port)
    after = cpu.snapshot(srv.proc.pid)
    ep = res.report["endpoints"][endpoint]
    server_s = None if before is None or after is None else (
        after["loop"] + after["workers"] - before["loop"] - before["workers"])
    return {"ok": ep["ok"], "errors": ep["requests"] - ep["ok"], "window_s": ep["window_s"], "server_cpu_s": server_s}


def warm_up_choices(srv: ServerProcess) -> dict:
    """What the server chose from timings at warm-up (GET /v1/model): the full-softmax pass and the
    batch sizes its one-thread backbone session takes. Two servers that chose differently differ
    by configuration, whatever their code."""
    with urllib.request.urlopen(srv.url + "/v1/model", timeout=30) as r:
        model = json.loads(r.read())
    return {"softmax_impl": model.get("softmax_impl"),
            "one_thread_backbone_max_batch": (model.get("batching") or {}).get("one_thread_backbone_max_batch")}


def _start_matched(trees: dict, bundle: Path, work: Path, grpc: bool, tries: int) -> tuple[dict, dict]:
    """Base, then head, each warming up alone (a warm-up beside another's skews both timings); while
    their warm-up choices differ, the head and the base restarted in turn (the odd choice may be
    either's), `tries` restarts at most."""
    servers, info, starts = {}, {}, {"base": 0, "head": 0}

    def start(side: str) -> None:
        if side in servers:
            servers.pop(side).stop()
        starts[side] += 1
        servers[side] = checkout_server(trees[side], bundle, work, f"{side}{starts[side]}", grpc)
        servers[side].wait_ready(600)
        info[side] = warm_up_choices(servers[side])

    try:
        start("base")
        start("head")
        for restart in range(tries):
            if info["head"] == info["base"]:
                break
            start(SIDES[(restart + 1) % 2])  # head, base, head, ...
    except BaseException:
        for srv in servers.values():
            srv.stop()
        raise
    return servers, {**info, "starts": starts, "matched": info["head"] == info["base"]}


def _one_size(trees: dict, bundle: Path, work: Path, endpoints: list[str], rounds: int, block: float,
              concurrency: int, step: Callable[[str], None], tries: int = 6) -> tuple[dict, dict]:
    """Both servers of one bundle up; per round, each endpoint on base then head (head first on odd rounds)."""
    servers, info = _start_matched(trees, bundle, work, "grpc" in endpoints, tries)
    blocks = {ep: {side: [] for side in SIDES} for ep in endpoints}
    try:
        for srv in servers.values():  # warm both: sessions, caches, the client's connections
            lt.run_loadtest(srv.url, endpoints, concurrency=concurrency, duration=0.5, warmup=1.0,
                            grpc_port=srv.grpc_port)
        for r in range(rounds):
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            for ep in endpoints:
                step(f"round {r + 1}/{rounds} {ep}")
                for side in order:
                    blocks[ep][side].append(_block(servers[side], ep, concurrency, block))
    finally:
        for srv in servers.values():
            srv.stop()
    return blocks, info


def _interval(base: np.ndarray, head: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """95 % bootstrap interval of sum(head) / sum(base), resampling rounds (a round keeps its pair)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(base), size=(BOOTSTRAP, len(base)))  # (B, rounds)
    ratios = head[idx].sum(axis=1) / base[idx].sum(axis=1)
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return float(lo), float(hi)


def summarize(blocks: dict) -> dict:
    """Per side: req/s over all blocks and server CPU µs per request; head/base with its interval and verdict."""
    out = {}
    for side in SIDES:
        ok = np.array([b["ok"] for b in blocks[side]], dtype=np.float64)
        secs = np.array([b["window_s"] for b in blocks[side]], dtype=np.float64)
        cpu_s = [b["server_cpu_s"] for b in blocks[side]]
        out[side] = {"rps": float(ok.sum() / secs.sum()), "requests": int(ok.sum()),
                     "errors": int(sum(b["errors"] for b in blocks[side])),
                     "server_cpu_us": None if None in cpu_s else float(sum(cpu_s) / max(1.0, ok.sum()) * 1e6),
                     "block_rps": (ok / secs).tolist()}
    base, head = (np.array(out[s]["block_rps"]) for s in SIDES)
    if base.sum() == 0 or head.sum() == 0:
        side = "base" if base.sum() == 0 else "head"
        return {**out, "head_over_base": None, "interval95": None, "verdict": f"{side} answered nothing",
                "head_faster_rounds": int((head > base).sum()), "rounds": len(base), "cpu_head_over_base": None}
    lo, hi = _interval(base, head)
    ratio = float(head.sum() / base.sum())
    verdict = ("equal within noise" if lo <= 1.0 <= hi else ("head faster" if lo > 1.0 else "head slower"))
    if len(base) < MIN_ROUNDS:
        verdict = f"too few rounds to tell (< {MIN_ROUNDS})"
    cpu_ratio = (out["head"]["server_cpu_us"] / out["base"]["server_cpu_us"]
                 if out["base"]["server_cpu_us"] and out["head"]["server_cpu_us"] else None)
    return {**out, "head_over_base": ratio, "interval95": [lo, hi], "verdict": verdict,
            "head_faster_rounds": int((head > base).sum()), "rounds": len(base), "cpu_head_over_base": cpu_ratio}


def run_ab(base: Path, head: Path, bundles: dict, work: Path, endpoints: list[str], rounds: int = 10,
           block: float = 2.0, concurrency: int = 8, progress: Optional[Callable[[str], None]] = None) -> dict:
    """For each D: both checkouts' servers, alternating blocks; the summary per endpoint."""
    trees = {"base": check_checkout(base), "head": check_checkout(head)}
    step = progress or (lambda _msg: None)
    sizes, warm_up = {}, {}
    for D, bundle in bundles.items():
        blocks, info = _one_size(trees, bundle, work, endpoints, rounds, block, concurrency,
                                 lambda m: step(f"D={D:,} {m}"))
        sizes[str(D)] = {ep: summarize(sides) for ep, sides in blocks.items()}
        warm_up[str(D)] = info
    return {"base": {"tree": str(trees["base"]), "commit": describe(trees["base"])},
            "head": {"tree": str(trees["head"]), "commit": describe(trees["head"])},
            "endpoints": endpoints, "rounds": rounds, "block_s": block, "concurrency": concurrency, "sizes": sizes,
            "warm_up": warm_up}


def _num(x: Optional[float]) -> str:
    return "–" if x is None or x != x else f"{x:.3f}"


def _cpu_cell(s: dict, side: str) -> str:
    us = s[side]["server_cpu_us"]
    return "–" if us is None else f"{us:.0f}"


def _choices_line(w: dict) -> str:
    show = lambda c: ", ".join(f"{k} {v}" for k, v in c.items())  # noqa: E731
    n = f"{w['starts']['base']} start(s) of the base, {w['starts']['head']} of the head"
    state = (f"equal after {n}" if w["matched"]
             else f"**still different after {n}: the rows compare configurations, not only code**")
    return f"base {show(w['base'])}; head {show(w['head'])}: {state}"


def ab_markdown(r: dict, command: str) -> str:
    """The report: per D and endpoint, each side's req/s and CPU per request, head/base and its interval."""
    base, head = r["base"], r["head"]
    rows = []
    for D, eps in r["sizes"].items():
        for ep, s in eps.items():
            lo, hi = s["interval95"] or (float("nan"), float("nan"))
            rows.append([f"{int(D):,}", ep, f"{s['base']['rps']:,.0f}", f"{s['head']['rps']:,.0f}",
                         _num(s["head_over_base"]), f"{_num(lo)} – {_num(hi)}",
                         f"{s['head_faster_rounds']}/{s['rounds']}", _cpu_cell(s, "base"), _cpu_cell(s, "head"),
                         "–" if s["cpu_head_over_base"] is None else f"{s['cpu_head_over_base']:.3f}", s["verdict"]])
    L = ["# This checkout against another, alternating blocks", "", f"Command: `{command}`  ",
         f"Base: `{base['tree']}` at {base['commit']}; head: `{head['tree']}` at {head['commit']}.  ",
         f"Both servers up at once (each warmed up alone), closed loop with {r['concurrency']} connections from this checkout's client; "
         f"{r['rounds']} rounds of one {r['block_s']:g} s block per endpoint and side, head first on odd rounds. "
         "req/s over all blocks; head/base with a 95 % bootstrap interval over rounds ('equal within noise' "
         "when it holds 1; across many rows about 1 in 20 misses 1 by chance, so one row just outside it is "
         "weak evidence); server CPU in µs per request (all its threads, from /proc).", "",
         md_table(["D", "endpoint", "base req/s", "head req/s", "head/base", "95 % interval", "head faster",
                   "base CPU µs", "head CPU µs", "CPU head/base", "verdict"], rows, "llrrrrrrrrl"),
         "", "Warm-up choices (GET /v1/model; head and base restarted in turn until they are equal):", ""]
    L += [f"- D = {int(D):,}: " + _choices_line(w) for D, w in r.get("warm_up", {}).items()]
    return "\n".join(L) + "\n"
