"""`slc bench device`: the server on a GPU against the device's own floor and the CPU server of the same
machine, as D grows (issue 36; docs/results/gpu-serving.md). Made to finish within a few minutes on
one GPU, as the serving phase of `make gpu-check`.

For each D (synthetic bundles, cached under $SLC_HOME/bench): a server with SLC_DEVICE=cuda, then
(up to --cpu-max-classes) one with SLC_DEVICE=cpu, each measured over HTTP by the load test's own
client: one-connection p50 of detect, softmax p(j), exact top-k and all logits (KServe v2, binary
output), and saturated softmax (req/s at 2 x max_batch connections), the server's RSS, and what
GET /v1/model says it chose (softmax pass, where the head lives, where small backbone batches run).
The floor of a pass over the head is its bytes over the device's read bandwidth, measured in the
same run by onnxruntime (a ReduceSum over 1 GiB resident on the GPU).
"""
from __future__ import annotations

import json
import logging
import time
import urllib.request
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from tools import loadtest as lt
from tools.bench.run import INPUT_DIM, cached_bundle, full_logits_formats, machine_info
from tools.bench.server import process_tree_memory, slc_server
from tools.loadtest.stats import endpoint_summary
from tools.report import fmt, md_table

log = logging.getLogger(__name__)

SINGLE = ["detect", "softmax", "topk_exact"]
SATURATE = 128  # connections: 2 x the server's max_batch, the next batch queued while one computes
BANDWIDTH_BYTES = 1 << 30


