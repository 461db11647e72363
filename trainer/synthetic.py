"""Random-weight bundles for scale work (`slc bundle synthetic`), written without torch.

The graphs are built with `onnx.helper`; the class rows are streamed to head_weight.npy in
chunks (hashed on the way), and full.onnx / single.onnx do not copy them: their W and b
initializers are ONNX external data pointing *into* head_weight.npy / head_bias.npy (offset
= the .npy header, which is padded to 4096 bytes so the data start is page aligned). For
D = 1,000,000 and d = 256 the bundle holds the 1 GB of rows once on disk, never twice in RAM.

Backbone: x [N, input_dim] -> Gemm(128) -> ReLU -> Gemm(d) -> L2 normalise -> embedding [N, d]
(weights He-initialised from `seed`; no input normalisation: inputs are meant to be N(0, 1)).
Head rows (unit norm on average), b_j ~ N(0, 0.1^2). `rows="clustered"` (default): W_j = (c_k + 0.5 g_j)
/ sqrt(1.25 d) with c_k one of min(D, 1000) Gaussian centres and g_j ~ N(0, I_d) -- trained class
rows share directions (similar classes), and an approximate top-k index relies on that.
`rows="gaussian"`: W_j ~ N(0, I_d / d), i.i.d. rows, nearly orthogonal in 256 dimensions:
the worst case for any approximate inner-product index (it falls back to exact search).

Thresholds ("calibration" without labels): per class j, the 99.9th percentile of z_j(x) over
random inputs x ~ N(0, I). Rather than a D x N logit matrix, use the row structure:
z_j = W_j . h + b_j with h the embedding, so over inputs z_j has mean W_j . mu + b_j and
variance W_j S W_j^T (mu, S: mean and covariance of h over `PROBE` random inputs). A sum of d
weighted coordinates is close to Gaussian, so threshold_j = mean_j + Phi^-1(0.999) * sd_j.
Platt (a_j, b_j) = (1 / sd_j, -threshold_j / sd_j): probability 0.5 at the threshold.
The global threshold is the median of the per-class ones.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from serving.bundle import FORMAT, FORMAT_VERSION, write_manifest

OPSET = 17
IR_VERSION = 8
HIDDEN = 128
PROBE = 4096  # random inputs used for the embedding mean / covariance
QUANTILE = 0.999
Z_QUANTILE = 3.090232306167813  # Phi^-1(0.999)
ROW_CHUNK = 65536
NPY_ALIGN = 4096
N_SAMPLES = 8
MAX_SAMPLE_COLUMNS = 4096
N_CENTRES = 1000  # directions shared by class rows when rows="clustered"


# ---------------------------------------------------------------- .npy written as a stream


def npy_header(shape: tuple[int, ...], dtype=np.float32, align: int = NPY_ALIGN) -> bytes:
    """A version 1.0 .npy header padded so the data starts at a multiple of `align`.

    np.load accepts any header length that ends in a newline; the padding is spaces.
    """
    descr = np.lib.format.dtype_to_descr(np.dtype(dtype))
    text = "{'descr': %r, 'fortran_order': False, 'shape': %r, }" % (descr, tuple(int(s) for s in shape))
    prefix = 10  # magic (6) + version (2) + uint16 header length (2)
    total = -(-(prefix + len(text) + 1) // align) * align
    if total - prefix > 0xFFFF:
        raise ValueError("npy header too long for format 1.0")
    body = text + " " * (total - prefix - len(text) - 1) + "\n"
    return b"\x93NUMPY\x01\x00" + (total - prefix).to_bytes(2, "little") + body.encode("latin1")


class NpyStream:
    """Append rows of a C-order float32 array to a .npy file while hashing it."""

    def __init__(self, path: Path, shape: tuple[int, ...]):
        self.path, self.shape = Path(path), tuple(shape)
        self.header = npy_header(self.shape)
        self._f = open(self.path, "wb")
        self._hash = hashlib.sha256(self.header)
        self._f.write(self.header)
        self._rows = 0

    @property
    def offset(self) -> int:
        return len(self.header)

    def write(self, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        if rows.shape[1:] != self.shape[1:]:
            raise ValueError(f"rows {rows.shape} do not fit {self.shape}")
        data = rows.data.cast("B")  # no copy
        self._f.write(data)
        self._hash.update(data)
        self._rows += rows.shape[0]

    def close(self) -> tuple[str, int]:
        self._f.close()
        if self._rows != self.shape[0]:
            raise ValueError(f"{self.path.name}: wrote {self._rows} rows, expected {self.shape[0]}")
        return self._hash.hexdigest(), self.path.stat().st_size


# ---------------------------------------------------------------- graph pieces


def external_tensor(name: str, shape: tuple[int, ...], location: str, offset: int, dtype=TensorProto.FLOAT) -> TensorProto:
    """An initializer whose data lives in `location` (relative to the graph) at `offset`."""
    t = TensorProto()
    t.name = name
    t.data_type = dtype
    t.dims.extend(int(s) for s in shape)
    t.data_location = TensorProto.EXTERNAL
    length = int(np.prod(shape)) * np.dtype(helper.tensor_dtype_to_np_dtype(dtype)).itemsize
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        e = t.external_data.add()
        e.key, e.value = k, v
    return t


def backbone_nodes(params: dict[str, np.ndarray]) -> tuple[list, list]:
    """Nodes input -> embedding and their (inline) initializers."""
    nodes = [
        helper.make_node("Gemm", ["input", "bb_w1", "bb_b1"], ["bb_h1"], transB=1),
        helper.make_node("Relu", ["bb_h1"], ["bb_a1"]),
        helper.make_node("Gemm", ["bb_a1", "bb_w2", "bb_b2"], ["bb_h2"], transB=1),
        helper.make_node("LpNormalization", ["bb_h2"], ["embedding"], axis=1, p=2),
    ]
    inits = [numpy_helper.from_array(v, name=k) for k, v in params.items()]
    return nodes, inits


def backbone_numpy(params: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """The same backbone in float64 numpy (the reference the samples are checked against)."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    h = np.maximum(x @ p["bb_w1"].T + p["bb_b1"], 0.0)
    h = h @ p["bb_w2"].T + p["bb_b2"]
    return h / np.maximum(np.linalg.norm(h, axis=1, keepdims=True), 1e-12)


