"""The head alone in numpy, no HTTP: one logit per input against all D logits. The bound the
server's figures are read against."""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from serving.core import head_scan
from serving.core.compute import ONNX_HEAD_MAX_VALUES
from serving.core.packed_head import PackedHead


def _time_call(fn, min_time: float = 0.3, repeats: int = 5) -> float:
    """Median seconds per call over `repeats` rounds of at least `min_time` each."""
    fn()
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t0
        if dt >= min_time / repeats or n >= 1 << 20:
            break
        n *= 4
    rounds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t0) / n)
    return float(np.median(rounds))


def head_kernels(W: np.ndarray, b: np.ndarray, H: np.ndarray, ids: np.ndarray) -> dict:
    """The timed head computations: one logit per input (gathered row) vs all D logits.

    W [D, d], b [D], H [B, d] embeddings, ids [B] class ids. Each returns its logits.
    """
    h1, j = H[:1], int(ids[0])  # [1, d], the first query's class

    def softmax_batch():
        z = H @ W.T + b  # [B, D]
        z -= z.max(axis=1, keepdims=True)
        np.exp(z, out=z)
        return z / z.sum(axis=1, keepdims=True)

    return {
        "one_logit_single": lambda: np.float32(W[j] @ h1[0] + b[j]),  # scalar
        "one_logit_batch": lambda: np.einsum("nd,nd->n", W[ids], H) + b[ids],  # [B]
        "all_logits_single": lambda: h1 @ W.T + b,  # [1, D]
        "all_logits_batch": lambda: H @ W.T + b,  # [B, D]
        "softmax_batch": softmax_batch,  # [B, D]
    }


def head_alone(bundle: Path, batch: int = 64, seed: int = 0) -> dict:
    """The head in numpy without HTTP: one logit vs all D logits, microseconds per input."""
    W = np.load(bundle / "head_weight.npy", mmap_mode="r", allow_pickle=False)  # [D, d], mapped as the server does
    b = np.load(bundle / "head_bias.npy", allow_pickle=False)  # [D]
    D, d = W.shape
    rng = np.random.default_rng(seed)
    H = rng.standard_normal((batch, d)).astype(np.float32)
    H /= np.linalg.norm(H, axis=1, keepdims=True)  # [B, d]
    ids = rng.integers(0, D, batch)  # [B]
    t = {name: _time_call(fn) for name, fn in head_kernels(W, b, H, ids).items()}
    t["chunked_gemm"] = _time_call(lambda: head_scan.scan(W, b, H, []))  # the server's pass, nothing kept
    ort_gemm = head_scan.OrtGemm(d, threads=os.cpu_count() or 1)
    t["chunked_ort_gemm"] = _time_call(lambda: head_scan.scan(W, b, H, [], gemm=ort_gemm))
    if (os.cpu_count() or 1) > 1:  # two one-thread GEMMs taking chunks in turn (softmax_impl ort_pair, packed_pair)
        rows = head_scan.pair_rows(batch, D)
        pair = tuple(head_scan.over_rows(head_scan.OrtGemm(d, threads=1), W, b) for _ in range(2))
        bufs = (np.empty(batch * rows, np.float32), np.empty(batch * rows, np.float32))
        with ThreadPoolExecutor(1) as pool:
            t["chunked_ort_pair"] = _time_call(lambda: head_scan.scan_two(D, H, [], pair, bufs, pool, rows))
            if D * d <= ONNX_HEAD_MAX_VALUES:  # what the server may hold: a packed copy of the head
                packed = PackedHead(W, b, rows)
                t["chunked_packed_pair"] = _time_call(lambda: head_scan.scan_two(D, H, [], (packed, packed), bufs,
                                                                                 pool, rows))
                del packed
    us = {
        "one_logit_per_input_single_us": t["one_logit_single"] * 1e6,
        "one_logit_per_input_batch64_us": t["one_logit_batch"] / batch * 1e6,
        "all_logits_per_input_single_us": t["all_logits_single"] * 1e6,
        "all_logits_per_input_batch64_us": t["all_logits_batch"] / batch * 1e6,
        "softmax_per_input_batch64_us": t["softmax_batch"] / batch * 1e6,
        # the bound a full-softmax server is read against: the fastest of one [B, D] numpy GEMM and the
        # chunked pass with numpy's or onnxruntime's GEMM, or two one-thread ones taking chunks in turn, over
        # the mapped rows or pre-packed (logits only: no softmax, no HTTP, no backbone)
        "gemm_bound_inputs_per_s": batch / min(t[k] for k in ("all_logits_batch", "chunked_gemm", "chunked_ort_gemm",
                                                               "chunked_ort_pair", "chunked_packed_pair") if k in t),
        "chunked_gemm_per_input_batch64_us": t["chunked_gemm"] / batch * 1e6,
        "chunked_ort_gemm_per_input_batch64_us": t["chunked_ort_gemm"] / batch * 1e6,
    }
    for k in ("chunked_ort_pair", "chunked_packed_pair"):
        if k in t:
            us[f"{k}_per_input_batch64_us"] = t[k] / batch * 1e6
    us["all_over_one_single"] = us["all_logits_per_input_single_us"] / us["one_logit_per_input_single_us"]
    us["all_over_one_batch64"] = us["all_logits_per_input_batch64_us"] / us["one_logit_per_input_batch64_us"]
    return us
