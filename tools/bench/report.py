"""`slc bench scale`'s report: the headline targets (measured, goal, met), scale.md tables and
scale.png."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from tools.bench import cpu
from tools.report import fmt, md_table, write_file


def _ratio(a, b):
    return (a / b) if (a is not None and b not in (None, 0)) else None


def evaluate_targets(rows: list[dict], default_model: Optional[dict], paired: Optional[dict] = None) -> list[dict]:
    """The product's headline figures: measured value, target, met or not."""
    by_d = {r["classes"]: r for r in rows}
    lo, hi = min(by_d), max(by_d)
    t: list[dict] = []

    def add(name, value, target, better="higher", note=""):
        met = None if value is None or target is None else (value >= target if better == "higher" else value <= target)
        t.append({"target": name, "value": value, "goal": target, "better": better, "met": met, "note": note})

    c = lambda D, ep: by_d[D]["slc"]["closed"][ep]  # noqa: E731
    s = lambda D, ep: by_d[D]["slc"]["single_connection"][ep]  # noqa: E731
    if paired and "large_over_small" in paired:
        add(f"detect throughput at D={hi:,} / at D={lo:,} (both servers up, alternating blocks)",
            paired["large_over_small"], 0.8)
    add(f"detect throughput at D={hi:,} / at D={lo:,} (sequential runs, drift-prone)",
        _ratio(c(hi, "detect")["rps"], c(lo, "detect")["rps"]), 0.8)
    add(f"detect / softmax throughput at D={hi:,}", _ratio(c(hi, "detect")["rps"], c(hi, "softmax")["rps"]), 10.0,
        note="aim 20")
    add(f"softmax / detect single-connection p50 latency at D={hi:,}",
        _ratio(s(hi, "softmax")["p50_ms"], s(hi, "detect")["p50_ms"]), 30.0)
    add(f"topk index recall@10 at D={hi:,}", by_d[hi]["recall"]["recall_at_k"], 0.97)
    add(f"topk index / exact throughput at D={hi:,} (per batch, closed loop)",
        _ratio(c(hi, "topk_index")["rps"], c(hi, "topk_exact")["rps"]), 5.0)
    add(f"topk exact / index single-connection p50 latency at D={hi:,} (per request)",
        _ratio(s(hi, "topk_exact")["p50_ms"], s(hi, "topk_index")["p50_ms"]), 5.0)
    add(f"server RSS / head size at D={hi:,}", by_d[hi]["memory"]["rss_over_head"], 1.2, better="lower",
        note=f"(RSS - RSS at D={lo:,}) / head = {fmt(by_d[hi]['memory'].get('over_baseline_over_head'), 2)}")
    add(f"(server RSS - RSS at D={lo:,}) / head size at D={hi:,}", by_d[hi]["memory"].get("over_baseline_over_head"),
        1.2, better="lower", note="what the head and its index cost")
    index = (by_d[hi].get("server_model") or {}).get("index") or {}
    add(f"class index build seconds at D={hi:,}", index.get("build_seconds"), 60.0, better="lower",
        note=f"{index.get('kind', '?')}; cached after the first start")
    protocol_targets(add, by_d, lo, hi)
    if default_model and "detect_over_live" in default_model:
        add("detect / trivial endpoint throughput, default model", default_model["detect_over_live"], 0.6)
        add("v2 JSON / detect throughput, default model", default_model.get("v2_over_detect"), 0.85)
    else:
        add("detect / trivial endpoint throughput, default model", None, 0.6,
            note=(default_model or {}).get("error", "not measured")[:200])
    precision_targets(add, by_d)
    for D in (100_000, hi):
        if D in by_d and "closed" in by_d[D].get("peer", {}):
            add(f"slc softmax / torch peer softmax throughput at D={D:,}",
                _ratio(c(D, "softmax")["rps"], by_d[D]["peer"]["closed"]["softmax"]["rps"]), 1.0)
            add(f"torch peer / slc softmax single-connection p50 at D={D:,}",
                _ratio(by_d[D]["peer"]["single_connection"]["softmax"]["p50_ms"], s(D, "softmax")["p50_ms"]), 1.0)
            if D == hi:
                break
    return t


