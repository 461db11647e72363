"""The passes over all D rows on a quantized head (SLC_HEAD_PRECISION; serving/bundle/quantize.py).

Both are head_scan ChunkGemms, run by head_scan.scan_two like the packed float32 head:

- `Int8Head`: one-thread onnxruntime sessions per chunk of classes, the chunk's int8 rows and
  per-class scales constants that onnxruntime packs once: com.microsoft.MatMulNBits (8 bits, the
  decode-time kernel of language models) for one or a few inputs, DynamicQuantizeMatMul (the
  inputs quantized to uint8 per call, an integer GEMM) for batches: a quarter of float32's bytes
  read per request.
- `Bf16Head`: each chunk's bfloat16 rows widened to float32 in a buffer of the thread's, then one
  numpy GEMM: half the bytes read from memory, but a widening pass per chunk (neither numpy nor
  onnxruntime's CPU provider has a bfloat16 GEMM on x86).

What is approximate is only the ranking and the softmax normaliser: the engine re-scores the
final top-k (from a few more candidates) and the asked class's logit on the float32 rows
(head_scan.TopK.rescore, SoftmaxStats.rescore). The all-logits answer is the quantized logits.
"""
from __future__ import annotations

import functools
import threading

import numpy as np

from serving.core.packed_head import run_into

MAX_CHUNKS = 512  # sessions per head at most: a 10⁷-class head gets chunks of ~20k classes
TOPK_EXTRA = 16  # a quantized top-k pass keeps k + this many candidates for the exact re-scoring
NBITS_MAX_BATCH = 4  # up to this many inputs MatMulNBits is the faster int8 kernel, above it DynamicQuantizeMatMul
TWO_KERNELS_MAX_VALUES = 1 << 28  # above D·d = 2^28 (10⁶ × 256) one kernel, MatMulNBits: each keeps ~2 bytes a weight


