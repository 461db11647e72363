"""What a load run records and how it is summarised: one row per request, nearest-rank
percentiles, per-endpoint throughput over the time each endpoint owned, ratios between them."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

PERCENTILES = (50.0, 90.0, 99.0, 99.9)


@dataclass
class Samples:
    """One row per issued request (warm-up included, flagged), times in perf_counter seconds."""

    endpoint: list = field(default_factory=list)   # index into the endpoint list
    scheduled: list = field(default_factory=list)  # open loop: scheduled send time; closed: send time
    sent: list = field(default_factory=list)       # when a connection was held and the write began
    done: list = field(default_factory=list)
    status: list = field(default_factory=list)     # HTTP status, or 0 for a transport error
    error: list = field(default_factory=list)      # transport error name or ""
    measured: list = field(default_factory=list)   # False for warm-up

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            "endpoint": np.asarray(self.endpoint, dtype=np.int64),
            "scheduled": np.asarray(self.scheduled, dtype=np.float64),
            "sent": np.asarray(self.sent, dtype=np.float64),
            "done": np.asarray(self.done, dtype=np.float64),
            "status": np.asarray(self.status, dtype=np.int64),
            "error": np.asarray(self.error, dtype=object),
            "measured": np.asarray(self.measured, dtype=bool),
        }


@dataclass
class LoadtestResult:
    report: dict
    samples: Samples
    endpoints: list[str]
    measure_start: float = 0.0



def nearest_rank_percentiles(values: np.ndarray, percentiles: Sequence[float] = PERCENTILES) -> dict[float, float]:
    """Nearest-rank percentile: the smallest sample with at least p% of samples at or below it.

    (The definition HdrHistogram and wrk use; numpy's method="inverted_cdf".)
    """
    ordered = np.sort(np.asarray(values, dtype=np.float64))
    n = ordered.size
    if n == 0:
        return {p: float("nan") for p in percentiles}
    out = {}
    for p in percentiles:
        rank = max(1, math.ceil(p / 100.0 * n - 1e-9))
        out[p] = float(ordered[min(rank, n) - 1])
    return out


def _pkey(p: float) -> str:
    return f"p{p:g}"


def latency_summary(seconds: np.ndarray) -> dict:
    """Latency statistics in milliseconds (nearest-rank percentiles, mean, max, count)."""
    seconds = np.asarray(seconds, dtype=np.float64)
    if seconds.size == 0:
        return {"count": 0}
    out = {_pkey(p): v * 1e3 for p, v in nearest_rank_percentiles(seconds).items()}
    out.update({"mean": float(seconds.mean() * 1e3), "max": float(seconds.max() * 1e3),
                "min": float(seconds.min() * 1e3), "count": int(seconds.size)})
    return out


def _owned_time(index: int, n: int, window: float, interleave: str, block_s: float) -> float:
    """Seconds of the measured window that belong to endpoint `index` (all of it unless 'block')."""
    if interleave != "block" or n == 1:
        return window
    total, j = 0.0, index
    while j * block_s < window:
        total += min((j + 1) * block_s, window) - j * block_s
        j += n
    return max(total, 1e-9)


def summarize(samples: Samples, names: list[str], measure_start: float, duration: float,
              interleave: str = "request", block_s: float = 1.0, owned: Optional[list[float]] = None) -> dict:
    """Per-endpoint throughput, latency and errors over the measured requests; ratios between endpoints."""
    a = samples.arrays()
    m = a["measured"]
    if m.sum():
        # the window ends at the last completion, or at the planned end if requests stopped earlier
        window = float(max(a["done"][m].max(), a["scheduled"][m].max()) - measure_start)
    else:
        window = 0.0
    window = max(window, 1e-9)
    if owned is not None:  # closed-loop blocks: each endpoint's own blocks, drains included
        window = max(sum(owned), 1e-9)
    per = {}
    for i, name in enumerate(names):
        sel = m & (a["endpoint"] == i)
        status, error = a["status"][sel], a["error"][sel]
        ok = (error == "") & (status >= 200) & (status < 300)
        latency = (a["done"] - a["scheduled"])[sel]
        service = (a["done"] - a["sent"])[sel]
        errors: dict[str, int] = {}
        for st, er in zip(status[~ok], error[~ok]):
            key = f"transport:{er}" if er else str(int(st))
            errors[key] = errors.get(key, 0) + 1
        # in 'block' interleaving an endpoint only owns its blocks: throughput over its own time
        sched = a["scheduled"][sel]
        own = max(owned[i], 1e-9) if owned is not None else _owned_time(i, len(names), window, interleave, block_s)
        per[name] = {
            "requests": int(sel.sum()),
            "ok": int(ok.sum()),
            "errors": dict(sorted(errors.items())),
            "throughput_rps": float(sel.sum() / own),
            "goodput_rps": float(ok.sum() / own),
            "window_s": own,
            "latency_ms": latency_summary(latency[ok]),
            "service_ms": latency_summary(service[ok]),
            "first_scheduled": float(sched.min() - measure_start) if sched.size else None,
        }
    total_ok = sum(v["ok"] for v in per.values())
    report = {
        "window_s": window,
        "requests": int(m.sum()),
        "ok": int(total_ok),
        "throughput_rps": float(m.sum() / window),  # all endpoints together
        "goodput_rps": float(total_ok / window),
        "warmup_requests": int((~m).sum()),
        "endpoints": per,
        "ratios": endpoint_ratios(per),
    }
    return report


def endpoint_ratios(per: dict) -> dict:
    """For each pair a/b: p50, p99 and mean latency of b over a (>1: a is faster), goodput a over b."""
    names = list(per)
    out = {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            la, lb = per[a]["latency_ms"], per[b]["latency_ms"]
            if not la.get("count") or not lb.get("count"):
                continue
            out[f"{a}/{b}"] = {
                "latency_p50_b_over_a": lb["p50"] / la["p50"] if la["p50"] else None,
                "latency_p99_b_over_a": lb["p99"] / la["p99"] if la["p99"] else None,
                "latency_mean_b_over_a": lb["mean"] / la["mean"] if la["mean"] else None,
                "goodput_a_over_b": (per[a]["goodput_rps"] / per[b]["goodput_rps"]) if per[b]["goodput_rps"] else None,
            }
    return out


def endpoint_summary(report: dict) -> dict:
    """The few numbers per endpoint of a load test's report that the benchmark tables need."""
    out = {}
    for name, ep in report["endpoints"].items():
        lat = ep["latency_ms"]
        out[name] = {"rps": ep["goodput_rps"], "requests": ep["requests"], "errors": ep["errors"],
                     "p50_ms": lat.get("p50"), "p90_ms": lat.get("p90"), "p99_ms": lat.get("p99"),
                     "p99.9_ms": lat.get("p99.9"), "max_ms": lat.get("max"), "mean_ms": lat.get("mean")}
    return out