def precision_targets(add, by_d: dict) -> None:
    """Issue 29: the int8 head's one-connection softmax at least 2x faster than float32's (same run)."""
    if 100_000 in by_d and "precisions" in by_d[100_000]:
        p = by_d[100_000]["precisions"]
        add("float32 / int8 one-connection softmax p50 at D=100,000 (one server each)",
            _ratio(p["float32"]["single"]["p50_ms"], p["int8"]["single"]["p50_ms"]), 2.0,
            note=f"int8 p50 / its bandwidth floor {fmt(p['int8'].get('p50_over_floor'), 2)}")


def _md_precisions(res: dict) -> list[str]:
    """The full softmax on the float32, bf16 and int8 heads (tools/bench/precision.py)."""
    rows = [r for r in res["rows"] if "precisions" in r]
    if not rows:
        return []
    L = ["", "## Head precision: the full softmax on float32, bf16 and int8 heads", "",
         "Each precision in a server of its own (`SLC_HEAD_PRECISION`), softmax alone. Floor: the bytes one pass "
         "reads in that precision over this machine's read bandwidth (numpy sum of 256 MiB, best of 7), i.e. the "
         "time any server needs to read the head once per request. The top-k and the asked class's logit are "
         "re-scored on float32 (exactness: docs/results/head-precision.md).", ""]
    cells = [[f"{r['classes']:,}", name, fmt(p["single"]["p50_ms"], 2), fmt(p["single"]["p99_ms"], 2), fmt(p["floor_ms"], 2),
              fmt(p["p50_over_floor"], 2), fmt(p["saturated"]["rps"]), fmt(p["saturated"]["p99_ms"], 1), fmt(p["rss"] / 2**20)]
             for r in rows for name, p in r["precisions"].items()]
    return L + [md_table(["D", "precision", "one connection p50 ms", "p99 ms", "floor ms", "p50 / floor", "saturated req/s",
                          "p99 ms", "RSS MiB"], cells, "rlrrrrrrr")]


def _protocols_single(row: dict) -> dict:
    """One-connection figures of detect and the v2 forms measured alone (older results: the full rotation)."""
    return row["slc"].get("protocols_single") or row["slc"]["single_connection"]


def protocol_targets(add, by_d: dict, lo: int, hi: int) -> None:
    """KServe v2 against detect (same load, same run) and softmax against its GEMM bound."""
    for D in sorted({lo, hi}):
        c, s = by_d[D]["slc"]["closed"], _protocols_single(by_d[D])
        add(f"v2 JSON / detect throughput at D={D:,}", _ratio(c["v2"]["rps"], c["detect"]["rps"]), 0.85)
        add(f"v2 JSON / detect single-connection p50 at D={D:,} (the protocols alone, interleaved)",
            _ratio(s["v2"]["p50_ms"], s["detect"]["p50_ms"]), 1.0, better="lower")
        add(f"v2 binary / detect throughput at D={D:,}", _ratio(c["v2_binary"]["rps"], c["detect"]["rps"]), None)
        if "grpc" in c:
            add(f"gRPC / detect throughput at D={D:,}", _ratio(c["grpc"]["rps"], c["detect"]["rps"]), None)
    for D in sorted(by_d):
        bound = by_d[D]["head_alone"].get("gemm_bound_inputs_per_s")
        for key, goal in (("softmax_saturated", 0.7), ("softmax_one_batch", None)):
            sat = by_d[D].get(key)
            if D >= 100_000 and sat and bound:
                add(f"softmax ({sat['concurrency']} connections) / GEMM bound at batch 64, D={D:,}",
                    _ratio(sat["rps"], bound), goal, note=f"{fmt(sat['rps'])} vs {fmt(bound)} inputs/s")
        sat = by_d[D].get("softmax_saturated") or {}
        ceiling = cpu.ceiling_over_bound(sat.get("cpu"), bound)
        if D >= 100_000 and ceiling is not None:
            per = sat["cpu"]["core_ms_per_request"]
            add(f"ceiling of the same / GEMM bound at D={D:,}: a pass at the bound, the event loop and the client "
                "at their measured CPU per request on the same cores", ceiling, None,
                note=f"loop {per['loop']:.3f} + client {per['client']:.3f} core-ms per request")


