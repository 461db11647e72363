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

Limits (docs/configuration.md), so that no client can make the server hold memory it does not
give back: a request message no larger than a valid one can be (`message_limit`); at most grpc_max_concurrent_rpcs calls
in progress (more: RESOURCE_EXHAUSTED at once) and grpc_max_streams_per_connection streams per
connection; a call's request message must arrive within body_timeout_s (ModelInfer is served as
a stream so that the server, not the client, decides how long it waits for it); idle connections
closed after grpc_idle_timeout_s, every connection after grpc_max_connection_age_s; dead peers
found by keepalive pings. The buffers of a call that ends (answered, refused, timed out, or its
client gone) are freed by gRPC, and glibc's freed pages handed back to the system (`Trimmer`),
which it would otherwise keep. Typed `contents` are counted before they are converted.
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import math
import threading
import time
from typing import Any, Optional

import numpy as np

from serving.deadlines import within
from serving.errors import ApiError, DeadlineExceeded, InvalidInput
from serving.v2_tensors import DTYPES, FLOATS
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


def decode_tensors(request, max_values: int = 1 << 28, max_int_values: int = 1 << 16) -> dict[str, tuple[np.ndarray, str]]:
    """ModelInferRequest inputs -> {name: (array shaped as declared, datatype)}, checked as over HTTP;
    a tensor may hold at most `max_values` values, typed integer or bool contents `max_int_values`."""
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
            arr = _typed_contents(t, dt, count, shape, max_int_values)
        try:
            arr = arr.reshape(shape)
        except ValueError:  # e.g. [0, 2^62]: no values, and a dimension numpy cannot hold
            raise InvalidInput(f"input {t.name!r}: shape {shape} cannot be held (a dimension is too large)",
                               code="shape_mismatch") from None
        if dt in FLOATS and not np.isfinite(arr).all():
            raise InvalidInput(f"input {t.name!r}: NaN or infinite values", code="non_finite_value")
        tensors[t.name] = (arr, dt)
    return tensors


_FIXED = {"FP32": (6, "<f4"), "FP64": (7, "<f8")}  # field number in InferTensorContents, wire dtype


def _typed_contents(t, dt: str, count: int, shape: list[int], max_int_values: int) -> np.ndarray:
    """A tensor's typed `contents` as a flat array, counted before anything is converted: FP32 and FP64
    straight from their packed wire bytes (a few ms for 2 M values, against 0.3 s element by
    element); integers and booleans (class ids: at most max_int_values) element by element."""
    values = getattr(t.contents, _CONTENTS[dt])
    if len(values) != count:  # len() of a repeated field: no conversion
        raise InvalidInput(f"input {t.name!r}: {len(values)} values for shape {shape}", code="shape_mismatch")
    if dt in _FIXED:
        field, wire = _FIXED[dt]
        data = _packed_field(t.contents.SerializeToString(), field)
        if data is not None and len(data) == count * np.dtype(wire).itemsize:
            return np.frombuffer(data, dtype=wire).astype(DTYPES[dt], copy=False)
        return np.fromiter(values, dtype=DTYPES[dt], count=count)  # (not written packed: never seen)
    if count > max_int_values:
        raise InvalidInput(f"input {t.name!r}: {count} {dt} values; integer and bool tensors hold class ids, at most "
                           f"{max_int_values}", code="too_many_inputs")
    if dt == "BOOL":
        return np.fromiter(values, dtype=np.bool_, count=count)
    arr = np.fromiter(values, dtype=np.uint64 if dt.startswith("U") else np.int64, count=count)
    info = np.iinfo(DTYPES[dt])
    if count and (arr.min() < info.min or arr.max() > info.max):
        raise InvalidInput(f"input {t.name!r}: values outside the range of {dt}", code="validation_error")
    return arr.astype(DTYPES[dt])


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return value, pos


