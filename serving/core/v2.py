"""The KServe v2 models (docs/api.md), shared by the HTTP front (serving/http/v2.py) and the gRPC
front (serving/grpc/server.py): their names, metadata and version, and what each computes on
decoded input tensors.

  `<name>`       inputs `input` FP32 [N, ...] and `class_id` INT64 [N] -> `logit` FP32 [N], `match` BOOL [N]
                 (one row of the head per input, the class's calibrated threshold)
  `<name>-full`  input `input` -> `logits` FP32 [N, D + n_e]
                 (the D trained classes, then the n_e enrolled ones in id order: docs/api.md)

Class ids of enrolled classes (D + slot) are accepted by `<name>` like trained ones.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from serving.codecs import v2_tensors as v2
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
    name = engine.bundle.name
    if model == name:
        return "single"
    if model == f"{name}-full":
        return "full"
    raise NotFound(f"unknown model {model!r}; this server has {name!r} and {name + '-full'!r}", code="unknown_model")


def model_metadata_of(engine, kind: str) -> dict:
    name = engine.bundle.name
    x = {"name": "input", "datatype": "FP32", "shape": [-1, *engine.input_shape]}
    if kind == "single":
        return {"name": name, "versions": [VERSION], "platform": "onnxruntime_onnx",
                "inputs": [x, {"name": "class_id", "datatype": "INT64", "shape": [-1]}],
                "outputs": [{"name": "logit", "datatype": "FP32", "shape": [-1]},
                            {"name": "match", "datatype": "BOOL", "shape": [-1]}]}
    return {"name": f"{name}-full", "versions": [VERSION], "platform": "onnxruntime_onnx", "inputs": [x],
            "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, engine.num_classes + engine.snapshot().n]}]}



async def run_model(engine, kind: str, tensors: dict[str, tuple[np.ndarray, str]]) -> dict[str, tuple[str, np.ndarray]]:
    """The model `kind` ("single" or "full") on decoded input tensors -> {output name: (datatype, array)}.
    Shared by the HTTP route above and the gRPC service (serving/grpc/server.py)."""
    x = _input_batch(engine, tensors)
    if kind != "single":
        return {"logits": ("FP32", await engine.all_logits(x))}
    cid = tensors.get("class_id")
    if cid is None:
        raise InvalidInput("model needs inputs 'input' and 'class_id'", code="missing_input")
    cid_arr, cid_type = cid
    if cid_type not in v2.INTS or cid_arr.size != x.shape[0]:
        raise InvalidInput(f"'class_id' must be an integer tensor [N] with N = {x.shape[0]}", code="shape_mismatch")
    flat = cid_arr.reshape(-1)
    ids = flat.tolist()  # Python ints (N <= max_inputs): no wrap-around of the tensor's own dtype
    snap = engine.snapshot()  # the enrolled classes this request answers with
    bad = [i for i in ids if not engine.class_exists(i, snap)]
    if bad:
        raise NotFound(f"unknown class id {bad[0]} (ids are 0..{engine.num_classes - 1}, and D + slot of the "
                       f"{snap.n} enrolled classes)", code="unknown_class")
    logit, match = await engine.single_logits(x, flat.astype(np.int64), snap)
    return {"logit": ("FP32", logit), "match": ("BOOL", match)}


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
