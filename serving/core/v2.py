"""The KServe v2 models (docs/api.md), shared by the HTTP front (serving/http/v2.py) and the gRPC
front (serving/grpc/server.py): their names, metadata and version, and what each computes on
decoded input tensors.

  `<name>`       inputs `input` FP32 [N, ...] and `class_id` INT64 [N] -> `logit` FP32 [N], `match` BOOL [N]
                 (one row of the head per input, the class's calibrated threshold)
  `<name>-full`  input `input` -> `logits` FP32 [N, D + n_e]
                 (the D trained classes, then the n_e enrolled ones in id order: docs/api.md);
                 asked by name, `match` BOOL and `threshold` FP32 of the same shape (each logit
                 against its class's threshold: open-set decisions, issue 51)

Class ids of enrolled classes (D + slot) are accepted by `<name>` like trained ones. A request
parameter `threshold` replaces every class's calibrated one, as detect's `threshold` does.

Triton's classification extension: an output asked with the parameter `classification: k`
is answered as Triton answers it, a BYTES tensor [N, k] of "value:index:label" strings (value
with 9 decimals, index the class id, label its name), best first; for `logits` that is the
exact top-k of /v1/topk, computed by the same pass (the [N, D] logits are never built), and
`match` / `threshold` asked beside it follow its k entries.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from serving.codecs import v2_tensors as v2
from serving.core import lookalikes, open_set
from serving.errors import InvalidInput, NotFound


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("slc")
    except PackageNotFoundError:
        return "0+unknown"


SERVER_VERSION = _package_version()  # looked up once, not per GET /v2
VERSION = "1"  # the one model version a bundle serves


def check_version(version: Optional[str]) -> None:
    """`/versions/{v}` routes: only the one version a bundle serves exists."""
    if version is not None and version != VERSION:
        raise NotFound(f"model version {version!r} does not exist (this server has version {VERSION!r})",
                       code="unknown_version")


def model_kind(engine, model: str) -> str:
    name = engine.name
    if model == name:
        return "single"
    if model == f"{name}-full":
        return "full"
    raise NotFound(f"unknown model {model!r}; this server has {name!r} and {name + '-full'!r}", code="unknown_model")


def model_metadata_of(engine, kind: str) -> dict:
    name = engine.name
    x = {"name": "input", "datatype": "FP32", "shape": [-1, *engine.input_shape]}
    if kind == "single":
        return {"name": name, "versions": [VERSION], "platform": "onnxruntime_onnx",
                "inputs": [x, {"name": "class_id", "datatype": "INT64", "shape": [-1]}],
                "outputs": [{"name": "logit", "datatype": "FP32", "shape": [-1]},
                            {"name": "match", "datatype": "BOOL", "shape": [-1]}]}
    shape = [-1, engine.num_classes + engine.classes.snapshot().n]
    return {"name": f"{name}-full", "versions": [VERSION], "platform": "onnxruntime_onnx", "inputs": [x],
            "outputs": [{"name": "logits", "datatype": "FP32", "shape": shape},
                        {"name": "match", "datatype": "BOOL", "shape": shape},
                        {"name": "threshold", "datatype": "FP32", "shape": shape}]}


OUTPUTS = {"single": ("logit", "match"), "full": ("logits", "match", "threshold")}
DEFAULT_OUTPUTS = {"single": ("logit", "match"), "full": ("logits",)}  # answered when a request names none
Requested = list[tuple[str, Optional[dict]]]  # (output name, its parameters) in the request's order


def requested_outputs(kind: str, outputs: Optional[Requested]) -> tuple[list[str], Optional[int]]:
    """(output names to answer, the top-k of Triton's classification or None), checked before any work."""
    names = [n for n, _ in outputs] if outputs else list(DEFAULT_OUTPUTS[kind])
    if unknown := [n for n in names if n not in OUTPUTS[kind]]:
        raise InvalidInput(f"unknown output {unknown[0]!r}; outputs are {sorted(OUTPUTS[kind])}", code="unknown_output")
    if len(set(names)) != len(names):
        raise InvalidInput("an output is asked twice", code="validation_error")
    k = None
    for name, params in outputs or ():
        count = (params or {}).get("classification")
        if count is None or (type(count) is int and count == 0):  # 0: tritonclient's "no classification"
            continue
        if kind != "full" or name != "logits":
            raise InvalidInput(f"classification is served for the output 'logits' of the model '<name>-full', "
                               f"not for {name!r}", code="unsupported_classification")
        k = _class_count(count)
    return names, k


def _class_count(count) -> int:
    if type(count) is float and count.is_integer():
        count = int(count)
    if type(count) is not int or count < 1:
        raise InvalidInput(f"classification must be an integer k >= 1, got {count!r:.40}", code="validation_error")
    return count


def request_threshold(parameters: Optional[dict]) -> Optional[float]:
    """The request parameter `threshold` (a finite number) or None: the classes' calibrated ones."""
    t = (parameters or {}).get("threshold")
    if t is None:
        return None
    if type(t) not in (int, float) or not math.isfinite(t):
        raise InvalidInput("parameters.threshold must be a finite number", code="validation_error")
    return float(t)



async def run_model(engine, kind: str, tensors: dict[str, tuple[np.ndarray, str]], outputs: Optional[Requested] = None,
                    parameters: Optional[dict] = None) -> dict[str, tuple[str, np.ndarray]]:
    """The model `kind` ("single" or "full") on decoded input tensors -> {output name: (datatype, array)}
    for the outputs asked (`outputs`, with their parameters; None: the defaults), in that order.
    Shared by the HTTP route above and the gRPC service (serving/grpc/server.py)."""
    names, k = requested_outputs(kind, outputs)
    threshold = request_threshold(parameters)
    x = _input_batch(engine, tensors)
    if kind != "single":
        answer = await (_classified(engine, x, k, threshold, names) if k is not None else _full(engine, x, threshold, names))
        return {n: answer[n] for n in names}
    cid = tensors.get("class_id")
    if cid is None:
        raise InvalidInput("model needs inputs 'input' and 'class_id'", code="missing_input")
    cid_arr, cid_type = cid
    if cid_type not in v2.INTS or cid_arr.size != x.shape[0]:
        raise InvalidInput(f"'class_id' must be an integer tensor [N] with N = {x.shape[0]}", code="shape_mismatch")
    flat = cid_arr.reshape(-1)
    ids = flat.tolist()  # Python ints (N <= max_inputs): no wrap-around of the tensor's own dtype
    snap = engine.classes.snapshot()  # the enrolled classes this request answers with
    bad = [i for i in ids if not engine.classes.class_exists(i, snap)]
    if bad:
        raise NotFound(f"unknown class id {bad[0]} (ids are 0..{engine.num_classes - 1}, and D + slot of the "
                       f"{snap.n} enrolled classes)", code="unknown_class")
    logit, match = await engine.single_logits(x, flat.astype(np.int64), snap, threshold)
    return {n: {"logit": ("FP32", logit), "match": ("BOOL", match)}[n] for n in names}


async def _full(engine, x: np.ndarray, threshold: Optional[float], names: list[str]) -> dict:
    """All D + n_e logits, and each against its class's threshold when `match` / `threshold` are asked
    (between look-alikes, by detect's margins: only the columns of classes that have one)."""
    snap, cal = engine.classes.snapshot(), engine.classes.calibration
    pairs = engine.classes.lookalikes(cal, snap) if names != ["logits"] else lookalikes.EMPTY
    z, h = await engine.all_logits(x, snap, embeddings=bool(pairs))
    if names == ["logits"]:
        return {"logits": ("FP32", z)}
    ids = np.concatenate([np.arange(engine.num_classes), snap.ids])  # [D + n_e]: each column's class id
    thr = open_set.thresholds_of(cal, snap, ids, threshold)
    match = z >= thr
    if pairs and len(cols := np.flatnonzero(pairs.has(ids))):  # [c] columns of classes with a look-alike
        margins_of = engine.classes.decider(snap, cal, threshold).margins_of(h)
        match[:, cols] = lookalikes.exclude(match[:, cols], np.broadcast_to(ids[cols], (len(z), len(cols))), pairs,
                                            margins_of)
    return {"logits": ("FP32", z), "match": ("BOOL", match),
            "threshold": ("FP32", np.broadcast_to(thr.astype(np.float32), z.shape))}


async def _classified(engine, x: np.ndarray, k: int, threshold: Optional[float], names: list[str]) -> dict:
    """Triton's classification of `logits`: the exact top-k of /v1/topk as "value:index:label" [N, k],
    with `match` and `threshold` of those k entries."""
    if k > engine.settings.max_topk:
        raise InvalidInput(f"classification={k} is over the server's limit of {engine.settings.max_topk} "
                           "(SLC_MAX_TOPK)", code="k_too_large")
    snap, cal = engine.classes.snapshot(), engine.classes.calibration
    k = min(k, engine.num_classes + snap.n)
    names_of = engine.bundle.classes
    decide = engine.classes.decider(snap, cal, threshold)

    def finish(logits: np.ndarray, ids: np.ndarray, h: Optional[np.ndarray]) -> dict:  # in the worker thread
        thr = open_set.thresholds_of(cal, snap, ids, threshold)
        labels = [[str(names_of[c]) if c < engine.num_classes else snap.name(snap.position_of_id(c)) for c in row]
                  for row in ids.tolist()]
        strings = np.array([[f"{v:.9f}:{c}:{label}" for v, c, label in zip(zr, cr, lr)]
                            for zr, cr, lr in zip(logits.tolist(), ids.tolist(), labels)], dtype=object)
        return {"logits": ("BYTES", strings.reshape(len(ids), -1)),
                "match": ("BOOL", decide(h, ids, logits.astype(np.float64), thr)),
                "threshold": ("FP32", thr.astype(np.float32))}

    return await engine.topk_arrays(x, k, "exact", snap, finish, embeddings=decide.reads_embeddings)


def _input_batch(engine, tensors) -> np.ndarray:
    if "input" not in tensors:
        raise InvalidInput("missing input tensor 'input'", code="missing_input")
    arr, dt = tensors["input"]
    if dt not in v2.FLOATS:
        raise InvalidInput(f"'input' must be FP32 (got {dt})", code="unsupported_datatype")
    if arr.ndim < 1 or arr.shape[0] < 1:
        raise InvalidInput("'input' needs a batch dimension N >= 1", code="shape_mismatch")
    n = arr.shape[0]
    if n > engine.settings.max_inputs:
        raise InvalidInput(f"{n} inputs in one request; the limit is {engine.settings.max_inputs}",
                           code="too_many_inputs")
    if arr[0].size != engine.input_size:
        raise InvalidInput(f"'input' examples must have shape {list(engine.input_shape)} "
                           f"({engine.input_size} values); got {list(arr.shape[1:])}", code="shape_mismatch")
    if arr.dtype == np.float32:  # found finite when decoded
        return arr.reshape((n,) + engine.input_shape)
    with np.errstate(over="ignore"):
        x = arr.astype(np.float32).reshape((n,) + engine.input_shape)
    if not np.isfinite(x).all():
        raise InvalidInput("'input' overflows float32", code="non_finite_value")
    return x
