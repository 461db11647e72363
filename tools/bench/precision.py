"""The scale bench's head-precision phase (issue 29): the full softmax on the float32, bf16 and
int8 heads of one bundle, each in its own `slc serve` (SLC_HEAD_PRECISION), against the floor that
the bytes each precision reads per pass put on it at this machine's measured read bandwidth."""
from __future__ import annotations

import json
import logging
import time
import urllib.request
from pathlib import Path

import numpy as np

from tools import loadtest as lt
from tools.bench.server import process_tree_memory, slc_server
from tools.report import md_table
from serving.bundle.heads import add_heads
from serving.bundle.quantize import FILES

log = logging.getLogger(__name__)

PRECISIONS = ("float32", "bf16", "int8")
BANDWIDTH_BYTES = 256 << 20  # the array `read_bandwidth` sums: far above the last-level cache


def read_bandwidth(rounds: int = 7) -> float:
    """Bytes per second this machine reads memory at: a 256 MiB float32 array summed by one numpy
    thread per core, each over its share (numpy lets go of the GIL in the sum), best of `rounds`."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    a = np.ones(BANDWIDTH_BYTES // 4, dtype=np.float32)
    parts = np.array_split(a, os.cpu_count() or 1)
    best = float("inf")
    with ThreadPoolExecutor(len(parts)) as pool:
        for _ in range(rounds):
            t0 = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - t0)
    return a.nbytes / best


def head_bytes(classes: int, dim: int, precision: str) -> int:
    """Bytes one pass reads: the rows in the precision's width, the float32 bias, int8's scales."""
    per = {"float32": 4, "bf16": 2, "int8": 1}[precision]
    return classes * dim * per + classes * 4 + (classes * 4 if precision == "int8" else 0)


def ensure_heads(bundle: Path) -> None:
    """The bundle's int8 and bf16 heads, added once (the float32 files are kept)."""
    missing = tuple(p for p in ("int8", "bf16") if not (bundle / FILES[p]["weight"]).is_file())
    if missing:
        add_heads(bundle, missing)


def bench_precisions(bundle: Path, classes: int, dim: int, duration: float, saturate: int, log_dir: Path,
                     bandwidth: float) -> dict:
    """{precision: one-connection and saturated softmax, RSS, and the bandwidth floor}."""
    from tools.loadtest.stats import endpoint_summary

    ensure_heads(bundle)
    out = {}
    for precision in PRECISIONS:
        data_dir = bundle.with_name(bundle.name + f"-data-{precision}")
        with slc_server(bundle, log_dir, f"D{classes}-{precision}", data_dir,
                        env={"SLC_HEAD_PRECISION": precision}) as srv:
            ready = srv.wait_ready()
            model = json.loads(urllib.request.urlopen(srv.url + "/v1/model", timeout=30).read())
            one = lt.run_loadtest(srv.url, ["softmax"], concurrency=1, duration=duration, warmup=1.0)
            full = lt.run_loadtest(srv.url, ["softmax"], concurrency=saturate, duration=duration, warmup=2.0)
            rss = process_tree_memory(srv.proc.pid)["rss"]
        floor_ms = head_bytes(classes, dim, precision) / bandwidth * 1e3
        single = endpoint_summary(one.report)["softmax"]
        out[precision] = {"softmax_impl": model.get("softmax_impl"), "ready_s": ready, "single": single,
                          "saturated": endpoint_summary(full.report)["softmax"], "rss": rss, "floor_ms": floor_ms,
                          "p50_over_floor": single["p50_ms"] / floor_ms if single["p50_ms"] else None}
        log.info(f"D={classes:,} {precision}: one connection p50 {single['p50_ms']:.2f} ms (floor {floor_ms:.2f} ms), "
                 f"RSS {rss / 2**20:.0f} MiB")
    return out


# ---------------------------------------------------------------- exactness (no HTTP)
TOPK = 5


def _embeddings(bundle, inputs: np.ndarray, batch: int = 1024) -> np.ndarray:
    """h [N, d] float32 through the bundle's backbone.onnx."""
    from serving.bundle.session import ort_session

    session = ort_session(bundle.graph_path("backbone"), prepack=False)
    return np.concatenate([session.run(None, {"input": np.asarray(inputs[i:i + batch], np.float32)})[0]
                           for i in range(0, len(inputs), batch)])


def _quantized_gemm(bundle, precision: str, batch: int):
    from serving.core import head_scan
    from serving.core import quantized_head

    head = bundle.heads[precision]
    if precision == "bf16":
        return quantized_head.Bf16Head(head["weight"], bundle.bias), head_scan.pair_rows(batch, bundle.num_classes)
    rows = quantized_head.int8_rows(bundle.num_classes, head_scan.pair_rows(batch, bundle.num_classes))
    return quantized_head.Int8Head(head["weight"], head["scale"], bundle.bias, rows), rows


