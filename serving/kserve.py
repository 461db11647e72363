"""KServe v2 / Open Inference Protocol (docs/api.md), JSON tensors and the binary tensor extension.

Models:
  `<name>`       inputs `input` FP32 [N, ...] and `class_id` INT64 [N] -> `logit` FP32 [N], `match` BOOL [N]
                 (one row of the head per input, the class's calibrated threshold)
  `<name>-full`  input `input` -> `logits` FP32 [N, D]

Binary extension (what tritonclient.http sends by default): a request whose header
`Inference-Header-Content-Length: L` is set carries L bytes of JSON, then the raw tensors in
input order (each input's `parameters.binary_data_size`); outputs asked with
`parameters.binary_data: true` come back the same way. Errors keep the project's envelope.
The body's tensors are read and checked in serving/v2_tensors.py.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

import numpy as np
import orjson
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from serving.errors import InvalidInput, NotFound, NotReady, OrjsonResponse
from serving import v2_tensors as v2
from serving.body_routes import RawAnswer, app_state, body_route
from serving.http import error_responses, ready_engine, server_state

class InferTensor(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str
    shape: list[int] = Field(description="[N, ...]")
    datatype: str = Field(description="BOOL, UINT8..UINT64, INT8..INT64, FP16, FP32 or FP64 (any case)")
    parameters: Optional[dict[str, Any]] = None
    data: Optional[Any] = Field(None, description="flat (row-major) or nested like shape")


class InferRequestedOutput(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str
    parameters: Optional[dict[str, Any]] = None


class InferRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    id: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    inputs: list[InferTensor] = Field(min_length=1)
    outputs: Optional[list[InferRequestedOutput]] = None


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class InferResponse(BaseModel):
    model_name: str
    model_version: Optional[str] = None
    id: Optional[str] = None
    outputs: list[dict[str, Any]]


class Liveness(BaseModel):
    live: Literal[True]


class Readiness(BaseModel):
    ready: Literal[True]


router = APIRouter(prefix="/v2", tags=["kserve v2"])


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("slc")
    except PackageNotFoundError:
        return "0+unknown"


SERVER_VERSION = _package_version()  # looked up once, not per GET /v2
VERSION = "1"  # the one model version a bundle serves


def _check_version(request: Request) -> None:
    _check_version_value(request.path_params.get("version"))


def _check_version_value(version: Optional[str]) -> None:
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
            "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, engine.num_classes]}]}


@router.get("", response_model=ServerMetadata)
async def server_metadata(request: Request):
    return {"name": "slc", "version": SERVER_VERSION, "extensions": ["binary_tensor_data"]}


@router.get("/health/live", response_model=Liveness)
async def v2_live():
    return {"live": True}


@router.get("/health/ready", response_model=Readiness, responses=error_responses(503))
async def v2_ready(state=Depends(server_state)):
    if not state.is_ready:
        raise NotReady(state.not_ready_reason())
    return {"ready": True}


@router.get("/models/{model}", response_model=ModelMetadata, responses=error_responses(404, 503))
@router.get("/models/{model}/versions/{version}", response_model=ModelMetadata, responses=error_responses(404, 503),
            include_in_schema=False)
async def model_metadata(model: str, request: Request, engine=Depends(ready_engine)):
    _check_version(request)
    return OrjsonResponse(model_metadata_of(engine, model_kind(engine, model)))


@router.get("/models/{model}/ready", response_model=Readiness, responses=error_responses(404, 503))
@router.get("/models/{model}/versions/{version}/ready", response_model=Readiness, responses=error_responses(404, 503),
            include_in_schema=False)
async def model_ready(model: str, request: Request, engine=Depends(ready_engine), state=Depends(server_state)):
    _check_version(request)
    model_kind(engine, model)
    if not state.is_ready:
        raise NotReady(state.not_ready_reason())
    return {"ready": True}


def openapi_components() -> dict:
    """The schemas the infer body refers to (#/components/schemas/...), for the app's OpenAPI."""
    return InferRequest.model_json_schema(ref_template="#/components/schemas/{model}").get("$defs", {})


_INFER_BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": InferRequest.model_json_schema(ref_template="#/components/schemas/{model}")}}}}


# (the lower decorator registers first: the versioned path goes last, so the usual path matches at once)
@router.post("/models/{model}/versions/{version}/infer", response_model=InferResponse, include_in_schema=False)
@router.post("/models/{model}/infer", response_model=InferResponse, responses=error_responses(400, 404, 413, 422, 429, 503, 504),
             openapi_extra=_INFER_BODY)
async def infer(model: str, request: Request):
    """Describes the route in OpenAPI; `_infer_body` answers it."""
    raise AssertionError("answered by _infer_body")  # pragma: no cover - POST bodies never reach here


@body_route(infer)
async def _infer_body(scope, body: bytes):
    """The infer route straight on ASGI, as /v1 detect: no FastAPI dependency solving and no pydantic on
    the body (docs/results/v2-path.md); the checks below give the same answers the models gave."""
    engine = app_state(scope).ready_engine()
    params = scope["path_params"]
    _check_version_value(params.get("version"))
    kind = model_kind(engine, params["model"])
    body, binary = v2.split_binary(_header(scope, b"inference-header-content-length"), body)
    req, tensors = v2.read_infer(body, binary, engine.settings.max_inputs, engine.input_shape)
    outputs = await run_model(engine, kind, tensors)
    return 200, _answer(params["model"], req, outputs)


def _header(scope, name: bytes) -> Optional[bytes]:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def _answer(model: str, req: dict, outputs: dict[str, tuple[str, np.ndarray]]):
    """The infer response: outputs asked as binary_data go raw after the JSON header (RawAnswer)."""
    wanted = req["outputs"] or [{"name": n, "parameters": None} for n in outputs]
    binary_default = bool((req["parameters"] or {}).get("binary_data_output", False))
    out_json, out_bin = [], []
    for o in wanted:
        if o["name"] not in outputs:
            raise InvalidInput(f"unknown output {o['name']!r}; outputs are {sorted(outputs)}", code="unknown_output")
        dtype, arr = outputs[o["name"]]
        entry: dict[str, Any] = {"name": o["name"], "datatype": dtype, "shape": list(arr.shape)}
        if bool((o["parameters"] or {}).get("binary_data", binary_default)):
            raw = np.ascontiguousarray(arr).tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            out_bin.append(raw)
        else:
            entry["data"] = arr.reshape(-1)
        out_json.append(entry)
    response = {"model_name": model, "model_version": VERSION, "outputs": out_json}
    if req["id"] is not None:
        response["id"] = req["id"]
    if not out_bin:
        return response
    head = orjson.dumps(response, option=orjson.OPT_SERIALIZE_NUMPY)
    return RawAnswer(head + b"".join(out_bin), b"application/octet-stream",
                     [(b"inference-header-content-length", str(len(head)).encode())])


async def run_model(engine, kind: str, tensors: dict[str, tuple[np.ndarray, str]]) -> dict[str, tuple[str, np.ndarray]]:
    """The model `kind` ("single" or "full") on decoded input tensors -> {output name: (datatype, array)}.
    Shared by the HTTP route above and the gRPC service (serving/grpc_v2.py)."""
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
    bad = [i for i in ids if not 0 <= i < engine.num_classes]
    if bad:
        raise NotFound(f"unknown class id {bad[0]} (ids are 0..{engine.num_classes - 1})", code="unknown_class")
    logit, match = await engine.single_logits(x, flat.astype(np.int64))
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
