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

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from serving.bundle.format import base_manifest, write_manifest
from serving.bundle.graphs import external_tensor
from serving.bundle.imagespec import check_image_spec
from serving.bundle.npy import NPY_ALIGN, NpyStream  # noqa: F401  (NPY_ALIGN: part of this module's contract)

OPSET = 17
IR_VERSION = 8
HIDDEN = 128
PROBE = 4096  # random inputs used for the embedding mean / covariance
QUANTILE = 0.999
Z_QUANTILE = 3.090232306167813  # Phi^-1(0.999)
ROW_CHUNK = 65536
N_SAMPLES = 8
MAX_SAMPLE_COLUMNS = 4096
N_CENTRES = 1000  # directions shared by class rows when rows="clustered"
ROW_KINDS = ("clustered", "gaussian")


# ---------------------------------------------------------------- graph pieces


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


@dataclass
class _Samples:
    """A few inputs whose expected outputs are filled in while the rows stream past."""

    x: np.ndarray  # [n, input_dim] float32
    h: np.ndarray  # [n, d] float64 embeddings
    class_id: np.ndarray  # [n] int64
    columns: np.ndarray  # [c] int64: logit columns stored for the full graph
    logits: np.ndarray  # [n, c]
    single: np.ndarray  # [n]

    def fill(self, start: int, rows64: np.ndarray, bias: np.ndarray) -> None:
        """Expected logits for the columns / class ids inside rows [start, start + len(rows64))."""
        stop = start + len(rows64)
        in_chunk = (self.columns >= start) & (self.columns < stop)
        cols = self.columns[in_chunk]
        self.logits[:, in_chunk] = self.h @ rows64[cols - start].T + bias[cols]
        hit = (self.class_id >= start) & (self.class_id < stop)
        self.single[hit] = (self.h[hit] * rows64[self.class_id[hit] - start]).sum(axis=1) + bias[self.class_id[hit]]

    def save(self, path: Path) -> None:
        np.savez(path, input=self.x, embedding=self.h.astype(np.float32), logits=self.logits.astype(np.float32),
                 logit_columns=self.columns.astype(np.int64), class_id=self.class_id.astype(np.int64),
                 logit=self.single.astype(np.float32))


def _backbone_params(rng: np.random.Generator, input_dim: int, d: int) -> dict[str, np.ndarray]:
    return {
        "bb_w1": (rng.standard_normal((HIDDEN, input_dim)) * math.sqrt(2.0 / input_dim)).astype(np.float32),
        "bb_b1": np.zeros(HIDDEN, dtype=np.float32),
        "bb_w2": (rng.standard_normal((d, HIDDEN)) * math.sqrt(2.0 / HIDDEN)).astype(np.float32),
        "bb_b2": (0.1 * rng.standard_normal(d)).astype(np.float32),
    }


def _plan_samples(rng: np.random.Generator, params: dict, input_dim: int, D: int) -> _Samples:
    x = rng.standard_normal((N_SAMPLES, input_dim)).astype(np.float32)
    cid = rng.integers(0, D, N_SAMPLES)
    cid[0], cid[-1] = 0, D - 1
    if D <= MAX_SAMPLE_COLUMNS:
        columns = np.arange(D)
    else:
        columns = np.unique(np.concatenate([[0, D - 1], rng.choice(D, MAX_SAMPLE_COLUMNS - 2, replace=False)]))
    return _Samples(x=x, h=backbone_numpy(params, x.astype(np.float64)), class_id=cid, columns=columns,
                    logits=np.empty((N_SAMPLES, len(columns))), single=np.empty(N_SAMPLES))


def _row_chunks(rng: np.random.Generator, D: int, d: int, rows: str):
    """Yield (start, rows [c, d] float32) of the head, ROW_CHUNK rows at a time."""
    centres = rng.standard_normal((min(D, N_CENTRES), d), dtype=np.float32)  # [K, d]
    for start in range(0, D, ROW_CHUNK):
        stop = min(D, start + ROW_CHUNK)
        noise = rng.standard_normal((stop - start, d), dtype=np.float32)  # [c, d]
        if rows == "clustered":
            yield start, (centres[rng.integers(0, len(centres), stop - start)] + 0.5 * noise) / np.float32(math.sqrt(1.25 * d))
        else:
            yield start, noise / np.float32(math.sqrt(d))


def _write_head(out: Path, rng: np.random.Generator, D: int, d: int, rows: str, probe: np.ndarray,
                samples: _Samples) -> tuple[dict, dict[str, int], np.ndarray, np.ndarray]:
    """Stream the rows and bias to .npy; per-class threshold and sd of the logit (module docstring).

    Returns (known hashes, data offsets, threshold [D], sd [D])."""
    mu, cov = probe.mean(axis=0), np.cov(probe, rowvar=False).reshape(d, d)  # [d], [d, d]
    bias = (0.1 * rng.standard_normal(D)).astype(np.float32)  # [D]
    threshold, sd = np.empty(D, dtype=np.float64), np.empty(D, dtype=np.float64)
    weight_stream = NpyStream(out / "head_weight.npy", (D, d))
    for start, chunk in _row_chunks(rng, D, d, rows):
        weight_stream.write(chunk)
        rows64 = chunk.astype(np.float64)
        stop = start + len(chunk)
        var_j = np.einsum("cd,cd->c", rows64 @ cov, rows64)  # [c]: W_j S W_j^T
        sd[start:stop] = np.sqrt(np.maximum(var_j, 1e-12))
        threshold[start:stop] = rows64 @ mu + bias[start:stop] + Z_QUANTILE * sd[start:stop]
        samples.fill(start, rows64, bias)
    known = {"head_weight.npy": weight_stream.close()}
    bias_stream = NpyStream(out / "head_bias.npy", (D,))
    bias_stream.write(bias)
    known["head_bias.npy"] = bias_stream.close()
    return known, {"weight": weight_stream.offset, "bias": bias_stream.offset}, threshold, sd