def exactness(bundle_dir: Path, inputs: np.ndarray, precision: str, labels: np.ndarray | None = None) -> dict:
    """The quantized head's logits against float64 ones on `inputs`: max and mean |Δlogit|, the
    relative error of p(j) as served (exact logit of j over the quantized normaliser; j = the label,
    else the exact argmax), top-1 agreement, top-5 overlap before and exact top-5 after re-scoring."""
    from serving.core import head_scan
    from serving.core import quantized_head
    from serving.bundle import load_bundle

    ensure_heads(Path(bundle_dir))
    bundle = load_bundle(bundle_dir, verify=False)
    h = _embeddings(bundle, inputs)  # [N, d]
    h64, n = h.astype(np.float64), len(h)
    gemm, rows = _quantized_gemm(bundle, precision, n)
    lse = {k: np.full(n, -np.inf) for k in ("exact", "quant")}
    top = {"exact": head_scan.TopK(n, TOPK), "quant": head_scan.TopK(n, TOPK), "rescored": head_scan.TopK(n, TOPK + quantized_head.TOPK_EXTRA)}
    err_max, err_sum, z_sum, z_sq, buf = 0.0, 0.0, 0.0, 0.0, np.empty(n * rows, np.float32)
    for start in range(0, bundle.num_classes, rows):
        stop = min(start + rows, bundle.num_classes)
        exact = h64 @ np.asarray(bundle.weight[start:stop], np.float64).T + np.asarray(bundle.bias[start:stop], np.float64)
        out = buf[:n * (stop - start)].reshape(n, stop - start)  # [N, C] contiguous, as the server's passes
        quant = gemm(h, start, stop, out).astype(np.float64)  # [N, C]
        err = np.abs(quant - exact)
        err_max, err_sum = max(err_max, float(err.max())), err_sum + float(err.sum())
        z_sum, z_sq = z_sum + float(exact.sum()), z_sq + float((exact ** 2).sum())
        for key, z in (("exact", exact), ("quant", quant)):
            m = z.max(axis=1)
            lse[key] = np.logaddexp(lse[key], m + np.log(np.exp(z - m[:, None]).sum(axis=1)))
        top["exact"].update(exact.astype(np.float32), start)
        top["quant"].update(quant.astype(np.float32), start)
        top["rescored"].update(quant.astype(np.float32), start)
    top["rescored"].rescore(h, bundle.weight, bundle.bias, keep=TOPK)
    ids = {k: t.result()[1] for k, t in top.items()}  # [N, 5] best first
    return {"precision": precision, "inputs": n, "classes": bundle.num_classes,
            "logit_std": float(np.sqrt(max(z_sq / (n * bundle.num_classes) - (z_sum / (n * bundle.num_classes)) ** 2, 0))),
            "max_abs_logit_error": err_max, "mean_abs_logit_error": err_sum / (n * bundle.num_classes),
            "p_j_rel_error_max": float(np.abs(np.expm1(lse["exact"] - lse["quant"])).max()),
            "p_j_rel_error_mean": float(np.abs(np.expm1(lse["exact"] - lse["quant"])).mean()),
            "p_j_of": "label" if labels is not None else "exact argmax",
            "top1_agreement": float((ids["quant"][:, 0] == ids["exact"][:, 0]).mean()),
            "top5_overlap": float(np.mean([len(set(a) & set(b)) / TOPK for a, b in zip(ids["quant"], ids["exact"])])),
            "top5_exact_after_rescoring": float((ids["rescored"] == ids["exact"]).all(axis=1).mean())}


def exactness_markdown(rows: list[dict]) -> str:
    L = ["# Quantized heads: how exact the served answers are", "",
         "Each row: the bundle's int8 or bf16 head (serving/bundle/quantize.py) through the server's own pass "
         "(serving/core/quantized_head.py) against float64 logits from the float32 head, on the inputs named. p(j) "
         "as served is the exact logit of j over the quantized normaliser, so its relative error is "
         "|exp(lse − lse_q) − 1|; the top-5 as served is re-scored exactly from the 5 + 16 best quantized "
         "candidates. The synthetic bundles are `slc bench scale`'s (`slc bundle synthetic --classes D --dim 256`, "
         "kept under ~/.cache/slc/bench). glyphs3755-ce: `slc export RUN --out glyphs3755-ce --head-precision int8,bf16` "
         "of glyphs3755.md's ce run (seed 0), on its test face (AR PL UKai, 8 renderings per class) saved as a float32 "
         ".npy. Speed and memory: scale.md, \"Head precision\"; replica-D10000000.md.", "",
         md_table(["bundle", "inputs", "D", "precision", "logit std", "max \\|Δlogit\\|", "mean \\|Δlogit\\|",
                   "p(j) rel. error max", "mean", "top-1 agreement", "top-5 overlap (quantized)",
                   "top-5 exact after re-scoring", "command"],
                  [[r["bundle"], f"{r['inputs_from']} ({r['inputs']:,})", f"{r['classes']:,}", r["precision"],
                    f"{r['logit_std']:.3g}", f"{r['max_abs_logit_error']:.3g}", f"{r['mean_abs_logit_error']:.3g}",
                    f"{r['p_j_rel_error_max']:.2e}", f"{r['p_j_rel_error_mean']:.2e}", f"{r['top1_agreement']:.4f}",
                    f"{r['top5_overlap']:.4f}", f"{r['top5_exact_after_rescoring']:.4f}", f"`{r['command']}`"] for r in rows],
                  "llrlrrrrrrrrl")]
    return "\n".join(L) + "\n"