def _index_kind(row: dict) -> str:
    info = (row.get("server_model") or {}).get("index") or {}
    kind = info.get("kind", "?")
    if info.get("fallback_reason"):
        return f"{kind} (asked {info['requested']}, fell back)"
    if kind == "ivf":
        return f"ivf nlist {info.get('nlist')} nprobe {info.get('nprobe')} rerank {info.get('rerank')}, build {fmt(info.get('build_seconds'))} s"
    return kind


def _md_header(res: dict) -> list[str]:
    """Title, command, machine, load and the targets table."""
    L = [f"# Single logit vs full softmax as D grows (d = {res['dim']})", "",
         f"Command: `{res['command']}`  ", f"Machine: {res['machine']['cpus']} CPUs ({res['machine']['cpu_model']}), "
         f"load average at start {', '.join(f'{x:.1f}' for x in res['machine']['loadavg_start'])}, at end "
         f"{', '.join(f'{x:.1f}' for x in res['machine']['loadavg_end'])} (shared machine: absolute numbers are noisy, "
         "ratios within a run are the figures to read).  ",
         f"Load: closed loop, concurrency {res['concurrency']}, endpoints rotated in {res.get('block_s', 2.0):g} s blocks (each block drains before the next), "
         f"{res['duration_s']:g} s per endpoint after 2 s warm-up; single connection: endpoints interleaved per "
         f"request, {res['duration_s']:g} s. 1 input per request. Client: serving/loadtest (raw asyncio HTTP/1.1, uvloop).",
         "", "## Targets", ""]
    rows = []
    for t in res["targets"]:
        goal = "–" if t["goal"] is None else ("≥ " if t["better"] == "higher" else "≤ ") + fmt(float(t["goal"]), 2)
        met = {True: "yes", False: "**no**", None: "not measured" if t["goal"] is not None else "(reported)"}[t["met"]]
        note = f" ({t['note']})" if t.get("note") else ""
        rows.append([f"{t['target']}{note}", fmt(t["value"], 2), goal, met])
    return L + [md_table(["figure", "measured", "goal", "met"], rows, "lrrl")]


def _md_throughput(res: dict) -> list[str]:
    """Closed-loop throughput per endpoint and D."""
    rows = res["rows"]
    cells = []
    for r in rows:
        c = r["slc"]["closed"]
        peer = r.get("peer", {}).get("closed", {}).get("softmax", {}).get("rps")
        cells.append([f"{r['classes']:,}", *(fmt(c[e]["rps"]) for e in ("live", "detect", "softmax", "topk_exact", "topk_index")),
                      fmt(peer), fmt(_ratio(c["detect"]["rps"], c["softmax"]["rps"]), 2),
                      fmt(_ratio(c["topk_index"]["rps"], c["topk_exact"]["rps"]), 2), fmt(_ratio(c["softmax"]["rps"], peer), 2)])
    return ["", "## Throughput, closed loop (req/s)", "",
            md_table(["D", "live", "detect", "softmax", "topk exact", "topk index", "torch peer softmax", "detect/softmax",
                      "index/exact", "slc/peer softmax"], cells, "r" * 10)]