def build_synthetic_bundle(classes: int, dim: int, input_dim: int = 64, seed: int = 0, out: Path | str = "bundle",
                           rows: str = "clustered", image: dict | None = None, negatives: int = 0,
                           heads: tuple[str, ...] = (), overwrite: bool = False,
                           backbone_seed: int | None = None) -> Path:
    """Write a verifiable bundle with a random backbone and `classes` random rows of size `dim`;
    `image` (a manifest image spec with layout flat) lets it take image bodies too; `negatives`:
    that many calibration negatives (embeddings of random inputs, labelled by their top class);
    `heads`: quantized copies of the head too (int8, bf16); `backbone_seed`: the backbone drawn from
    this seed instead (bundles of one backbone_seed have byte-identical backbone.onnx, with the head,
    classes and thresholds of their own `seed`: a server shares one backbone between them). Staged and swapped into place
    (serving/bundle/output.py); `overwrite` replaces a bundle already at `out`."""
    from serving.bundle import output

    D, d = int(classes), int(dim)
    if image is not None and (bad := check_image_spec(image, (int(input_dim),))):
        raise ValueError(bad)
    if rows not in ROW_KINDS:
        raise ValueError(f"rows must be one of {', '.join(ROW_KINDS)}; got {rows!r}")
    if D < 1 or d < 1 or input_dim < 1:
        raise ValueError("classes, dim and input_dim must be positive")
    with output.staged(out, "bundle", overwrite=overwrite) as stage:
        _write_bundle(stage, D, d, int(input_dim), seed, rows, image, negatives, heads, backbone_seed)
    return Path(out)


def _write_bundle(out: Path, D: int, d: int, input_dim: int, seed: int, rows: str, image: dict | None,
                  negatives: int, heads: tuple[str, ...], backbone_seed: int | None = None) -> None:
    rng = np.random.default_rng(seed)
    params = _backbone_params(rng, input_dim, d)  # drawn in any case: the head's rows come from the same stream
    if backbone_seed is not None:
        params = _backbone_params(np.random.default_rng(backbone_seed), input_dim, d)
    probe = backbone_numpy(params, rng.standard_normal((PROBE, input_dim)))  # [P, d]
    samples = _plan_samples(rng, params, input_dim, D)
    known, offsets, threshold, sd = _write_head(out, rng, D, d, rows, probe, samples)
    write_graphs(out, params, input_dim, d, D, offsets["weight"], offsets["bias"])
    samples.save(out / "samples.npz")
    _write_calibration(out / "calibration.json", threshold, sd)
    extra = {"negatives": _write_negatives(out, rng, params, input_dim, negatives)} if negatives else {}
    if heads:
        from serving.bundle.quantize import write_heads

        extra["heads"] = write_heads(out, np.load(out / "head_weight.npy", mmap_mode="r"), tuple(heads), progress=True)
    manifest = base_manifest(
        f"synthetic-D{D}-d{d}-s{seed}", [input_dim], d, [str(j) for j in range(D)],
        loss={"name": "none", "params": {}, "pols": False},
        backbone={"name": "synthetic_mlp", "params": {"input_dim": int(input_dim), "hidden": HIDDEN, "normalize": "l2"}},
        training={"synthetic": True, "seed": int(seed), "rows": rows,
                  **({"backbone_seed": int(backbone_seed)} if backbone_seed is not None else {})}, test_metrics=None,
        external_data={"full.onnx": ["head_weight.npy", "head_bias.npy"],
                       "single.onnx": ["head_weight.npy", "head_bias.npy"]},
        **({"image": image} if image is not None else {}), **extra)
    write_manifest(out, manifest, known_hashes=known)


def _write_negatives(out: Path, rng: np.random.Generator, params: dict, input_dim: int, n: int) -> dict:
    """Calibration negatives (serving/bundle/negatives.py): backbone embeddings of random inputs, each
    labelled by its top class over the written head (chunk by chunk)."""
    from serving.bundle.negatives import write_negatives

    h = backbone_numpy(params, rng.standard_normal((n, input_dim))).astype(np.float32)  # [n, d]
    weight, bias = np.load(out / "head_weight.npy", mmap_mode="r"), np.load(out / "head_bias.npy", mmap_mode="r")
    best, label = np.full(n, -np.inf), np.zeros(n, dtype=np.int64)
    for start in range(0, len(weight), ROW_CHUNK):
        z = h.astype(np.float64) @ np.asarray(weight[start:start + ROW_CHUNK], np.float64).T + bias[start:start + ROW_CHUNK]
        am = z.argmax(axis=1)
        better = z[np.arange(n), am] > best
        best[better], label[better] = z[np.arange(n), am][better], am[better] + start
    return write_negatives(out, h, label, split="synthetic", limit=n)


def _write_calibration(path: Path, threshold: np.ndarray, sd: np.ndarray) -> None:
    """calibration.json streamed line by line: a million dicts would cost far more memory than the head."""
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