def _packed_field(buf: bytes, number: int) -> Optional[bytes]:
    """The payload of length-delimited field `number` of a serialised message (the packed repeated
    field as protobuf writes it), None when absent or not alone of its number. Fields are few:
    one per contents kind."""
    pos, found = 0, None
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        wire = key & 7
        if wire == 2:
            size, pos = _varint(buf, pos)
            if key >> 3 == number:
                if found is not None:
                    return None
                found = buf[pos:pos + size]
            pos += size
        elif wire == 0:
            _, pos = _varint(buf, pos)
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            return None
    return found


class Trimmer:
    """Hands glibc's freed pages back to the system after gRPC calls end, at most once per
    `interval` s, in a thread (malloc_trim releases the GIL). gRPC frees a call's buffers when it
    ends, but glibc keeps freed memory of its many small blocks (+750 MB kept after 100 stalled
    8 MiB streams were dropped, measured). No-op where there is no glibc."""

    def __init__(self, interval: float = 1.0):
        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            self._trim = None
        self.interval = interval
        self._lock = threading.Lock()
        self._last = 0.0
        self._scheduled = False

    def poke(self) -> None:
        """A call ended: trim soon (coalesced with others ending meanwhile)."""
        if self._trim is None:
            return
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        delay = max(0.0, self._last + self.interval - time.monotonic())
        timer = threading.Timer(delay, self._run)
        timer.daemon = True
        timer.start()

    def _run(self) -> None:
        with self._lock:
            self._scheduled = False
            self._last = time.monotonic()
        self._trim(0)


async def read_message(context, timeout: float):
    """The one request message of a call served as a stream, which must arrive within `timeout` s
    (408 -> DEADLINE_EXCEEDED); a call that ends without one is INVALID_ARGUMENT."""
    grpc, _, _ = _modules()
    try:
        message = await asyncio.wait_for(context.read(), timeout)
    except asyncio.TimeoutError:
        raise ApiError(f"the request message did not arrive within {timeout:g} s", code="request_timeout",
                       status=408) from None
    if message is grpc.aio.EOF:
        raise InvalidInput("the call ended without a request message", code="validation_error")
    return message


def build_service(state, trimmer: Optional[Trimmer] = None):
    """The servicer class bound to the server's state (engine, metrics)."""
    grpc, pb, pb_grpc = _modules()

    def engine():
        return state.ready_engine()  # NotReady (503 -> UNAVAILABLE) while loading or draining

    async def guarded(method: str, context, work, read=None):
        """work(request) within the request deadline, errors as status codes; `read(context)` first
        (outside the deadline, as an HTTP body is read before it) for a call served as a stream."""
        t0 = time.perf_counter()
        status = 200
        timeout = state.settings.request_timeout_s
        try:
            request = await read(context) if read is not None else None
            try:  # the request deadline, as the HTTP routes have it (queue and compute included)
                with within(timeout):
                    return await work(request)
            except TimeoutError:
                raise DeadlineExceeded(f"request not answered within its deadline of {timeout:g} s") from None
        except asyncio.CancelledError:  # the client cancelled, left, or its deadline passed
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
            if trimmer is not None and read is not None:
                trimmer.poke()  # its buffers are freed: back to the system

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
            async def work(_):
                model_kind(engine(), request.name)
                return pb.ModelReadyResponse(ready=bool(state.is_ready))
            return await guarded("ModelReady", context, work)

        async def ModelMetadata(self, request, context):
            async def work(_):
                e = engine()
                m = model_metadata_of(e, model_kind(e, request.name))
                return pb.ModelMetadataResponse(name=m["name"], versions=m["versions"], platform=m["platform"],
                                                inputs=tensor_meta(m["inputs"]), outputs=tensor_meta(m["outputs"]))
            return await guarded("ModelMetadata", context, work)

        async def ModelInfer(self, request_iterator, context):
            """Served as a stream-unary call (the wire is the same as unary): the message is awaited
            here, within body_timeout_s, instead of for as long as the client likes."""
            async def read(ctx):
                return await read_message(ctx, state.settings.body_timeout_s)

            async def work(request):
                e = engine()
                if request.model_version not in ("", VERSION):
                    raise ApiError(f"model version {request.model_version!r} does not exist", code="unknown_version",
                                   status=404)
                kind = model_kind(e, request.model_name)
                limit = e.settings.max_inputs * (e.input_size + 1)
                outputs = await run_model(e, kind, decode_tensors(request, limit, e.settings.max_inputs))
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
            return await guarded("ModelInfer", context, work, read=read)

    return Service


