"""KServe v2 / Open Inference Protocol (docs/api.md), JSON tensors and the binary tensor extension.

The models and what they compute are serving/core/v2.py's (shared with the gRPC front).

Binary extension (what tritonclient.http sends by default): a request whose header
`Inference-Header-Content-Length: L` is set carries L bytes of JSON, then the raw tensors in
input order (each input's `parameters.binary_data_size`); outputs asked with
`parameters.binary_data: true` come back the same way. Errors keep the project's envelope.
The body's tensors are read and checked in serving/codecs/v2_tensors.py.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

import numpy as np
import orjson
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from serving.codecs import v2_tensors as v2
from serving.core.v2 import SERVER_VERSION, VERSION, check_version, model_kind, model_metadata_of, run_model
from serving.errors import NotReady
from serving.http.deps import error_responses, server_state
from serving.http.errors import OrjsonResponse
from serving.http.fast_routes import RawAnswer, app_state, fast_route

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



def _check_version(request: Request) -> None:
    check_version(request.path_params.get("version"))


@router.get("", response_model=ServerMetadata)
async def server_metadata(request: Request):
    return {"name": "slc", "version": SERVER_VERSION, "extensions": ["binary_tensor_data", "classification",
                                                                    "model_repository"]}


@router.get("/health/live", response_model=Liveness)
async def v2_live():
    return {"live": True}


@router.get("/health/ready", response_model=Readiness, responses=error_responses(503))
async def v2_ready(state=Depends(server_state)):
    await state.check_ready()
    return {"ready": True}


@router.get("/models/{model}", response_model=ModelMetadata, responses=error_responses(404, 503))
@router.get("/models/{model}/versions/{version}", response_model=ModelMetadata, responses=error_responses(404, 503),
            include_in_schema=False)
async def model_metadata(model: str, request: Request, state=Depends(server_state)):
    _check_version(request)
    engine = state.engine_for(model)
    return OrjsonResponse(model_metadata_of(engine, model_kind(engine, model)))


@router.get("/models/{model}/ready", response_model=Readiness, responses=error_responses(404, 503))
@router.get("/models/{model}/versions/{version}/ready", response_model=Readiness, responses=error_responses(404, 503),
            include_in_schema=False)
async def model_ready(model: str, request: Request, state=Depends(server_state)):
    _check_version(request)
    model_kind(state.engine_for(model), model)
    if not state.is_ready:
        raise NotReady(state.not_ready_reason())
    return {"ready": True}


def openapi_components() -> dict:
    """The schemas the infer body refers to (#/components/schemas/...), for the app's OpenAPI."""
    return InferRequest.model_json_schema(ref_template="#/components/schemas/{model}").get("$defs", {})


_INFER_BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": InferRequest.model_json_schema(ref_template="#/components/schemas/{model}")}}}}


# the versioned path goes last, so the usual path matches at once
@fast_route(router, "POST", "/models/{model}/versions/{version}/infer", name="infer_version",
            response_model=InferResponse, include_in_schema=False)
@fast_route(router, "POST", "/models/{model}/infer", name="infer", response_model=InferResponse,
            responses=error_responses(400, 404, 413, 422, 429, 503, 504), openapi_extra=_INFER_BODY)
async def infer(scope, body: bytes):
    """The infer route straight on ASGI, as /v1 detect: no FastAPI dependency solving and no pydantic on
    the body, so that a v2 request costs the event loop about what a detect does; the checks below give
    the same answers the models gave."""
    params = scope["path_params"]
    engine = app_state(scope).engine_for(params["model"])
    check_version(params.get("version"))
    kind = model_kind(engine, params["model"])
    body, binary = v2.split_binary(_header(scope, b"inference-header-content-length"), body)
    req, tensors = v2.read_infer(body, binary, engine.settings.max_inputs, engine.input_shape)
    asked = [(o["name"], o["parameters"]) for o in req["outputs"]] if req["outputs"] else None
    outputs = await run_model(engine, kind, tensors, asked, req["parameters"])
    return 200, _answer(params["model"], req, outputs)


def _header(scope, name: bytes) -> Optional[bytes]:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def _answer(model: str, req: dict, outputs: dict[str, tuple[str, np.ndarray]]):
    """The infer response, outputs in the order asked (run_model's): outputs asked as binary_data go
    raw after the JSON header (RawAnswer); BYTES tensors as Triton sends them (serving/codecs/v2_tensors.py)."""
    params_of = {o["name"]: o["parameters"] or {} for o in req["outputs"] or ()}
    binary_default = bool((req["parameters"] or {}).get("binary_data_output", False))
    out_json, out_bin = [], []
    for name, (dtype, arr) in outputs.items():
        entry: dict[str, Any] = {"name": name, "datatype": dtype, "shape": list(arr.shape)}
        if bool(params_of.get(name, {}).get("binary_data", binary_default)):
            raw = v2.tensor_bytes(dtype, arr)
            entry["parameters"] = {"binary_data_size": len(raw)}
            out_bin.append(raw)
        else:
            entry["data"] = arr.reshape(-1).tolist() if dtype == "BYTES" else arr.reshape(-1)
        out_json.append(entry)
    response = {"model_name": model, "model_version": VERSION, "outputs": out_json}
    if req["id"] is not None:
        response["id"] = req["id"]
    if not out_bin:
        return response
    head = orjson.dumps(response, option=orjson.OPT_SERIALIZE_NUMPY)
    return RawAnswer(head + b"".join(out_bin), b"application/octet-stream",
                     [(b"inference-header-content-length", str(len(head)).encode())])