def _model(nodes, inits, inputs, outputs, name: str) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="slc-synthetic")
    model.ir_version = IR_VERSION
    return model


def write_graphs(out: Path, params: dict[str, np.ndarray], input_dim: int, d: int, D: int,
                 weight_offset: int, bias_offset: int) -> None:
    """backbone.onnx, full.onnx, single.onnx; W and b of the last two are external data in the .npy files."""
    x_in = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", input_dim])
    emb_out = helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["N", d])
    nodes, inits = backbone_nodes(params)
    onnx.save_model(_model(nodes, inits, [x_in], [emb_out], "backbone"), out / "backbone.onnx")

    W = external_tensor("head_weight", (D, d), "head_weight.npy", weight_offset)
    b = external_tensor("head_bias", (D,), "head_bias.npy", bias_offset)
    full_nodes = nodes + [helper.make_node("Gemm", ["embedding", "head_weight", "head_bias"], ["logits"], transB=1)]
    logits_out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", D])
    onnx.save_model(_model(full_nodes, inits + [W, b], [x_in], [logits_out], "full"), out / "full.onnx")

    cid_in = helper.make_tensor_value_info("class_id", TensorProto.INT64, ["N"])
    axes = numpy_helper.from_array(np.array([1], dtype=np.int64), name="sum_axes")
    single_nodes = nodes + [
        helper.make_node("Gather", ["head_weight", "class_id"], ["rows"], axis=0),  # [N, d]
        helper.make_node("Gather", ["head_bias", "class_id"], ["row_bias"], axis=0),  # [N]
        helper.make_node("Mul", ["embedding", "rows"], ["prod"]),  # [N, d]
        helper.make_node("ReduceSum", ["prod", "sum_axes"], ["dot"], keepdims=0),  # [N]
        helper.make_node("Add", ["dot", "row_bias"], ["logit"]),
    ]
    logit_out = helper.make_tensor_value_info("logit", TensorProto.FLOAT, ["N"])
    onnx.save_model(_model(single_nodes, inits + [W, b, axes], [x_in, cid_in], [logit_out], "single"), out / "single.onnx")


# ---------------------------------------------------------------- the bundle


