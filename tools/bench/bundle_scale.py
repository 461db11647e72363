"""`slc bench scale --bundle B`: detect against the full softmax (and top-k) on one real bundle,
e.g. a trained many-class model, instead of the synthetic sweep: the same closed-loop and
one-connection measurements as the sweep, the server's memory, and the ratios that matter."""
from __future__ import annotations

import json
import tempfile
import time
import urllib.request
from pathlib import Path

from tools.bench.run import ROTATION, SINGLE, machine_info, measure_server
from tools.bench.server import process_tree_memory, slc_server
from tools.report import md_table
from serving.bundle import load_bundle


def bench_bundle(bundle_dir: Path, duration: float, concurrency: int) -> dict:
    bundle = load_bundle(bundle_dir, verify=False)
    head_bytes = int(bundle.weight.nbytes + bundle.bias.nbytes)
    with tempfile.TemporaryDirectory(prefix="slc-bench-bundle-") as tmp:
        with slc_server(bundle_dir, Path(tmp), "bundle", Path(tmp) / "data") as srv:
            ready = srv.wait_ready(900)
            model = json.loads(urllib.request.urlopen(srv.url + "/v1/model", timeout=30).read())
            m = measure_server(srv.url, ROTATION, concurrency, duration, single=SINGLE)
            memory = process_tree_memory(srv.proc.pid)
    closed, one = m["closed"], m["single_connection"]
    return {
        "bundle": bundle.name, "classes": bundle.num_classes, "dim": bundle.embed_dim,
        "input_shape": list(bundle.input_shape), "head_bytes": head_bytes, "ready_s": ready,
        "index": model.get("index"), "softmax_impl": model.get("softmax_impl"), "providers": model.get("providers"),
        "closed": closed, "single_connection": one, "rss": memory["rss"],
        "ratios": {"detect_over_softmax_rps": closed["detect"]["rps"] / closed["softmax"]["rps"],
                   "softmax_over_detect_p50": one["softmax"]["p50_ms"] / one["detect"]["p50_ms"],
                   "detect_over_live_rps": closed["detect"]["rps"] / closed["live"]["rps"]},
        "concurrency": concurrency, "duration_s": duration, "machine": machine_info(), "when": time.strftime("%Y-%m-%d"),
    }


def bundle_markdown(r: dict, command: str) -> str:
    rows = []
    for name in ROTATION:
        c, o = r["closed"].get(name, {}), r["single_connection"].get(name, {})
        one = [f"{o['p50_ms']:.2f}", f"{o['p99_ms']:.2f}"] if o else ["—", "—"]
        rows.append([name, f"{c.get('rps', 0):,.0f}", f"{c.get('p50_ms') or 0:.2f}", f"{c.get('p99_ms') or 0:.2f}", *one])
    q = r["ratios"]
    return "\n".join([
        f"# Serving a real bundle: `{r['bundle']}`", "", f"Command: `{command}`", "",
        f"{r['classes']:,} classes, d = {r['dim']}, input {r['input_shape']}, head {r['head_bytes'] / 2**20:.1f} MiB; "
        f"server RSS {r['rss'] / 2**20:.0f} MiB; ready in {r['ready_s']:.1f} s; softmax via {r['softmax_impl']}; "
        f"{r['concurrency']} closed-loop connections, {r['duration_s']:g} s per endpoint, then one connection; "
        f"machine {r['machine'].get('cpus', '?')} CPUs, shared with other work. Random inputs of the right shape.", "",
        md_table(["endpoint", "closed-loop req/s", "p50 ms", "p99 ms", "one connection p50 ms", "p99 ms"], rows, "lrrrrr"), "",
        f"Ratios measured in this one run: detect / softmax throughput **{q['detect_over_softmax_rps']:.2f}×**; "
        f"softmax / detect one-connection p50 **{q['softmax_over_detect_p50']:.2f}×**; detect / trivial endpoint "
        f"{q['detect_over_live_rps']:.2f}.", ""])
