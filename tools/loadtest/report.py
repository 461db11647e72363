"""A load run's reports: report.json, report.md (tables) and latency.png (histogram and
percentile spectrum)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tools.loadtest.stats import LoadtestResult
from tools.report import fmt, md_table, write_file, write_result


def _fmt(x, digits: int = 2) -> str:
    """This report's style of tools.report.fmt: fixed point at every size, ints as they are."""
    return fmt(x, digits, sci_below=0, group_ints=False)


def report_markdown(report: dict) -> str:
    load = report["load"]
    load_s = (f"closed loop, concurrency {load['concurrency']}" if load["model"] == "closed"
              else f"open loop, {load['rate']} req/s (latency from the scheduled send time)")
    lines = [
        f"# slc load test: {', '.join(report['endpoints'])}",
        "",
        f"- target: `{report['url']}`, class `{report.get('class')}`, {report['batch']} input(s) per request",
        f"- load: {load_s}; interleaving per {'request slot' if report['interleave'] == 'request' else 'time block of ' + _fmt(report.get('block_s')) + ' s'}",
        f"- measured {report['requests']} requests over {_fmt(report['window_s'])} s after {report['warmup_s']} s warm-up "
        f"({report['warmup_requests']} warm-up requests not recorded); client `{report['client']}`",
    ]
    if report.get("command"):
        lines.append(f"- command: `{report['command']}`")
    ceil = report.get("generator_ceiling")
    if ceil:
        wrk = ceil.get("wrk") or {}
        wrk_s = (f"wrk {_fmt(wrk.get('rps'), 0)} req/s (p50 {_fmt(wrk.get('p50_ms'))} ms)" if wrk.get("available")
                 else f"wrk: {wrk.get('note', 'not run')}")
        lines.append(f"- generator ceiling on `{ceil['endpoint']}` (concurrency {ceil['concurrency']}): "
                     f"{_fmt(ceil['rps'], 0)} req/s (p50 {_fmt(ceil['p50_ms'])} ms); {wrk_s}. "
                     "Numbers near this ceiling measure the client and the shared cores, not the endpoint.")
    rows = [[name, ep["requests"], ep["ok"], _fmt(ep["goodput_rps"], 1),
             *(_fmt(ep["latency_ms"].get(q)) for q in ("p50", "p90", "p99", "p99.9", "max")),
             ", ".join(f"{k}: {v}" for k, v in ep["errors"].items()) or "none"] for name, ep in report["endpoints"].items()]
    lines += ["", md_table(["endpoint", "requests", "ok", "req/s", "p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "max ms", "errors"],
                           rows, "lrrrrrrrrl")]
    if report["ratios"]:
        rows = [[pair, *(_fmt(r[k]) for k in ("latency_p50_b_over_a", "latency_p99_b_over_a", "latency_mean_b_over_a",
                                              "goodput_a_over_b"))] for pair, r in report["ratios"].items()]
        lines += ["", "Ratios (b over a for latency: > 1 means a is faster):", "",
                  md_table(["a/b", "p50", "p99", "mean", "goodput a/b"], rows, "lrrrr")]
        if report["interleave"] == "request" and report["load"]["model"] == "closed":
            lines += ["", "With per-request interleaving in a closed loop every endpoint gets the same number of "
                      "requests, so goodput ratios are ~1 by construction; compare latencies."]
    lines.append("")
    return "\n".join(lines)


def plot_latency(result: LoadtestResult, path: Path) -> Path:
    """Latency distribution per endpoint: histogram (log x) and percentile spectrum."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = result.samples.arrays()
    ok = a["measured"] & (a["error"] == "") & (a["status"] >= 200) & (a["status"] < 300)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, name in enumerate(result.endpoints):
        lat = (a["done"] - a["scheduled"])[ok & (a["endpoint"] == i)] * 1e3
        if lat.size == 0:
            continue
        lo, hi = max(lat.min(), 1e-3), max(lat.max(), 1e-3 * 1.01)
        bins = np.logspace(np.log10(lo), np.log10(hi) + 1e-9, 60)
        ax1.hist(lat, bins=bins, histtype="step", label=f"{name} (n={lat.size})")
        ordered = np.sort(lat)
        q = (np.arange(1, ordered.size + 1) - 0.5) / ordered.size
        ax2.plot(1.0 / (1.0 - q), ordered, label=name)
    ax1.set_xscale("log")
    ax1.set_xlabel("latency (ms)")
    ax1.set_ylabel("requests")
    ax1.set_title("latency histogram")
    if ax1.get_legend_handles_labels()[0]:  # nothing to label when no request succeeded
        ax1.legend(fontsize=8)
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ticks = [2, 10, 100, 1000]
    ax2.set_xticks(ticks)
    ax2.set_xticklabels(["p50", "p90", "p99", "p99.9"])
    ax2.set_xlabel("percentile")
    ax2.set_ylabel("latency (ms)")
    ax2.set_title("percentile spectrum")
    if ax2.get_legend_handles_labels()[0]:
        ax2.legend(fontsize=8)
    fig.tight_layout()
    path = write_file(path, lambda tmp: fig.savefig(tmp, dpi=110))
    plt.close(fig)
    return path


def write_reports(result: LoadtestResult, out: Path) -> list[Path]:
    """OUT/report.json, report.md and latency.png; their paths in that order."""
    md, js = write_result(out, "report", lambda: report_markdown(result.report), result.report, default=float)
    png = plot_latency(result, Path(out) / "latency.png")
    return [js, md, png]

