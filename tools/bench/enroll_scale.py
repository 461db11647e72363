"""`slc bench enroll`: many classes enrolled into a large server, under a detect probe (issue 38
part 5; docs/results/enroll-scale.md).

One CPU server of a synthetic bundle (D trained classes, calibration negatives, so the
`standardised` rule runs as on an exported bundle), over HTTP:
1. before: one-connection p50 of detect and softmax (the load test's client);
2. a probe alone: one connection sending detect back to back for a few seconds;
3. N enrollments, one after another (`PUT /v1/classes/enr-i`, k random examples each), while the
   probe keeps sending: the time of each enrollment, and the probe's latencies during them; the
   last PACED of them at PACED_RATE a second (a steady trickle), the rest back to back;
4. after: detect and softmax again (a trained class, and an enrolled one), the server's RSS;
5. abuse: one enrollment beyond SLC_MAX_ENROLLED_CLASSES (507 expected); 8 concurrent PUTs of one
   new name (one 201, the others 200 or 409, one class in the end).
The class index is not built (SLC_CLASS_INDEX=exact): mode=index is not what is measured here.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from tools import loadtest as lt
from tools.bench.run import INPUT_DIM, cached_bundle, machine_info
from tools.bench.server import process_tree_memory, slc_server
from tools.loadtest.stats import endpoint_summary

KEY = "bench-enroll-key"
PACED, PACED_RATE = 200, 20.0  # the last enrollments paced: detect beside a steady trickle of them
HEADERS = {"Authorization": f"Bearer {KEY}"}


def _ms(values: list[float]) -> dict:
    a = 1e3 * np.asarray(values)
    if a.size == 0:
        return {"n": 0}
    return {"n": int(a.size), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
            "max": float(a.max()), "mean": float(a.mean())}


class Probe:
    """One connection sending detect back to back in a thread; latencies kept per phase."""

    def __init__(self, url: str, rng: np.random.Generator):
        self.url, self.stop_flag, self.phase = url, threading.Event(), "idle"
        self.latencies: dict[str, list[float]] = {}
        self.errors: dict[str, int] = {}
        self.body = {"inputs": rng.standard_normal((1, INPUT_DIM)).round(4).tolist()}
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop_flag.is_set():
                phase = self.phase
                t0 = time.perf_counter()
                r = client.post(f"{self.url}/v1/classes/0/detect", json=self.body)
                took = time.perf_counter() - t0
                if phase != "idle":
                    self.latencies.setdefault(phase, []).append(took)
                    if r.status_code != 200:
                        self.errors[phase] = self.errors.get(phase, 0) + 1

    def hold(self, phase: str, seconds: float, at_least: int = 1, limit_s: float = 60.0) -> None:
        """Stay in `phase` for `seconds` and until `at_least` probes answered in it (a loaded machine's
        first probe can take longer than the phase), at most `limit_s`."""
        self.phase = phase
        t0 = time.perf_counter()
        time.sleep(seconds)
        while len(self.latencies.get(phase, ())) < at_least and time.perf_counter() - t0 < limit_s:
            time.sleep(0.01)

    def __enter__(self) -> "Probe":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_flag.set()
        self.thread.join(timeout=30)


def one_connection(url: str, duration: float, class_: str | None = None) -> dict:
    res = lt.run_loadtest(url, ["detect", "softmax"], class_=class_, concurrency=1, duration=2 * duration,
                          warmup=1.0, interleave="request")
    return {name: s["p50_ms"] for name, s in endpoint_summary(res.report).items()}


def enroll_all(url: str, names: range, k: int, rng: np.random.Generator, times: list[float], statuses: dict,
               rate: float | None = None) -> None:
    """Enrollments enr-i (i in names) one after another on one connection, back to back or paced at
    `rate` per second; each one's time and status added to `times` and `statuses`."""
    with httpx.Client(timeout=60, headers=HEADERS) as client:
        start = time.perf_counter()
        for n, i in enumerate(names):
            if rate:
                time.sleep(max(0.0, start + n / rate - time.perf_counter()))
            body = {"inputs": rng.standard_normal((k, INPUT_DIM)).round(4).tolist()}
            t0 = time.perf_counter()
            r = client.put(f"{url}/v1/classes/enr-{i}", json=body)
            times.append(time.perf_counter() - t0)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1


def abuse(url: str, k: int, rng: np.random.Generator) -> dict:
    body = {"inputs": rng.standard_normal((k, INPUT_DIM)).round(4).tolist()}
    with httpx.Client(timeout=60, headers=HEADERS) as client:
        over = client.put(f"{url}/v1/classes/one-too-many", json=body)
        client.delete(f"{url}/v1/classes/enr-0")  # room for exactly one more class

        def put(_):
            return client.put(f"{url}/v1/classes/same-name", json=body).status_code

        with ThreadPoolExecutor(8) as pool:
            same = sorted(pool.map(put, range(8)))
        listed = client.get(f"{url}/v1/classes").json()
    names = [c["class_name"] for c in listed["classes"]]
    return {"over_limit": {"status": over.status_code, "code": over.json().get("error", {}).get("code")},
            "same_name_statuses": same, "same_name_classes": names.count("same-name")}