def device_bandwidth(rounds: int = 9) -> Optional[float]:
    """Bytes per second the GPU reads (ReduceSum over BANDWIDTH_BYTES resident there), or None without CUDA."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from serving.core.device.backend import preload_cuda

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return None
    preload_cuda()
    n = BANDWIDTH_BYTES // 4
    node = helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0)
    graph = helper.make_graph([node], "read", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
                              [helper.make_tensor_value_info("s", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider"])
    x = ort.OrtValue.ortvalue_from_numpy(np.ones(n, np.float32), "cuda", 0)
    best = float("inf")
    for _ in range(rounds):
        io = sess.io_binding()
        io.bind_ortvalue_input("x", x)
        io.bind_output("s", "cpu")
        t0 = time.perf_counter()
        sess.run_with_iobinding(io)
        io.copy_outputs_to_cpu()
        best = min(best, time.perf_counter() - t0)
    return BANDWIDTH_BYTES / best


def _model(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/v1/model", timeout=30).read())


def measure(bundle: Path, device: str, duration: float, log_dir: Path, precision: str = "float32",
            env: Optional[dict] = None, saturate: int = SATURATE, saturated_detect: bool = False) -> dict:
    """One server on `device` with the head in `precision`: its choices, one-connection p50s, all logits,
    saturated softmax (and with `saturated_detect`, saturated detect on the same server), RSS.
    `env`: more SLC_* settings (SLC_SOFTMAX_IMPL=device: the device pass on the CPU provider)."""
    data_dir = bundle.with_name(bundle.name + f"-data-{device}")
    # the class index is not what this bench measures (exact top-k is): none is built, on either device
    env = {"SLC_DEVICE": device, "SLC_CLASS_INDEX": "exact", "SLC_HEAD_PRECISION": precision, **(env or {})}
    tag = f"{bundle.name}-{device}-{precision}" + "".join(f"-{v}" for k, v in (env or {}).items() if k == "SLC_INLINE_MAX_MS")
    with slc_server(bundle, log_dir, tag, data_dir, env=env) as srv:
        ready_s = srv.wait_ready(1800)
        model = _model(srv.url)
        one = lt.run_loadtest(srv.url, SINGLE, concurrency=1, duration=duration * len(SINGLE), warmup=1.0,
                              interleave="request")
        full = full_logits_formats(srv.url, model["name"], rounds=7, formats=("binary",))  # JSON of 10^7: the client's
        sat, sat_cpu = saturated(srv, "softmax", saturate, duration, 2.0)
        sat_detect, detect_cpu = (saturated(srv, "detect", saturate, duration, 1.0) if saturated_detect
                                  else (None, None))
        rss = process_tree_memory(srv.proc.pid)["rss"]
    single = endpoint_summary(one.report)
    out = {"device": device, "precision": precision, "ready_s": ready_s, "rss": rss,
           "chosen": {"softmax_impl": model["softmax_impl"], "head_device": model.get("head_device"),
                      "head_precision": model.get("head_precision"), "providers": model["providers"],
                      "small_batch_backbone": model["batching"].get("small_batch_backbone"),
                      "small_batch_max": model["batching"].get("one_thread_backbone_max_batch")},
           "p50_ms": {name: single[name]["p50_ms"] for name in SINGLE} | {"all_logits": full["binary"]["median_ms"]},
           "errors": sum(sum(s["errors"].values()) for s in single.values()),  # {status or transport: count}
           "saturated_softmax_rps": endpoint_summary(sat.report)["softmax"]["rps"], "saturated_softmax_cpu": sat_cpu}
    if sat_detect is not None:
        out["saturated_detect_rps"] = endpoint_summary(sat_detect.report)["detect"]["rps"]
        out["saturated_detect_cpu"] = detect_cpu
    return out


def saturated(srv, endpoint: str, connections: int, duration: float, warmup: float) -> tuple:
    """(the load test's result, where the CPU went meanwhile: the server's event-loop thread, its other
    threads, the client; tools/bench/cpu.py) of one endpoint at `connections` connections. A thread
    near one core is what bounds the route; neither near it: the device or the batching."""
    from tools.bench import cpu

    before = cpu.snapshot(srv.proc.pid)  # (the warm-up counts too: the same load)
    result = lt.run_loadtest(srv.url, [endpoint], concurrency=connections, duration=duration, warmup=warmup)
    rps = endpoint_summary(result.report)[endpoint]["rps"]
    return result, cpu.split(before, cpu.snapshot(srv.proc.pid), rps)


def with_heads(bundle: Path, precisions: Sequence[str]) -> Path:
    """The cached bundle with the quantized heads asked for (added once, kept in the cache)."""
    from serving.bundle.format import MANIFEST
    from serving.bundle.heads import add_heads

    have = json.loads((bundle / MANIFEST).read_text()).get("heads") or {}
    missing = tuple(p for p in precisions if p != "float32" and p not in have)
    if missing:
        log.info("adding the %s head(s) to %s", ", ".join(missing), bundle.name)
        add_heads(bundle, missing)
    return bundle


def run_device_bench(classes: Sequence[int], dim: int, duration: float, cpu_max_classes: int, log_dir: Path,
                     precisions: Sequence[str] = ("float32",)) -> dict:
    """Per D and head precision, the GPU server (and up to cpu_max_classes, the float32 CPU server)."""
    from serving.core.device.head import resident_bytes

    t0 = time.perf_counter()
    bandwidth = device_bandwidth()
    rows = []
    for D in classes:
        bundle = with_heads(cached_bundle(D, dim), precisions)
        for precision in precisions:
            head_bytes = resident_bytes(D, dim, precision)
            row = {"classes": D, "dim": dim, "precision": precision, "head_bytes": head_bytes,
                   "floor_ms": 1e3 * head_bytes / bandwidth if bandwidth else None, "servers": []}
            for device in ["cuda"] + (["cpu"] if D <= cpu_max_classes and precision == "float32" else []):
                log.info("D=%d %s on %s", D, precision, device)
                row["servers"].append(measure(bundle, device, duration, log_dir, precision))
            rows.append(row)
    return {"machine": machine_info(), "device_read_bytes_per_s": bandwidth, "input_dim": INPUT_DIM,
            "duration_s": duration, "rows": rows, "elapsed_s": time.perf_counter() - t0}


def device_markdown(res: dict, command: str) -> str:
    bw = res["device_read_bytes_per_s"]
    lines = ["# The server on a GPU: passes over the head against the device floor\n",
             f"Command: `{command}`  \nMachine: {res['machine']}  \n"
             f"Device read bandwidth (onnxruntime ReduceSum over 1 GiB on the GPU): "
             f"{fmt(bw / 1e12 if bw else None, 2)} TB/s. Floor = head bytes / that bandwidth.\n"]
    head = ["D", "head", "server", "softmax pass", "small batches", "detect p50", "softmax p50", "top-k exact p50",
            "all logits p50", "floor", "sat. softmax req/s", "detect / softmax", "RSS MB"]
    body = []
    for row in res["rows"]:
        for s in row["servers"]:
            p = s["p50_ms"]
            body.append([f"{row['classes']:,}", row.get("precision", "float32"), s["device"], s["chosen"]["softmax_impl"],
                         str(s["chosen"]["small_batch_backbone"]), fmt(p["detect"], 3), fmt(p["softmax"], 3),
                         fmt(p["topk_exact"], 3), fmt(p["all_logits"], 3), fmt(row["floor_ms"], 3),
                         fmt(s["saturated_softmax_rps"], 0), fmt(p["detect"] / p["softmax"], 3),
                         fmt(s["rss"] / 1e6, 0)])
    lines.append(md_table(head, body))
    lines.append("\nOne-connection p50 in ms over HTTP (the load test's client); all logits: KServe v2 "
                 "`<model>-full` with binary output, batch 1. detect / softmax: the single-logit answer's "
                 "latency over the full softmax's, the headline ratio a GPU user reads.\n")
    return "\n".join(lines)