SERVICE = "inference.GRPCInferenceService"


def method_handlers(service) -> Any:
    """The generic handler of the methods slc serves (any other answers UNIMPLEMENTED): unary, except
    ModelInfer, taken as a stream so that its message is awaited under the server's timeout."""
    grpc, pb, _ = _modules()

    def unary(name: str, request, response):
        return grpc.unary_unary_rpc_method_handler(getattr(service, name), request_deserializer=request.FromString,
                                                   response_serializer=response.SerializeToString)

    handlers = {name: unary(name, getattr(pb, name + "Request"), getattr(pb, name + "Response"))
                for name in ("ServerLive", "ServerReady", "ServerMetadata", "ModelReady", "ModelMetadata")}
    handlers["ModelInfer"] = grpc.stream_unary_rpc_method_handler(
        service.ModelInfer, request_deserializer=pb.ModelInferRequest.FromString,
        response_serializer=pb.ModelInferResponse.SerializeToString)
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


def server_options(settings, max_message_bytes: int) -> list[tuple[str, int]]:
    """grpc core's channel arguments: the limits of the module docstring."""
    ms = lambda seconds: max(1, int(seconds * 1000))  # noqa: E731
    return [("grpc.max_receive_message_length", int(max_message_bytes)),
            ("grpc.max_send_message_length", 256 * 1024 * 1024),
            ("grpc.max_concurrent_streams", settings.grpc_max_streams_per_connection),
            ("grpc.max_connection_idle_ms", ms(settings.grpc_idle_timeout_s)),
            ("grpc.max_connection_age_ms", ms(settings.grpc_max_connection_age_s)),
            ("grpc.max_connection_age_grace_ms", ms(settings.request_timeout_s)),
            ("grpc.server_handshake_timeout_ms", ms(settings.header_timeout_s)),
            ("grpc.keepalive_time_ms", 60_000), ("grpc.keepalive_timeout_ms", 20_000)]


def message_limit(settings, max_message_bytes: int) -> int:
    """The largest request message a valid call can be: max_inputs examples of the bundle's input
    size as FP64 (8 bytes a value, the widest datatype taken) and a class id each, with 64 KiB for
    names and shapes; never over max_message_bytes. Read from the manifest before the bundle is
    loaded (the gRPC server starts first); max_message_bytes when it is not at hand yet (the default
    model, built on the first start)."""
    import json
    from pathlib import Path

    try:
        manifest = json.loads((Path(settings.bundle) / "manifest.json").read_text())
        size = math.prod(int(d) for d in manifest["input"]["shape"])
    except (TypeError, OSError, ValueError, KeyError):
        return int(max_message_bytes)
    return int(min(max_message_bytes, settings.max_inputs * (8 * size + 16) + 65536))


async def start_grpc(state, host: str, port: int, max_message_bytes: int) -> Any:
    """A grpc.aio server on host:port serving the v2 service; returns it (stop with .stop(grace))."""
    grpc, _, _ = _modules()
    s = state.settings
    server = grpc.aio.server(options=server_options(s, message_limit(s, max_message_bytes)),
                             maximum_concurrent_rpcs=s.grpc_max_concurrent_rpcs)
    server.add_generic_rpc_handlers((method_handlers(build_service(state, Trimmer())()),))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot listen for gRPC on {host}:{port}")
    await server.start()
    log.info("gRPC KServe v2 on %s:%d", host, bound)
    return server