def run_enroll_bench(classes: int, enroll: int, examples: int, duration: float, negatives: int,
                     log_dir: Path, dim: int = 256) -> dict:
    t_start = time.perf_counter()
    bundle = cached_bundle(classes, dim, negatives=negatives)
    rng = np.random.default_rng(0)
    env = {"SLC_DEVICE": "cpu", "SLC_API_KEY": KEY, "SLC_MAX_ENROLLED_CLASSES": str(enroll),
           "SLC_CLASS_INDEX": "exact"}
    with slc_server(bundle, log_dir, f"enroll-D{classes}", log_dir / "data", env=env) as srv:  # a fresh store
        ready_s = srv.wait_ready(1800)
        rss_before = process_tree_memory(srv.proc.pid)["rss"]
        before = one_connection(srv.url, duration)
        times: list[float] = []
        statuses: dict = {}
        paced = min(PACED, enroll // 2)
        with Probe(srv.url, rng) as probe:
            probe.hold("alone", duration)
            probe.phase = "enrolling back to back"
            t0 = time.perf_counter()
            enroll_all(srv.url, range(enroll - paced), examples, rng, times, statuses)
            enroll_s = time.perf_counter() - t0
            probe.phase = f"enrolling {PACED_RATE:g} a second"
            enroll_all(srv.url, range(enroll - paced, enroll), examples, rng, times, statuses, rate=PACED_RATE)
            probe.phase = "idle"
        rss_after = process_tree_memory(srv.proc.pid)["rss"]
        after = one_connection(srv.url, duration)
        after_enrolled = one_connection(srv.url, duration, class_="enr-1")
        model = httpx.get(srv.url + "/v1/model", timeout=30).json()
        abused = abuse(srv.url, examples, rng)
    return {"machine": machine_info(), "classes": classes, "dim": dim, "enrolled": enroll, "examples": examples,
            "negatives": negatives, "ready_s": ready_s, "rule": model["classes"].get("enroll_rule"),
            "served_enrolled": model["classes"].get("enrolled"), "enroll_s": enroll_s, "statuses": statuses,
            "enroll_ms": _ms(times), "enroll_first_ms": _ms(times[:100]), "enroll_last_ms": _ms(times[-100:]),
            "back_to_back": enroll - paced, "paced": paced, "paced_rate": PACED_RATE,
            "probe_ms": {phase: _ms(v) for phase, v in probe.latencies.items()}, "probe_errors": probe.errors,
            "p50_ms": {"before": before, "after": after, "after_enrolled_class": after_enrolled},
            "rss": {"before": rss_before, "after": rss_after}, "abuse": abused,
            "elapsed_s": time.perf_counter() - t_start}


def enroll_markdown(r: dict, command: str) -> str:
    from tools.report import fmt, md_table

    mb = 1 / 2 ** 20
    lines = [f"# {r['enrolled']:,} classes enrolled into a {r['classes']:,}-class server\n",
             f"Command: `{command}`  \nMachine: {r['machine']}  \n"
             f"Bundle: synthetic, D = {r['classes']:,}, d = {r['dim']}, {r['negatives']} calibration negatives "
             f"(rule `{r['rule']}`); server on the CPU, ready in {r['ready_s']:.0f} s; {r['examples']} examples "
             f"(JSON inputs) per enrollment, one enrollment at a time on one connection.\n"]
    e = r["enroll_ms"]
    lines.append(f"{r['back_to_back']:,} enrollments back to back, then {r['paced']:,} at {r['paced_rate']:g} a second "
                 f"(total s: the back-to-back ones).\n")
    lines.append(md_table(["enrollments", "total s", "per enrollment p50 ms", "p99 ms", "max ms",
                           "first 100 p50", "last 100 p50", "statuses", "served after"],
                          [[f"{r['enrolled']:,}", fmt(r["enroll_s"], 1), fmt(e["p50"], 2), fmt(e["p99"], 2),
                            fmt(e["max"], 1), fmt(r["enroll_first_ms"]["p50"], 2), fmt(r["enroll_last_ms"]["p50"], 2),
                            ", ".join(f"{k}: {v:,}" for k, v in r["statuses"].items()), f"{r['served_enrolled']:,}"]]))
    lines.append("\nA detect probe (one connection, back to back) alone and while the enrollments ran:\n")
    rows = [[phase, f"{p['n']:,}", fmt(p.get("p50"), 3), fmt(p.get("p99"), 3), fmt(p.get("max"), 1),
             str(r["probe_errors"].get(phase, 0))] for phase, p in r["probe_ms"].items()]
    lines.append(md_table(["probe", "requests", "p50 ms", "p99 ms", "max ms", "errors"], rows))
    p = r["p50_ms"]
    lines.append("\nOne-connection p50 (ms), the load test's client:\n")
    lines.append(md_table(["when", "detect", "softmax"],
                          [["before (trained class 0)", fmt(p["before"]["detect"], 3), fmt(p["before"]["softmax"], 3)],
                           ["after (trained class 0)", fmt(p["after"]["detect"], 3), fmt(p["after"]["softmax"], 3)],
                           ["after (enrolled class enr-1)", fmt(p["after_enrolled_class"]["detect"], 3),
                            fmt(p["after_enrolled_class"]["softmax"], 3)]]))
    a = r["abuse"]
    lines.append(f"\nServer RSS {r['rss']['before'] * mb:,.0f} MiB before, {r['rss']['after'] * mb:,.0f} MiB after "
                 f"(+{(r['rss']['after'] - r['rss']['before']) * mb:,.0f} MiB for {r['enrolled']:,} classes).\n")
    lines.append(f"Abuse: one enrollment beyond the limit answered {a['over_limit']['status']} "
                 f"`{a['over_limit']['code']}`; 8 concurrent PUTs of one new name answered "
                 f"{a['same_name_statuses']} and left {a['same_name_classes']} class of that name.\n")
    return "\n".join(lines)