def _md_protocols(res: dict) -> list[str]:
    """The same single-logit question over /v1 detect and KServe v2 (JSON, binary tensors, gRPC)."""
    rows = []
    for r in res["rows"]:
        c, s = r["slc"]["closed"], _protocols_single(r)
        cell = lambda e: f"{fmt(c[e]['rps'])}; {fmt(s[e]['p50_ms'], 2)}" if e in c else "–"  # noqa: E731
        rel = lambda e: fmt(_ratio(c[e]["rps"], c["detect"]["rps"]), 2) if e in c else "–"  # noqa: E731
        rows.append([f"{r['classes']:,}", *map(cell, ("detect", "v2", "v2_binary", "grpc")), *map(rel, ("v2", "v2_binary", "grpc"))])
    return ["", "## Protocols: one logit per input (closed-loop req/s; one-connection p50 ms)", "",
            "Closed loop: in the rotation above. One connection: detect and the v2 forms alone, interleaved per request "
            "(in the all-endpoint rotation each follows a different endpoint, v2 the index search, and pays for what "
            "that one evicted from the caches).", "",
            md_table(["D", "detect", "v2 JSON", "v2 binary", "gRPC", "v2 JSON / detect", "v2 binary / detect", "gRPC / detect"],
                     rows, "rllllrrr")]


def _md_softmax_bound(res: dict) -> list[str]:
    """The full softmax alone against its GEMM bound, and the ceiling the loop and client leave."""
    rows = []
    for r in res["rows"]:
        sat, one = r.get("softmax_saturated") or {}, r.get("softmax_one_batch") or {}
        bound = r["head_alone"].get("gemm_bound_inputs_per_s")
        use = sat.get("cpu")
        where = (f"{use['cores']['loop']:.2f} / {use['cores']['workers']:.2f} / {use['cores']['client']:.2f}; "
                 f"{use['idle_share']:.2f}" if use else "–")
        rows.append([f"{r['classes']:,}", fmt(sat.get("rps")), fmt(sat.get("p50_ms"), 2), fmt(one.get("rps")), fmt(bound),
                     fmt(_ratio(sat.get("rps"), bound), 2), fmt(_ratio(one.get("rps"), bound), 2), where,
                     fmt(cpu.ceiling_over_bound(use, bound), 2)])
    conns = lambda key: next((r[key]["concurrency"] for r in res["rows"] if r.get(key)), "–")  # noqa: E731
    return ["", "## Full softmax against the hardware (softmax alone: "
            f"{conns('softmax_saturated')} connections keep the next full batch queued while one computes; "
            f"{conns('softmax_one_batch')} fill exactly one batch, so the event loop's work and the pass take turns)", "",
            md_table(["D", "saturated req/s", "p50 ms", "one batch req/s", "GEMM bound at batch 64 (inputs/s)",
                      "saturated / bound", "one batch / bound", "saturated: cores of loop / workers / client; idle share",
                      "ceiling / bound"], rows, "rrrrrrrlr"),
            "", "Ceiling: the share of the bound a server would reach whose pass cost exactly the bound's GEMM (every "
            "core), while its event loop and the load client cost, on the same cores, the CPU per request measured in "
            "the saturated run. The bound is the fastest of the GEMM forms the server may use (numpy, onnxruntime over "
            "the mapped rows, two one-thread GEMMs, pre-packed chunks), logits only."]


def _md_full_logits(res: dict) -> list[str]:
    """All D logits over KServe v2, JSON against binary tensors."""
    rows = [[f"{r['classes']:,}", f["batch"], fmt(f["json"]["median_ms"], 2), fmt(f["json"]["bytes"] / 1e6, 2),
             fmt(f["binary"]["median_ms"], 2), fmt(f["binary"]["bytes"] / 1e6, 2), fmt(f["json_over_binary"], 1)]
            for r in res["rows"] if (f := r.get("full_logits"))]
    return ["", "## All D logits over KServe v2: JSON against raw float32 (one connection, median of alternating requests, "
            "the client's decoding included)", "",
            md_table(["D", "inputs per request", "JSON ms", "JSON MB", "binary ms", "binary MB", "JSON / binary time"],
                     rows, "r" * 7)]


