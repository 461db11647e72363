"""The head resident on the execution device: every pass over the D rows runs there, and only what
each request answers with comes back (issue 36; docs/configuration.md "The head on a GPU").

With `--device cuda` the rows are uploaded once, at load, as onnxruntime values on the GPU (float32,
or the bundle's bf16 head as float16, or its int8 head with per-class scales: `_gemm`), and three
small ONNX graphs built here read them through IO binding (no copy per call):

  softmax   h [M, d], w [D, d], b [D], j [M, 1] -> zj [M, 1], m [M, blocks, 1], s, arg [M, blocks]
  topk      h, w, b, k [1]                       -> values [M, K], ids [M, K], total [M]
  logits    h, w, b                              -> z [M, D]

so a top-k answer crosses back as 2k numbers per input, a softmax as 3 per block of the row (a
thousandth of the row), and the [M, D] logits only when a request asks for them. The reductions
over D are split in two stages over blocks of the row ([M, D] -> [M, blocks, width] -> [M, blocks]
-> [M]): onnxruntime's CUDA kernels for Softmax, TopK and the reductions give one thread block to a
row, which at batch 1 leaves all but one multiprocessor idle at D = 10^6; with blocks, a row is
spread over many. The softmax's second stage runs on the host (finish_softmax): on a GPU every
node of a graph costs more to launch at batch 1 than its work, and the stages over [M, blocks]
are a thousandth of the row (a profile of the device pass showed the launches dominate). The
row is padded to blocks x width with PAD, a finite logit far below any real one (exp(PAD - max) = 0; never in a top-k, since k <= D). TF32 is off
(`use_tf32=0`): a float32 GEMM in TF32 moves logits by about 1e-3 relative, enough to flip a
decision at a calibrated threshold.

The same graphs run on the CPU provider, which is how `make test` checks them against float64
numpy on any machine (SLC_SOFTMAX_IMPL=device); on the CPU the chunked passes of head_scan.py
remain the default (they never hold [M, D]).
"""
from __future__ import annotations

import logging
import math

import numpy as np

from serving.core import head_scan
from serving.core.device.backend import head_providers

log = logging.getLogger(__name__)

PAD = -3.0e38  # a padded column's logit: finite (so 0 * PAD is 0), below every real logit
BLOCK_WIDTH = 1024  # columns per block of the two-stage reductions (at least the largest k)
GROUP_VALUES = 1 << 27  # logits of one run: inputs are taken in groups of at most this many x D
OPSET = 17


