"""KServe v2 over gRPC (`inference.GRPCInferenceService`, the protocol Triton speaks), beside HTTP:
`slc serve --grpc-port 8001` (needs `pip install 'slc[grpc]'`). `tritonclient.grpc` works
against it unmodified.

Same models as /v2 over HTTP (serving/kserve.py): `<bundle name>` (input + class_id -> logit,
match) and `<bundle name>-full` (input -> logits); same engine and batch queue; inputs as
`raw_input_contents` (what tritonclient sends) or typed `contents`; outputs as
`raw_output_contents`. Errors are the HTTP envelope's, mapped to gRPC status codes (STATUS
below) with the envelope's code in the message; requests are counted in /metrics with
endpoint `grpc:<method>`. The protocol's message classes come from tritonclient's generated
modules (Triton's own .proto files, compiled).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import numpy as np

from serving.deadlines import within
from serving.errors import ApiError, DeadlineExceeded, InvalidInput
from serving.v2_tensors import DTYPES, FLOATS, INTS
from serving.kserve import SERVER_VERSION, VERSION, model_kind, model_metadata_of, run_model

log = logging.getLogger(__name__)

# HTTP status of the error envelope -> gRPC status code name
STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 408: "DEADLINE_EXCEEDED",
          413: "RESOURCE_EXHAUSTED", 415: "INVALID_ARGUMENT", 422: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED",
          503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED", 507: "RESOURCE_EXHAUSTED"}
_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
             "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
             "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents"}


def _modules():
    try:
        import grpc
        from tritonclient.grpc import service_pb2, service_pb2_grpc
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(f"--grpc-port needs grpcio and tritonclient[grpc] ({exc}): pip install 'slc[grpc]'") from None
    return grpc, service_pb2, service_pb2_grpc


def decode_tensors(request, max_values: int = 1 << 28) -> dict[str, tuple[np.ndarray, str]]:
    """ModelInferRequest inputs -> {name: (array shaped as declared, datatype)}, checked as over HTTP;
    a tensor may hold at most `max_values` values."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs", code="validation_error")
    names = [t.name for t in request.inputs]
    if unknown := [n for n in names if n not in ("input", "class_id")]:
        raise InvalidInput(f"unknown input tensor {unknown[0]!r}; the models take 'input' (and 'class_id')",
                           code="unknown_input")
    if len(set(names)) != len(names):
        raise InvalidInput("an input tensor is given twice", code="validation_error")
    tensors = {}
    for i, t in enumerate(request.inputs):
        dt = t.datatype.upper()
        if dt not in DTYPES or dt == "FP16":
            raise InvalidInput(f"input {t.name!r}: datatype {t.datatype!r} is not supported", code="unsupported_datatype")
        shape = [int(s) for s in t.shape]
        if any(s < 0 for s in shape):
            raise InvalidInput(f"input {t.name!r}: negative dimension in shape {shape}", code="shape_mismatch")
        count = math.prod(shape)  # Python ints: no overflow
        if count > max_values:
            raise InvalidInput(f"input {t.name!r}: shape {shape} holds more values than a request may",
                               code="too_many_inputs")
        if raw:
            itemsize = np.dtype(DTYPES[dt]).itemsize
            if len(raw[i]) != count * itemsize:
                raise InvalidInput(f"input {t.name!r}: {len(raw[i])} bytes for shape {shape} {dt}", code="shape_mismatch")
            arr = np.frombuffer(raw[i], dtype=DTYPES[dt])
        else:
            values = np.asarray(getattr(t.contents, _CONTENTS[dt]))
            if values.size != count:
                raise InvalidInput(f"input {t.name!r}: {values.size} values for shape {shape}", code="shape_mismatch")
            if dt in INTS and values.size:
                info = np.iinfo(DTYPES[dt])
                if values.min() < info.min or values.max() > info.max:
                    raise InvalidInput(f"input {t.name!r}: values outside the range of {dt}", code="validation_error")
            arr = values.astype(DTYPES[dt])
        arr = arr.reshape(shape)
        if dt in FLOATS and not np.isfinite(arr).all():
            raise InvalidInput(f"input {t.name!r}: NaN or infinite values", code="non_finite_value")
        tensors[t.name] = (arr, dt)
    return tensors


