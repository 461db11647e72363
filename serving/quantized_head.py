"""The passes over all D rows on a quantized head (SLC_HEAD_PRECISION; serving/bundle/quantize.py).

Both are head_scan ChunkGemms, run by head_scan.scan_two like the packed float32 head:

- `Int8Head`: one one-thread onnxruntime session per chunk of classes, each a
  com.microsoft.DynamicQuantizeMatMul (the input quantized to uint8 per call, the chunk's int8
  rows with their per-class scales as a constant that onnxruntime packs once for its integer
  GEMM): a quarter of float32's bytes read per request.
- `Bf16Head`: each chunk's bfloat16 rows widened to float32 in a buffer of the thread's, then one
  numpy GEMM: half the bytes read from memory, but a widening pass per chunk (neither numpy nor
  onnxruntime's CPU provider has a bfloat16 GEMM on x86).

What is approximate is only the ranking and the softmax normaliser: the engine re-scores the
final top-k (from a few more candidates) and the asked class's logit on the float32 rows
(head_scan.TopK.rescore, SoftmaxStats.rescore). The all-logits answer is the quantized logits.
"""
from __future__ import annotations

import threading

import numpy as np

MAX_CHUNKS = 512  # sessions per head at most: a 10⁷-class head gets chunks of ~20k classes
TOPK_EXTRA = 16  # a quantized top-k pass keeps k + this many candidates for the exact re-scoring


def int8_rows(num_classes: int, pair_rows: int) -> int:
    """Classes per chunk session: the pass's pair_rows, larger when that would make too many sessions."""
    return max(pair_rows, -(-num_classes // MAX_CHUNKS))


def _int8_graph(embed_dim: int, q_t: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> bytes:
    """z [M, C] = dequantize(quantize(h) @ q_t) * scale + bias; q_t [d, C] int8 (B of the op)."""
    from onnx import TensorProto, helper, numpy_helper

    c = q_t.shape[1]
    node = helper.make_node("DynamicQuantizeMatMul", ["h", "q", "scale", "zero", "bias"], ["z"], domain="com.microsoft")
    graph = helper.make_graph(
        [node], "int8_head_chunk",
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["M", embed_dim])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["M", c])],
        initializer=[numpy_helper.from_array(q_t, "q"), numpy_helper.from_array(scale, "scale"),
                     numpy_helper.from_array(np.zeros(c, np.int8), "zero"), numpy_helper.from_array(bias, "bias")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model.SerializeToString()


class Int8Head:
    """head_scan.ChunkGemm over chunks of `rows` classes of an int8 head (q [D, d] int8, scale [D],
    bias [D] float32), each a one-thread session; start must be a multiple of `rows`."""

    def __init__(self, q: np.ndarray, scale: np.ndarray, bias: np.ndarray, rows: int):
        import onnxruntime as ort

        from serving.bundle.session import ort_session_options

        self.rows = int(rows)
        self.num_classes, self.embed_dim = q.shape
        self._sessions = []
        for start in range(0, self.num_classes, self.rows):
            stop = min(start + self.rows, self.num_classes)
            graph = _int8_graph(self.embed_dim, np.ascontiguousarray(np.asarray(q[start:stop]).T),
                                np.asarray(scale[start:stop], dtype=np.float32), np.asarray(bias[start:stop], dtype=np.float32))
            opts = ort_session_options(threads=1, spin=False, arena=False)
            self._sessions.append(ort.InferenceSession(graph, sess_options=opts, providers=["CPUExecutionProvider"]))
            del graph  # onnxruntime holds the packed rows now

    def __call__(self, h: np.ndarray, start: int, stop: int, out: np.ndarray) -> np.ndarray:
        k, rest = divmod(start, self.rows)
        if rest or stop - start != min(self.rows, self.num_classes - start):
            raise ValueError(f"classes {start}..{stop}: not one of this head's chunks of {self.rows}")
        session = self._sessions[k]
        io = session.io_binding()
        io.bind_cpu_input("h", np.ascontiguousarray(h, dtype=np.float32))
        io.bind_output("z", "cpu", 0, np.float32, list(out.shape), out.ctypes.data)
        session.run_with_iobinding(io)
        return out


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