def _p50_p99(e: Optional[dict]) -> str:
    return f"{fmt(e['p50_ms'], 2)} / {fmt(e['p99_ms'], 2)}" if e else "–"


def _md_latency_closed(res: dict) -> list[str]:
    """Closed-loop p50 / p99."""
    rows = []
    for r in res["rows"]:
        c = r["slc"]["closed"]
        pc = r.get("peer", {}).get("closed", {}).get("softmax")
        rows.append([f"{r['classes']:,}", *(_p50_p99(c[e]) for e in ("detect", "softmax", "topk_exact", "topk_index")),
                     _p50_p99(pc)])
    return ["", "## Latency, closed loop (ms, p50 / p99)", "",
            md_table(["D", "detect", "softmax", "topk exact", "topk index", "torch peer softmax"], rows, "rlllll")]


def _md_latency_single(res: dict) -> list[str]:
    """One-connection p50 / p99."""
    rows = []
    for r in res["rows"]:
        s = r["slc"]["single_connection"]
        ps = r.get("peer", {}).get("single_connection", {}).get("softmax")
        rows.append([f"{r['classes']:,}", *(_p50_p99(s[e]) for e in ("detect", "softmax", "topk_exact", "topk_index")),
                     _p50_p99(ps), fmt(_ratio(s["softmax"]["p50_ms"], s["detect"]["p50_ms"]), 1)])
    return ["", "## Latency, one connection (ms, p50 / p99)", "",
            md_table(["D", "detect", "softmax", "topk exact", "topk index", "torch peer softmax", "softmax/detect p50"],
                     rows, "rlllllr")]


def _md_memory(res: dict) -> list[str]:
    """Memory, recall, start-up per D."""
    rows = []
    for r in res["rows"]:
        mem = r["memory"]
        rows.append([f"{r['classes']:,}", fmt(r["head_bytes"] / 2**20), fmt(mem["loaded_rss"] / 2**20),
                     fmt(mem["rss_over_head"], 2), fmt(mem.get("over_baseline_over_head"), 2),
                     fmt((r.get("peer", {}).get("memory_rss") or 0) / 2**20), fmt(r["recall"]["recall_at_k"], 3),
                     _index_kind(r), fmt(r["ready_s"])])
    return ["", "## Memory, recall, start-up", "",
            md_table(["D", "head MiB", "server RSS MiB", "RSS / head", "(RSS − smallest-D RSS) / head", "peer RSS MiB",
                      "topk index recall@10", "index kind", "ready s"], rows, "rrrrrrrlr")]


def _md_head_alone(res: dict) -> list[str]:
    """The head alone in numpy."""
    rows = []
    for r in res["rows"]:
        h = r["head_alone"]
        rows.append([f"{r['classes']:,}", fmt(h["one_logit_per_input_single_us"], 2), fmt(h["all_logits_per_input_single_us"], 2),
                     fmt(h["all_over_one_single"]), fmt(h["one_logit_per_input_batch64_us"], 3),
                     fmt(h["all_logits_per_input_batch64_us"], 2), fmt(h["all_over_one_batch64"]),
                     fmt(h["softmax_per_input_batch64_us"], 2)])
    return ["", "## The head alone (numpy, no HTTP; µs per input)", "",
            md_table(["D", "one logit, 1 input", "all logits, 1 input", "ratio", "one logit, batch 64", "all logits, batch 64",
                      "ratio", "softmax, batch 64"], rows, "r" * 8)]


def _md_ceiling(res: dict) -> list[str]:
    """The generator ceiling (trivial endpoint, wrk)."""
    rows = [[f"{r['classes']:,}", fmt(r["slc"]["closed"]["live"]["rps"]),
             fmt(w.get("rps")) if w.get("available") else w.get("note", "–")]
            for r in res["rows"] for w in [r.get("wrk_live") or {}]]
    return ["", "## Generator ceiling", "",
            "The trivial endpoint (`GET /v1/health/live`) in the same rotation is the ceiling of client + server "
            "framework on these cores; wrk on the same endpoint for comparison:", "",
            md_table(["D", "live via slc loadtest (req/s)", "wrk (req/s)"], rows, "rrr")]