def build_synthetic_bundle(classes: int, dim: int, input_dim: int = 64, seed: int = 0, out: Path | str = "bundle",
                           rows: str = "clustered") -> Path:
    """Write a verifiable bundle with a random backbone and `classes` random rows of size `dim`."""
    D, d = int(classes), int(dim)
    if rows not in ("clustered", "gaussian"):
        raise ValueError(f"rows must be 'clustered' or 'gaussian', got {rows!r}")
    if D < 1 or d < 1 or input_dim < 1:
        raise ValueError("classes, dim and input_dim must be positive")
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    rng = np.random.default_rng(seed)

    params = {
        "bb_w1": (rng.standard_normal((HIDDEN, input_dim)) * math.sqrt(2.0 / input_dim)).astype(np.float32),
        "bb_b1": np.zeros(HIDDEN, dtype=np.float32),
        "bb_w2": (rng.standard_normal((d, HIDDEN)) * math.sqrt(2.0 / HIDDEN)).astype(np.float32),
        "bb_b2": (0.1 * rng.standard_normal(d)).astype(np.float32),
    }
    probe = backbone_numpy(params, rng.standard_normal((PROBE, input_dim)))  # [P, d]
    mu = probe.mean(axis=0)  # [d]
    cov = np.cov(probe, rowvar=False).reshape(d, d)  # [d, d]

    x_samples = rng.standard_normal((N_SAMPLES, input_dim)).astype(np.float32)
    h_samples = backbone_numpy(params, x_samples.astype(np.float64))  # [n, d]
    sample_cid = rng.integers(0, D, N_SAMPLES)
    sample_cid[0], sample_cid[-1] = 0, D - 1
    if D <= MAX_SAMPLE_COLUMNS:
        columns = np.arange(D)
    else:
        columns = np.unique(np.concatenate([[0, D - 1], rng.choice(D, MAX_SAMPLE_COLUMNS - 2, replace=False)]))

    bias = (0.1 * rng.standard_normal(D)).astype(np.float32)  # [D], 4 MB at 1M
    threshold = np.empty(D, dtype=np.float64)
    sd = np.empty(D, dtype=np.float64)
    sample_logits = np.empty((N_SAMPLES, len(columns)))
    sample_single = np.empty(N_SAMPLES)

    centres = rng.standard_normal((min(D, N_CENTRES), d), dtype=np.float32)  # [K, d]
    weight_stream = NpyStream(out / "head_weight.npy", (D, d))
    for start in range(0, D, ROW_CHUNK):
        stop = min(D, start + ROW_CHUNK)
        noise = rng.standard_normal((stop - start, d), dtype=np.float32)  # [c, d]
        if rows == "clustered":
            chunk = (centres[rng.integers(0, len(centres), stop - start)] + 0.5 * noise) / np.float32(math.sqrt(1.25 * d))
        else:
            chunk = noise / np.float32(math.sqrt(d))
        weight_stream.write(chunk)
        rows64 = chunk.astype(np.float64)
        mean_j = rows64 @ mu + bias[start:stop]  # [c]
        var_j = np.einsum("cd,cd->c", rows64 @ cov, rows64)  # [c]: W_j S W_j^T
        sd[start:stop] = np.sqrt(np.maximum(var_j, 1e-12))
        threshold[start:stop] = mean_j + Z_QUANTILE * sd[start:stop]
        # expected sample outputs for the columns / class ids that fall in this chunk
        in_chunk = (columns >= start) & (columns < stop)
        sample_logits[:, in_chunk] = h_samples @ rows64[columns[in_chunk] - start].T + bias[columns[in_chunk]]
        hit = (sample_cid >= start) & (sample_cid < stop)
        sample_single[hit] = (h_samples[hit] * rows64[sample_cid[hit] - start]).sum(axis=1) + bias[sample_cid[hit]]
        del noise, chunk, rows64
    known = {"head_weight.npy": weight_stream.close()}
    bias_stream = NpyStream(out / "head_bias.npy", (D,))
    bias_stream.write(bias)
    known["head_bias.npy"] = bias_stream.close()

    write_graphs(out, params, input_dim, d, D, weight_stream.offset, bias_stream.offset)
    np.savez(out / "samples.npz", input=x_samples, embedding=h_samples.astype(np.float32),
             logits=sample_logits.astype(np.float32), logit_columns=columns.astype(np.int64),
             class_id=sample_cid.astype(np.int64), logit=sample_single.astype(np.float32))
    _write_calibration(out / "calibration.json", threshold, sd)

    name = f"synthetic-D{D}-d{d}-s{seed}"
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "name": name,
        "version": "1",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "input": {"shape": [int(input_dim)], "dtype": "float32"},
        "embed_dim": d,
        "num_classes": D,
        "classes": [str(j) for j in range(D)],
        "loss": {"name": "none", "params": {}, "pols": False},
        "backbone": {"name": "synthetic_mlp", "params": {"input_dim": int(input_dim), "hidden": HIDDEN, "normalize": "l2"}},
        "training": {"synthetic": True, "seed": int(seed), "rows": rows},
        "test_metrics": None,
        "external_data": {"full.onnx": ["head_weight.npy", "head_bias.npy"], "single.onnx": ["head_weight.npy", "head_bias.npy"]},
    }
    write_manifest(out, manifest, known_hashes=known)
    return out


def _write_calibration(path: Path, threshold: np.ndarray, sd: np.ndarray) -> None:
    """calibration.json streamed line by line (a million dicts would cost ~1 GB of Python objects)."""
    a = 1.0 / sd
    b = -threshold / sd
    head = {
        "target": {"quantile": QUANTILE},
        "decision": "match = logit >= threshold",
        "probability": "sigmoid(a * logit + b)",
        "split": "synthetic",
        "rule": (f"per class: mean + {Z_QUANTILE:.4f} * sd of the logit over random N(0, I) inputs, "
                 f"from the embedding mean and covariance ({PROBE} probes); Platt a = 1/sd, b = -threshold/sd"),
        "global": {"threshold": float(np.median(threshold))},
    }
    text = json.dumps(head, allow_nan=False)[:-1]  # reopen the object
    with open(path, "w") as f:
        f.write(text + ', "per_class": [\n')
        for start in range(0, len(threshold), ROW_CHUNK):
            stop = min(len(threshold), start + ROW_CHUNK)
            lines = [
                '{"class_id": %d, "threshold": %s, "platt": {"a": %s, "b": %s}}' % (j, repr(float(threshold[j])), repr(float(a[j])), repr(float(b[j])))
                for j in range(start, stop)
            ]
            f.write(",\n".join(lines))
            f.write(",\n" if stop < len(threshold) else "\n")
        f.write("]}\n")