def build_service(state):
    """The servicer class bound to the server's state (engine, metrics)."""
    grpc, pb, pb_grpc = _modules()

    def engine():
        return state.ready_engine()  # NotReady (503 -> UNAVAILABLE) while loading or draining

    async def guarded(method: str, context, work):
        t0 = time.perf_counter()
        status = 200
        timeout = state.settings.request_timeout_s
        try:
            try:  # the request deadline, as the HTTP routes have it (queue and compute included)
                with within(timeout):
                    return await work()
            except TimeoutError:
                raise DeadlineExceeded(f"request not answered within its deadline of {timeout:g} s") from None
        except asyncio.CancelledError:  # the client cancelled or its deadline passed
            status = 499
            raise
        except ApiError as exc:
            status = exc.status
            state.metrics.reject(exc.code)
            await context.abort(getattr(grpc.StatusCode, STATUS.get(exc.status, "INTERNAL")), f"{exc.code}: {exc}")
        except Exception as exc:  # an abort raises too: counted as what it was
            if not isinstance(exc, grpc.aio.AbortError):
                status = 500
                log.exception("grpc %s failed", method)
                await context.abort(grpc.StatusCode.INTERNAL, "internal error")
            raise
        finally:
            state.metrics.observe_request(f"grpc:{method}", "POST", str(status), time.perf_counter() - t0)

    def tensor_meta(items: list[dict]) -> list:
        return [pb.ModelMetadataResponse.TensorMetadata(name=t["name"], datatype=t["datatype"], shape=t["shape"])
                for t in items]

    class Service(pb_grpc.GRPCInferenceServiceServicer):
        async def ServerLive(self, request, context):
            return pb.ServerLiveResponse(live=True)

        async def ServerReady(self, request, context):
            return pb.ServerReadyResponse(ready=bool(state.is_ready))

        async def ServerMetadata(self, request, context):
            return pb.ServerMetadataResponse(name="slc", version=SERVER_VERSION, extensions=[])

        async def ModelReady(self, request, context):
            async def work():
                model_kind(engine(), request.name)
                return pb.ModelReadyResponse(ready=bool(state.is_ready))
            return await guarded("ModelReady", context, work)

        async def ModelMetadata(self, request, context):
            async def work():
                e = engine()
                m = model_metadata_of(e, model_kind(e, request.name))
                return pb.ModelMetadataResponse(name=m["name"], versions=m["versions"], platform=m["platform"],
                                                inputs=tensor_meta(m["inputs"]), outputs=tensor_meta(m["outputs"]))
            return await guarded("ModelMetadata", context, work)

        async def ModelInfer(self, request, context):
            async def work():
                e = engine()
                if request.model_version not in ("", VERSION):
                    raise ApiError(f"model version {request.model_version!r} does not exist", code="unknown_version",
                                   status=404)
                kind = model_kind(e, request.model_name)
                limit = e.settings.max_inputs * (e.input_size + 1)
                outputs = await run_model(e, kind, decode_tensors(request, limit))
                wanted = [o.name for o in request.outputs] or list(outputs)
                if unknown := [n for n in wanted if n not in outputs]:
                    raise InvalidInput(f"unknown output {unknown[0]!r}; outputs are {sorted(outputs)}",
                                       code="unknown_output")
                response = pb.ModelInferResponse(model_name=request.model_name, model_version=VERSION, id=request.id)
                for name in wanted:
                    dtype, arr = outputs[name]
                    response.outputs.add(name=name, datatype=dtype, shape=list(arr.shape))
                    response.raw_output_contents.append(np.ascontiguousarray(arr).tobytes())
                return response
            return await guarded("ModelInfer", context, work)

    return Service


async def start_grpc(state, host: str, port: int, max_message_bytes: int) -> Any:
    """A grpc.aio server on host:port serving the v2 service; returns it (stop with .stop(grace))."""
    grpc, _, pb_grpc = _modules()
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", int(max_message_bytes)),
                                      ("grpc.max_send_message_length", 256 * 1024 * 1024)])
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(build_service(state)(), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot listen for gRPC on {host}:{port}")
    await server.start()
    log.info("gRPC KServe v2 on %s:%d", host, bound)
    return server