def int8_rows(num_classes: int, pair_rows: int) -> int:
    """Classes per chunk session: the pass's pair_rows, larger when that would make too many sessions."""
    return max(pair_rows, -(-num_classes // MAX_CHUNKS))


def _int8_graph(embed_dim: int, q: np.ndarray, scale: np.ndarray, bias: np.ndarray, kind: str) -> bytes:
    """z [M, C] ≈ h @ (scale · q).T + bias for one chunk; q [C, d] int8 rows, scale [C].

    kind "dynamic": com.microsoft.DynamicQuantizeMatMul (h quantized to uint8 per call, an
    integer GEMM: the faster for batches); kind "nbits": com.microsoft.MatMulNBits with 8 bits
    and one block per row (q + 128 as uint8, accuracy level 4: int8 compute; the faster for one
    or a few inputs, the decode-time kernel of language models)."""
    from onnx import TensorProto, helper, numpy_helper

    c = q.shape[0]
    if kind == "dynamic":
        node = helper.make_node("DynamicQuantizeMatMul", ["h", "q", "scale", "zero", "bias"], ["z"], domain="com.microsoft")
        inits = [numpy_helper.from_array(np.ascontiguousarray(q.T), "q"), numpy_helper.from_array(scale, "scale"),
                 numpy_helper.from_array(np.zeros(c, np.int8), "zero"), numpy_helper.from_array(bias, "bias")]
    else:
        node = helper.make_node("MatMulNBits", ["h", "q", "scale", "", "", "bias"], ["z"], domain="com.microsoft",
                                K=embed_dim, N=c, bits=8, block_size=embed_dim, accuracy_level=4)
        blob = (q.astype(np.int16) + 128).astype(np.uint8).reshape(c, 1, embed_dim)  # [N, blocks, bytes]
        inits = [numpy_helper.from_array(blob, "q"), numpy_helper.from_array(scale, "scale"),
                 numpy_helper.from_array(bias, "bias")]
    graph = helper.make_graph(
        [node], f"int8_head_chunk_{kind}", [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["M", embed_dim])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["M", c])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model.SerializeToString()


@functools.lru_cache(maxsize=1)
def dynamic_kernel_exact() -> bool:
    """Whether this processor's DynamicQuantizeMatMul adds its uint8 x int8 products without saturating.
    On x86 without VNNI onnxruntime's kernel sums pairs of products in int16 (vpmaddubsw), which
    saturates for full-range int8 rows (255·127·2 > 32767): logits off by 10× the quantization bound
    were measured on such a processor (AMD EPYC, AVX2 only). Measured once, on the worst case."""
    import onnxruntime as ort

    from serving.bundle.session import ort_session_options

    d, c = 64, 4
    q = np.full((c, d), 127, np.int8)
    q[1::2] = -127
    scale, bias = np.full(c, 1.0 / 127, np.float32), np.zeros(c, np.float32)
    session = ort.InferenceSession(_int8_graph(d, q, scale, bias, "dynamic"),
                                   sess_options=ort_session_options(threads=1, spin=False, arena=False),
                                   providers=["CPUExecutionProvider"])
    h = np.ones((2, d), np.float32)
    z = session.run(None, {"h": h})[0]  # [2, c]
    return bool(np.allclose(z, h @ (scale[:, None] * q).T, rtol=1e-2, atol=1e-2))


class Int8Head:
    """head_scan.ChunkGemm over chunks of `rows` classes of an int8 head (q [D, d] int8, scale [D],
    bias [D] float32); start must be a multiple of `rows`. Each chunk has two one-thread sessions,
    MatMulNBits for up to NBITS_MAX_BATCH inputs and DynamicQuantizeMatMul above; onnxruntime keeps
    each kernel's rows and its packed copy, about 2 bytes per weight a kernel, so a head above
    TWO_KERNELS_MAX_VALUES weights gets MatMulNBits alone (batches then run slower than they could), and
    so does a processor whose DynamicQuantizeMatMul saturates (dynamic_kernel_exact)."""

    def __init__(self, q: np.ndarray, scale: np.ndarray, bias: np.ndarray, rows: int):
        import onnxruntime as ort

        from serving.bundle.session import ort_session_options

        self.rows = int(rows)
        self.num_classes, self.embed_dim = q.shape
        big = self.num_classes * self.embed_dim > TWO_KERNELS_MAX_VALUES
        # onnxruntime keeps each kernel its rows and packed copy; the batch kernel only where it adds exactly
        self.kernels = ("nbits",) if big or not dynamic_kernel_exact() else ("nbits", "dynamic")
        self._sessions: list[dict[str, object]] = []
        for start in range(0, self.num_classes, self.rows):
            stop = min(start + self.rows, self.num_classes)
            rows_q = np.asarray(q[start:stop])
            parts = (np.asarray(scale[start:stop], dtype=np.float32), np.asarray(bias[start:stop], dtype=np.float32))
            chunk = {}
            for kind in self.kernels:
                opts = ort_session_options(threads=1, spin=False, arena=False)
                chunk[kind] = ort.InferenceSession(_int8_graph(self.embed_dim, rows_q, *parts, kind), sess_options=opts,
                                                   providers=["CPUExecutionProvider"])
            self._sessions.append(chunk)

    def __call__(self, h: np.ndarray, start: int, stop: int, out: np.ndarray) -> np.ndarray:
        k, rest = divmod(start, self.rows)
        if rest or stop - start != min(self.rows, self.num_classes - start):
            raise ValueError(f"classes {start}..{stop}: not one of this head's chunks of {self.rows}")
        kernel = "nbits" if len(h) <= NBITS_MAX_BATCH or len(self.kernels) == 1 else "dynamic"
        return run_into(self._sessions[k][kernel], h, out)


class Bf16Head:
    """head_scan.ChunkGemm over any chunk of a bfloat16 head (bits [D, d] uint16, bias [D])."""

    def __init__(self, bits: np.ndarray, bias: np.ndarray):
        self.bits, self.bias = bits, np.asarray(bias, dtype=np.float32)
        self.num_classes, self.embed_dim = bits.shape
        self._local = threading.local()  # a widening buffer per thread

    def _widened(self, start: int, stop: int) -> np.ndarray:
        n = (stop - start) * self.embed_dim
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.size < n:
            buf = self._local.buf = np.empty(n, dtype=np.uint32)
        wide = buf[:n].reshape(stop - start, self.embed_dim)  # [C, d]
        np.left_shift(self.bits[start:stop], 16, out=wide, dtype=np.uint32)
        return wide.view(np.float32)

    def __call__(self, h: np.ndarray, start: int, stop: int, out: np.ndarray) -> np.ndarray:
        np.matmul(np.asarray(h, dtype=np.float32), self._widened(start, stop).T, out=out)
        out += self.bias[start:stop]
        return out