def _md_paired(res: dict) -> list[str]:
    """detect at the smallest vs the largest D, both servers up."""
    L: list[str] = []
    pd = res.get("paired_detect")
    if pd:
        L += ["", "## detect at the smallest vs the largest D, both servers up", ""]
        if "error" in pd:
            L.append(f"Not measured: {pd['error'][:300]}")
        else:
            rows = [[f"{int(key):,}", fmt(v["rps"]), fmt(v["p50_ms"], 2), fmt(v["p99_ms"], 2)]
                    for key, v in pd.items() if isinstance(v, dict)]
            L += [f"Alternating {pd['rounds']} × {pd['block_s']:g} s closed-loop blocks per server (concurrency "
                  f"{res['concurrency']}), so both see the same machine.", "",
                  md_table(["D", "detect req/s", "p50 ms", "p99 ms"], rows, "rrrr"),
                  f"\nRatio large / small: {fmt(pd['large_over_small'], 2)}."]
    return L


def _md_default_model(res: dict) -> list[str]:
    """detect on the default model against the trivial endpoint."""
    L: list[str] = []
    dm = res.get("default_model")
    if dm:
        L += ["", "## Default model (`slc serve` without a bundle)", ""]
        if "error" in dm:
            L.append(f"Not measured: {dm['error'][:300]}")
        else:
            L.append(f"detect {fmt(dm['closed']['detect']['rps'])} req/s vs live {fmt(dm['closed']['live']['rps'])} req/s "
                     f"→ {fmt(dm['detect_over_live'], 2)} of the trivial endpoint.")
    return L


def scale_markdown(res: dict) -> str:
    L = [line for section in (_md_header, _md_throughput, _md_protocols, _md_softmax_bound, _md_full_logits,
                              _md_latency_closed, _md_latency_single, _md_memory, _md_head_alone, _md_precisions,
                              _md_ceiling, _md_paired, _md_default_model)
         for line in section(res)]
    L += ["", "Peer: tools/bench/torch_peer.py — FastAPI, pydantic body, eager torch backbone rebuilt from backbone.onnx, "
          "W and b as torch tensors, full softmax over D per request, no batching.", ""]
    return "\n".join(L)




def scale_plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    D = [r["classes"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    series = [("detect", "detect"), ("softmax", "softmax"), ("topk_exact", "topk exact"), ("topk_index", "topk index"),
              ("live", "live (trivial)")]
    for key, label in series:
        axes[0].plot(D, [r["slc"]["closed"][key]["rps"] for r in rows], marker="o", label=label)
        if key != "live":
            axes[1].plot(D, [r["slc"]["closed"][key]["p99_ms"] for r in rows], marker="o", label=label)
            axes[2].plot(D, [r["slc"]["single_connection"][key]["p50_ms"] for r in rows], marker="o", label=label)
    peer_rows = [r for r in rows if "closed" in r.get("peer", {})]
    if peer_rows:
        pd = [r["classes"] for r in peer_rows]
        axes[0].plot(pd, [r["peer"]["closed"]["softmax"]["rps"] for r in peer_rows], "k--", marker="x", label="torch peer softmax")
        axes[1].plot(pd, [r["peer"]["closed"]["softmax"]["p99_ms"] for r in peer_rows], "k--", marker="x", label="torch peer softmax")
        axes[2].plot(pd, [r["peer"]["single_connection"]["softmax"]["p50_ms"] for r in peer_rows], "k--", marker="x",
                     label="torch peer softmax")
    titles = [f"throughput, closed loop c={res['concurrency']} (req/s)", "p99 latency, closed loop (ms)",
              "p50 latency, one connection (ms)"]
    for ax, title in zip(axes, titles):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("classes D")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = write_file(path, lambda tmp: fig.savefig(tmp, dpi=110))
    plt.close(fig)

