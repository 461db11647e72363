"""The head's rows as pre-packed onnxruntime GEMMs, one one-thread session per class chunk.

onnxruntime packs a Gemm's constant weight once, at session creation, into the layout its
kernel reads (MLAS); a weight passed as an input is packed again on every call. For a head that
fits twice in memory (D x d <= engine.ONNX_HEAD_MAX_VALUES, as full.onnx) the chunks are packed
once and two threads take them in turn (head_scan.scan_two): full.onnx's pre-packed speed, and
ort_pair's tolerance of a thread the event loop preempts.

Each chunk session gets its rows through `SessionOptions.add_initializer` as an OrtValue over the
memory-mapped head: onnxruntime reads them to pack and keeps no copy of its own (the packed copy
is the only extra memory, as for full.onnx).
"""
from __future__ import annotations

import numpy as np


def _chunk_graph(embed_dim: int, classes: int) -> bytes:
    """z [M, classes] = h @ w.T + b with w, b initializers the session options replace (the graph
    carries one-row placeholders, so building it costs nothing whatever the chunk; the output's
    declared shape, not the placeholders', is what onnxruntime checks a bound output against)."""
    from onnx import TensorProto, helper

    node = helper.make_node("Gemm", ["h", "w", "b"], ["z"], transB=1)
    graph = helper.make_graph(
        [node], "packed_head_chunk",
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["M", embed_dim])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["M", classes])],
        initializer=[helper.make_tensor("w", TensorProto.FLOAT, (1, embed_dim), np.zeros(embed_dim, np.float32)),
                     helper.make_tensor("b", TensorProto.FLOAT, (1,), np.zeros(1, np.float32))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


class PackedHead:
    """head_scan.ChunkGemm over chunks of `rows` classes, each a one-thread session holding its
    rows pre-packed. Call with (h [M, d], start, stop, out [M, stop - start]); start must be a
    multiple of `rows` (scan_two with the same rows). Two threads may run two chunks at once."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray, rows: int):
        import onnxruntime as ort

        from serving.bundle.session import ort_session_options

        self.rows = int(rows)
        self.num_classes, embed_dim = weight.shape
        models = {}  # chunk size -> graph (two at most: the last chunk may be shorter)
        self._sessions, self._values = [], []
        for start in range(0, self.num_classes, self.rows):
            w = np.ascontiguousarray(weight[start:start + self.rows])  # a view of the mapped head: no copy
            if len(w) not in models:
                models[len(w)] = _chunk_graph(embed_dim, len(w))
            b = np.ascontiguousarray(bias[start:start + self.rows], dtype=np.float32)
            values = (ort.OrtValue.ortvalue_from_numpy(w), ort.OrtValue.ortvalue_from_numpy(b))
            opts = ort_session_options(threads=1, spin=False, arena=False)
            opts.add_initializer("w", values[0])
            opts.add_initializer("b", values[1])
            self._sessions.append(ort.InferenceSession(models[len(w)], sess_options=opts, providers=["CPUExecutionProvider"]))
            self._values.append(values)  # the sessions read the rows through these: keep them alive

    def __call__(self, h: np.ndarray, start: int, stop: int, out: np.ndarray) -> np.ndarray:
        k, rest = divmod(start, self.rows)
        if rest or stop - start != min(self.rows, self.num_classes - start):
            raise ValueError(f"classes {start}..{stop}: not one of this head's chunks of {self.rows}")
        return run_into(self._sessions[k], h, out)


def run_into(session, h: np.ndarray, out: np.ndarray) -> np.ndarray:
    """A chunk session's z [M, C] for h [M, d], written straight into `out` (C-contiguous float32)."""
    io = session.io_binding()
    io.bind_cpu_input("h", np.ascontiguousarray(h, dtype=np.float32))
    io.bind_output("z", "cpu", 0, np.float32, list(out.shape), out.ctypes.data)
    session.run_with_iobinding(io)
    return out
