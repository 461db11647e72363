"""Detect over a set of classes (`POST /v1/detect`, issue 51) against one detect and the full softmax:
the server's own time per request, in-process over ASGI as `slc bench routes` times its routes
(tools/bench/routes.py), one input per request, routes alternating, the best round counting.

The set's cost should be its C rows (gathered from the memory-mapped head, C dot products per
input), so 1, 10 and 100 classes should cost about one detect each, far below the full softmax,
which reads all D rows.

    python -m tools.bench.detect_set --bundle BUNDLE [--rounds 3] --out docs/results/detect-set.md
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from tools.bench.routes import _started, call
from tools.report import md_table

SET_SIZES = (1, 10, 100)


def requests_for(engine, requests: int) -> dict[str, tuple[tuple, int]]:
    """{route: ((method, path, body, headers), requests per round)}: the softmax reads all D rows, so
    it gets fewer requests per round (at least 5)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, *engine.input_shape)).astype(np.float32).tolist()
    head = {"content-type": "application/json"}
    D = engine.num_classes
    out = {"detect": (("POST", "/v1/classes/0/detect", json.dumps({"inputs": x}).encode(), head), requests)}
    for c in SET_SIZES:
        ids = rng.choice(D, size=c, replace=c > D).tolist()  # scattered rows of the mapped head
        out[f"detect_set_{c}"] = (("POST", "/v1/detect", json.dumps({"inputs": x, "classes": ids}).encode(), head),
                                  requests)
    out["softmax"] = (("POST", "/v1/classes/0/softmax", json.dumps({"inputs": x}).encode(), head),
                      max(5, requests // 100))
    return out


async def _measure(app, rounds: int, requests: int) -> dict[str, list[float]]:
    stop = await _started(app)
    try:
        reqs = requests_for(app.state.slc.engine, requests)
        for name, (req, _) in reqs.items():  # each route answered once before timing
            status, body = await call(app, *req)
            if status != 200:
                raise RuntimeError(f"{name}: HTTP {status}: {body[:200]!r}")
        us: dict[str, list[float]] = {name: [] for name in reqs}
        for _ in range(rounds):
            for name, (req, n) in reqs.items():
                t0 = time.perf_counter()
                for _ in range(n):
                    if (await call(app, *req))[0] != 200:
                        raise RuntimeError(f"{name}: a request was not answered 200")
                us[name].append((time.perf_counter() - t0) / n * 1e6)
        return us
    finally:
        await stop()


def measure(bundle: Path, rounds: int, requests: int) -> dict:
    from serving.http.app import create_app
    from serving.settings import Settings

    with tempfile.TemporaryDirectory(prefix="slc-detect-set-") as tmp:
        # class_index exact: nothing to build (mode=index is not timed here)
        app = create_app(Settings(bundle=bundle, data_dir=Path(tmp), log_level="error", class_index="exact"))
        t0 = time.perf_counter()
        us = asyncio.run(_measure(app, rounds, requests))
        wall = time.perf_counter() - t0
        engine = app.state.slc.engine
        info = {"D": engine.num_classes, "d": int(engine.bundle.embed_dim), "softmax_impl": engine.softmax_impl}
    return {**info, "bundle": str(bundle), "rounds": rounds, "requests": requests, "wall_s": wall,
            "best_us": {r: min(v) for r, v in us.items()}, "median_us": {r: float(np.median(v)) for r, v in us.items()},
            "all_us": us}


def markdown(r: dict, command: str) -> str:
    best, med = r["best_us"], r["median_us"]
    rows = [[name, f"{best[name]:,.1f}", f"{med[name]:,.1f}", f"{best[name] / best['detect']:.2f}",
             f"{best['softmax'] / best[name]:,.0f}"] for name in best]
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, Python {platform.python_version()}"
    return "\n".join([
        f"# Detect over a set of classes against one detect and the full softmax (D = {r['D']:,}, d = {r['d']})", "",
        f"Command: `{command}`  ", f"Machine: {machine}  ",
        f"Bundle: `slc bundle synthetic --classes {r['D']} --dim {r['d']}`; softmax strategy chosen at warm-up: "
        f"`{r['softmax_impl']}`; {r['rounds']} rounds, routes alternating, one input per request "
        f"({r['requests']} requests per route and round, the softmax {max(5, r['requests'] // 100)}).", "",
        md_table(["route", "best µs", "median µs", "× detect", "softmax ÷ route"], rows, "lrrrr"), "",
        "`detect_set_C`: `POST /v1/detect` naming C classes at random ids (rows scattered over the mapped head); "
        "`detect`: `POST /v1/classes/0/detect`; `softmax`: `POST /v1/classes/0/softmax`, all D logits. "
        "The server's time per request in-process over ASGI (tools/bench/routes.py's call): the backbone, "
        "the rows and the answer, no HTTP parsing, no client. Lower is better.", ""])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=300, help="requests per route and round (softmax: 1/100th, >= 5)")
    ap.add_argument("--out", type=Path, default=Path("docs/results/detect-set.md"))
    a = ap.parse_args(argv)
    r = measure(a.bundle, a.rounds, a.requests)
    command = f"python -m tools.bench.detect_set --bundle {a.bundle} --rounds {a.rounds} --requests {a.requests}"
    text = markdown(r, command)
    a.out.write_text(text)
    a.out.with_suffix(".json").write_text(json.dumps({**r, "command": command}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