def block_shape(num_classes: int, max_k: int) -> tuple[int, int]:
    """(blocks, width): the row of D logits as blocks x width >= D, width >= max_k (TopK's k per block)."""
    width = min(num_classes, max(BLOCK_WIDTH, 1 << max(0, math.ceil(math.log2(max(max_k, 1))))))
    return -(-num_classes // width), width


PRECISIONS = ("float32", "bf16", "int8")


def _graph(name: str, extra_inputs: list, outputs: list, nodes: list, d: int, initializers: list,
           precision: str = "float32") -> bytes:
    from onnx import helper

    graph = helper.make_graph(nodes, name, _head_inputs(d, precision) + extra_inputs, outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8  # readable by every onnxruntime the project supports
    return model.SerializeToString()


def _head_inputs(d: int, precision: str) -> list:
    """The graph inputs of the head and the input rows, by precision:
    float32  h [M, d] float, w [D, d] float
    bf16     h [M, d] float, w [D, d] float16 (the bf16 values, exactly, but below 6e-5: see _gemm)
    int8     hq [M, d] int8 and hs [M, 1] (h = hs * hq, per input), w [d, D] int8 (transposed), ws [D]
    and the float32 bias b [D]."""
    from onnx import TensorProto, helper

    vi = helper.make_tensor_value_info
    if precision == "int8":
        return [vi("hq", TensorProto.INT8, ["M", d]), vi("hs", TensorProto.FLOAT, ["M", 1]),
                vi("w", TensorProto.INT8, [d, "D"]), vi("ws", TensorProto.FLOAT, ["D"]), vi("b", TensorProto.FLOAT, ["D"])]
    wtype = TensorProto.FLOAT16 if precision == "bf16" else TensorProto.FLOAT
    return [vi("h", TensorProto.FLOAT, ["M", d]), vi("w", wtype, ["D", d]), vi("b", TensorProto.FLOAT, ["D"])]


def _gemm(precision: str) -> list:
    """Nodes of z [M, D] float = the logits of the rows, by precision. float32: one Gemm. bf16: the
    head is uploaded as float16 (every bf16 value of magnitude >= 6.1e-5 is exact in float16: 8 bits
    of mantissa in 11), h is cast to float16 and the GEMM accumulates in float32 (cuBLAS), its
    output rounded to float16 (about 5e-4 relative) before the float32 bias. int8: an integer GEMM
    (int32 sums), then the per-input and per-class scales."""
    from onnx import TensorProto, helper

    if precision == "float32":
        return [helper.make_node("Gemm", ["h", "w", "b"], ["z"], transB=1)]
    if precision == "bf16":
        return [helper.make_node("Cast", ["h"], ["h16"], to=TensorProto.FLOAT16),
                helper.make_node("Gemm", ["h16", "w"], ["z16"], transB=1),  # [M, D] float16
                helper.make_node("Cast", ["z16"], ["zf"], to=TensorProto.FLOAT),
                helper.make_node("Add", ["zf", "b"], ["z"])]
    if precision == "int8":
        return [helper.make_node("MatMulInteger", ["hq", "w"], ["zi"]),  # [M, D] int32
                helper.make_node("Cast", ["zi"], ["zf"], to=TensorProto.FLOAT),
                helper.make_node("Mul", ["zf", "hs"], ["zh"]),  # x the input's scale [M, 1]
                helper.make_node("Mul", ["zh", "ws"], ["zw"]),  # x the class's scale [D]
                helper.make_node("Add", ["zw", "b"], ["z"])]
    raise ValueError(f"device head precision {precision!r}: one of {', '.join(PRECISIONS)}")


def _blocks(num_classes: int, blocks: int, width: int, precision: str = "float32") -> tuple[list, list]:
    """(nodes, initializers): z = h w^T + b [M, D] and z3 [M, blocks, width], padded with PAD."""
    from onnx import TensorProto, helper

    pad = blocks * width - num_classes
    inits = [helper.make_tensor("pads", TensorProto.INT64, [4], [0, 0, 0, pad]),
             helper.make_tensor("pad_value", TensorProto.FLOAT, [], [PAD]),
             helper.make_tensor("shape3", TensorProto.INT64, [3], [-1, blocks, width])]
    nodes = _gemm(precision) + [
        helper.make_node("Pad", ["z", "pads", "pad_value"], ["zp"], mode="constant"),
        helper.make_node("Reshape", ["zp", "shape3"], ["z3"])]
    return nodes, inits


def softmax_graph(num_classes: int, d: int, blocks: int, width: int, precision: str = "float32") -> bytes:
    """Stage 1 of the softmax statistics, per block: m [M, blocks, 1] (the block's max), s [M, blocks]
    (its sum of exp(z - m)), arg [M, blocks] (where its max is, the first of equals), and zj [M, 1] (the
    logit of each row's class j). Nine nodes: at batch 1 a node's launch costs more than its work, so
    stage 2, over the blocks, is finished on the host (finish_softmax), from 3 x blocks numbers a row."""
    from onnx import TensorProto, helper

    nodes, inits = _blocks(num_classes, blocks, width, precision)
    inits.append(helper.make_tensor("axis2", TensorProto.INT64, [1], [2]))
    nodes += [
        helper.make_node("GatherElements", ["z", "j"], ["zj"], axis=1),  # [M, 1]
        helper.make_node("ReduceMax", ["z3"], ["m"], axes=[2], keepdims=1),  # [M, blocks, 1]
        helper.make_node("Sub", ["z3", "m"], ["zc"]),
        helper.make_node("Exp", ["zc"], ["ez"]),
        helper.make_node("ReduceSum", ["ez", "axis2"], ["s"], keepdims=0),  # [M, blocks]
        helper.make_node("ArgMax", ["z3"], ["arg"], axis=2, keepdims=0),  # [M, blocks]
    ]
    outputs = [helper.make_tensor_value_info("zj", TensorProto.FLOAT, ["M", 1]),
               helper.make_tensor_value_info("m", TensorProto.FLOAT, ["M", blocks, 1]),
               helper.make_tensor_value_info("s", TensorProto.FLOAT, ["M", blocks]),
               helper.make_tensor_value_info("arg", TensorProto.INT64, ["M", blocks])]
    j = helper.make_tensor_value_info("j", TensorProto.INT64, ["M", 1])
    return _graph("device_softmax", [j], outputs, nodes, d, inits, precision)


def finish_softmax(m: np.ndarray, s: np.ndarray, arg: np.ndarray, width: int) -> tuple[np.ndarray, ...]:
    """Stage 2 over the blocks: (lse [M], top [M] (ties to the smaller id), zmax [M], finite [M]), the sum
    of the blocks' sums in float64. Each block's weight exp(m - zmax) is taken in float32 (in (0, 1],
    about 1e-7 relative): numpy's float64 exp is ten times slower, a millisecond at 64 x 977 blocks.
    A NaN in a row makes its block's s NaN, a +inf its block's m inf (or s NaN): either is not finite."""
    m = m.reshape(m.shape[0], -1)  # [M, blocks] float32
    finite = np.isfinite(m).all(axis=1) & np.isfinite(s).all(axis=1)
    best = m.argmax(axis=1)  # [M]: the first block of the top logit (the smaller ids)
    rows = np.arange(len(m))
    zmax = m[rows, best]
    with np.errstate(invalid="ignore", over="ignore"):
        weight = np.exp(m - zmax[:, None])  # [M, blocks] float32
        total = (s.astype(np.float64) * weight).sum(axis=1)  # (einsum here is several times slower)
        lse = zmax.astype(np.float64) + np.log(total)
    return lse, best * width + arg[rows, best], zmax.astype(np.float64), finite


def topk_graph(num_classes: int, d: int, blocks: int, width: int, precision: str = "float32") -> bytes:
    """values [M, k], ids [M, k] (best first, equal values by the smaller id), total [M] (the row's sum:
    not finite when a logit is not): the k best of each block, then the k best of those (sort-free in the
    sense that no row is sorted whole)."""
    from onnx import TensorProto, helper

    nodes, inits = _blocks(num_classes, blocks, width, precision)
    inits += [helper.make_tensor("axis1", TensorProto.INT64, [1], [1]),
              helper.make_tensor("offsets", TensorProto.INT64, [1, blocks, 1], list(range(0, blocks * width, width))),
              helper.make_tensor("flat", TensorProto.INT64, [2], [0, -1])]
    nodes += [
        helper.make_node("ReduceSum", ["z", "axis1"], ["total"], keepdims=0),  # [M]
        helper.make_node("TopK", ["z3", "k"], ["v3", "i3"], axis=2),  # [M, blocks, k]
        helper.make_node("Add", ["i3", "offsets"], ["g3"]),  # ids in the row
        helper.make_node("Reshape", ["v3", "flat"], ["vf"]),  # [M, blocks * k]: block by block
        helper.make_node("Reshape", ["g3", "flat"], ["gf"]),
        helper.make_node("TopK", ["vf", "k"], ["values", "pos"], axis=1),  # ties: the lower position
        helper.make_node("GatherElements", ["gf", "pos"], ["ids"], axis=1),
    ]
    outputs = [helper.make_tensor_value_info("values", TensorProto.FLOAT, ["M", "K"]),
               helper.make_tensor_value_info("ids", TensorProto.INT64, ["M", "K"]),
               helper.make_tensor_value_info("total", TensorProto.FLOAT, ["M"])]
    k = helper.make_tensor_value_info("k", TensorProto.INT64, [1])
    return _graph("device_topk", [k], outputs, nodes, d, inits, precision)


def logits_graph(d: int, precision: str = "float32") -> bytes:
    """z [M, D]: for the requests that answer with every logit."""
    from onnx import TensorProto, helper

    outputs = [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["M", "D"])]
    return _graph("device_logits", [], outputs, _gemm(precision), d, [], precision)


def resident_bytes(num_classes: int, embed_dim: int, precision: str = "float32") -> int:
    """Bytes of a device head's rows, bias (and int8 scales)."""
    per_weight = {"float32": 4, "bf16": 2, "int8": 1}[precision]
    return num_classes * (per_weight * embed_dim + 4 + (4 if precision == "int8" else 0))


def device_rows(weight: np.ndarray, precision: str, chunk: int = 1 << 16) -> np.ndarray:
    """The rows as the device graphs read them: float32 [D, d]; bf16 bits [D, d] as float16 (widened
    and narrowed a chunk of rows at a time: never a float32 copy of the whole head); int8 [d, D]."""
    if precision == "float32":
        return np.ascontiguousarray(weight, dtype=np.float32)
    if precision == "int8":
        return np.ascontiguousarray(np.asarray(weight, dtype=np.int8).T)
    out = np.empty(weight.shape, np.float16)
    for start in range(0, len(weight), chunk):
        wide = (np.asarray(weight[start:start + chunk], dtype=np.uint32) << 16).view(np.float32)
        if np.abs(wide).max(initial=0.0) > np.finfo(np.float16).max:
            raise ValueError("a bf16 weight is beyond float16's range (65504): this head cannot run on the device "
                             "in bf16; use float32 or int8")
        out[start:start + chunk] = wide
    return out


def input_rows(h: np.ndarray, precision: str) -> dict[str, np.ndarray]:
    """The graph inputs of the rows h [M, d]: h itself, or for int8 hq [M, d] int8 and hs [M, 1], each
    row scaled by its largest magnitude (symmetric, per input: h ≈ hs * hq). A row that is not finite
    gets a scale that is not either, so its logits are flagged as they are in float32."""
    h = np.ascontiguousarray(h, dtype=np.float32)
    if precision != "int8":
        return {"h": h}
    top = np.abs(h).max(axis=1, keepdims=True)  # [M, 1]
    hs = np.where(top == 0, 1.0, top / 127.0).astype(np.float32)  # NaN and inf stay
    with np.errstate(invalid="ignore", divide="ignore"):
        hq = np.nan_to_num(np.rint(h / hs), nan=0.0, posinf=0.0, neginf=0.0).astype(np.int8)
    return {"hq": hq, "hs": hs}


class DeviceHead:
    """The head on `device` (cuda or cpu) and the three pass graphs over it. `run(h, parts)` finishes
    every accumulator of `parts` (head_scan's SoftmaxStats, TopK, AllLogits) from one run per kind over
    its rows; nothing of size D comes back but the logits a request asked for. `precision` says which
    rows `weight` holds: float32, bf16 (uint16 bits) or int8 (with the per-class `scale`); the
    engine re-scores a quantized head's top-k and asked logit on the float32 rows (head_pass.py)."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray, device: str = "cpu", device_id: int = 0,
                 max_k: int = 1, threads: int = 1, precision: str = "float32", scale: np.ndarray | None = None):
        import onnxruntime as ort

        from serving.bundle.session import ort_session_options

        self.num_classes, self.embed_dim = int(weight.shape[0]), int(weight.shape[1])
        self.device, self.device_id, self.precision = device, device_id, precision
        self.blocks, self.width = block_shape(self.num_classes, max_k)
        where = "cuda" if device == "cuda" else "cpu"

        def value(array: np.ndarray):  # once, on the device, bound to every run (no copy per call)
            return ort.OrtValue.ortvalue_from_numpy(array, where, device_id)

        self.values = {"w": value(device_rows(weight, precision)),
                       "b": value(np.ascontiguousarray(bias, dtype=np.float32))}
        if precision == "int8":
            self.values["ws"] = value(np.ascontiguousarray(scale, dtype=np.float32))
        providers = head_providers(device, device_id)
        opts = ort_session_options(threads, spin=False, arena=device == "cuda")

        def session(model: bytes):
            return ort.InferenceSession(model, sess_options=opts, providers=providers)

        d, D = self.embed_dim, self.num_classes
        self.sessions = {"softmax": session(softmax_graph(D, d, self.blocks, self.width, precision)),
                         "topk": session(topk_graph(D, d, self.blocks, self.width, precision)),
                         "logits": session(logits_graph(d, precision))}
        self.providers = list(self.sessions["softmax"].get_providers())
        if device == "cuda" and "CUDAExecutionProvider" not in self.providers:
            raise RuntimeError(f"the device head could not use CUDA (its sessions run on {self.providers})")

    @property
    def resident_bytes(self) -> int:
        return resident_bytes(self.num_classes, self.embed_dim, self.precision)

    def bind(self, sess, h: np.ndarray, extra: dict, where: str = "cpu"):
        """The IO binding of one graph over h [M, d], the head on the device and the extra inputs, every
        output left on `where`."""
        io = sess.io_binding()
        for name, array in input_rows(h, self.precision).items():
            io.bind_cpu_input(name, array)
        for name, ortvalue in self.values.items():
            io.bind_ortvalue_input(name, ortvalue)
        for name, array in extra.items():
            io.bind_cpu_input(name, array)
        for out in sess.get_outputs():
            io.bind_output(out.name, where)
        return io

    def _run(self, kind: str, h: np.ndarray, extra: dict) -> list[np.ndarray]:
        """One graph over h [M, d] (and its extra inputs), outputs back on the host."""
        sess = self.sessions[kind]
        io = self.bind(sess, h, extra)
        sess.run_with_iobinding(io)
        return io.copy_outputs_to_cpu()

    def _groups(self, m: int) -> list[slice]:
        """Rows taken together: at most GROUP_VALUES logits per run (the [rows, D] intermediate)."""
        rows = max(1, GROUP_VALUES // (self.blocks * self.width))
        return [slice(i, min(i + rows, m)) for i in range(0, m, rows)]

    def run(self, h: np.ndarray, parts: head_scan.Parts) -> None:
        by_kind: dict[type, list] = {}
        for sl, acc in parts:
            by_kind.setdefault(type(acc), []).append((sl, acc))
        for kind, group in by_kind.items():
            if kind is head_scan.SoftmaxStats:
                self._softmax(h, group)
            elif kind is head_scan.TopK:
                self._topk(h, group)
            elif kind is head_scan.AllLogits:
                self._logits(h, group)
            else:
                raise TypeError(f"no device pass for {kind.__name__}")

    @staticmethod
    def _rows(h: np.ndarray, group: list) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """h's rows of every part of the group, stacked, and where each part's rows landed."""
        spans, start = [], 0
        for sl, _ in group:
            n = len(range(*sl.indices(len(h))))
            spans.append((start, start + n))
            start += n
        return np.concatenate([h[sl] for sl, _ in group]), spans

    def _softmax(self, h: np.ndarray, group: list) -> None:
        rows, spans = self._rows(h, group)
        j = np.concatenate([np.broadcast_to(np.asarray(acc.j, dtype=np.int64), (b - a,)) for (a, b), (_, acc)
                            in zip(spans, group)])
        j = np.where(j < self.num_classes, j, 0)[:, None]  # [M, 1]; an enrolled class: its logit comes with
        # the enrolled rows' chunk
        zj, lse, top = np.empty(len(rows)), np.empty(len(rows)), np.empty(len(rows), np.int64)
        zmax, finite = np.empty(len(rows)), np.empty(len(rows), bool)
        for g in self._groups(len(rows)):
            zj_g, m, s, arg = self._run("softmax", rows[g], {"j": j[g]})
            zj[g] = zj_g[:, 0]
            lse[g], top[g], zmax[g], finite[g] = finish_softmax(m, s, arg, self.width)
        for (a, b), (_, acc) in zip(spans, group):
            acc.m, acc.s = lse[a:b], np.ones(b - a)  # the normaliser: m + log(1)
            acc.zmax = zmax[a:b]
            acc.zj, acc.has_j, acc.top, acc.finite = zj[a:b], np.ones(b - a, bool), top[a:b], finite[a:b]

    def _topk(self, h: np.ndarray, group: list) -> None:
        rows, spans = self._rows(h, group)
        k = min(max(acc.k for _, acc in group), self.num_classes)
        values = np.empty((len(rows), k), np.float32)
        ids = np.empty((len(rows), k), np.int64)
        total = np.empty(len(rows), np.float32)
        for g in self._groups(len(rows)):
            values[g], ids[g], total[g] = self._run("topk", rows[g], {"k": np.array([k], np.int64)})
        finite = np.isfinite(total)
        for (a, b), (_, acc) in zip(spans, group):
            kk = min(acc.k, k)
            acc.scores, acc.ids, acc.finite = values[a:b, :kk].copy(), ids[a:b, :kk].copy(), finite[a:b]

    def _logits(self, h: np.ndarray, group: list) -> None:
        for sl, acc in group:
            part = h[sl]
            for g in self._groups(len(part)):  # the first D columns: enrolled classes' columns follow
                (acc.out[g, :self.num_classes],) = self._run("logits", part[g], {})
