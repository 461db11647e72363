"""KServe v2 over gRPC (`inference.GRPCInferenceService`, the protocol Triton speaks), beside HTTP:
`slc serve --grpc-port 8001` (needs `pip install 'slc[grpc]'`; `--no-http` serves gRPC alone). `tritonclient.grpc` works
against it unmodified.

Same models as /v2 over HTTP (serving/core/v2.py): `<bundle name>` (input + class_id -> logit,
match) and `<bundle name>-full` (input -> logits); same engine and batch queue; inputs as
`raw_input_contents` (what tritonclient sends) or typed `contents` (serving/codecs/grpc_tensors.py);
outputs as `raw_output_contents`. Errors are the core's (serving/errors.py), their kind mapped to a
gRPC status code (GRPC_CODES below) with the error's code in the message; calls are counted in
/metrics with endpoint `grpc:<method>` and the status code's name. The protocol's message classes come from tritonclient's generated
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

from serving.codecs.grpc_tensors import decode_tensors
from serving.codecs.v2_tensors import tensor_bytes
from serving.core.deadlines import within
from serving.core.v2 import SERVER_VERSION, VERSION, model_kind, model_metadata_of, run_model
from serving.errors import DeadlineExceeded, InvalidInput, Kind, NotFound, RequestTimeout, SlcError

log = logging.getLogger(__name__)

# the error's kind (serving/errors.py) -> gRPC status code name
GRPC_CODES = {Kind.BAD_REQUEST: "INVALID_ARGUMENT", Kind.UNAUTHENTICATED: "UNAUTHENTICATED",
               Kind.FORBIDDEN: "PERMISSION_DENIED", Kind.NOT_FOUND: "NOT_FOUND", Kind.CONFLICT: "FAILED_PRECONDITION",
               Kind.TIMEOUT: "DEADLINE_EXCEEDED",
               Kind.TOO_LARGE: "RESOURCE_EXHAUSTED", Kind.UNSUPPORTED_MEDIA: "INVALID_ARGUMENT",
               Kind.INVALID: "INVALID_ARGUMENT", Kind.OVERLOADED: "RESOURCE_EXHAUSTED", Kind.UNAVAILABLE: "UNAVAILABLE",
               Kind.DEADLINE: "DEADLINE_EXCEEDED", Kind.STORAGE_FULL: "RESOURCE_EXHAUSTED", Kind.INTERNAL: "INTERNAL"}


def _modules():
    try:
        import grpc
        from tritonclient.grpc import service_pb2, service_pb2_grpc
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(f"--grpc-port needs grpcio and tritonclient[grpc] ({exc}): pip install 'slc[grpc]'") from None
    return grpc, service_pb2, service_pb2_grpc


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
    (-> DEADLINE_EXCEEDED); a call that ends without one is INVALID_ARGUMENT."""
    grpc, _, _ = _modules()
    try:
        message = await asyncio.wait_for(context.read(), timeout)
    except asyncio.TimeoutError:
        raise RequestTimeout(f"the request message did not arrive within {timeout:g} s") from None
    if message is grpc.aio.EOF:
        raise InvalidInput("the call ended without a request message", code="validation_error")
    return message


class Calls:
    """How every call is run: within the request deadline, errors as status codes, counted in
    /metrics as endpoint `grpc:<method>` with its gRPC status code name."""

    def __init__(self, state, trimmer: Optional[Trimmer] = None):
        self.state = state
        self.trimmer = trimmer

    def engine(self, model: str):
        """The engine of the model a v2 name is of: NotReady (-> UNAVAILABLE) while loading, NotFound for
        a name no served model has."""
        return self.state.engine_for(model)

    async def run(self, method: str, context, work, read=None, model: Optional[str] = None):
        """work(request) within the request deadline; `read(context)` first (outside the deadline,
        as an HTTP body is read before it) for a call served as a stream."""
        grpc, _, _ = _modules()
        t0 = time.perf_counter()
        status, request = "OK", None
        try:
            request = await read(context) if read is not None else None
            return await self._within_deadline(work, request)
        except asyncio.CancelledError:  # the client cancelled, left, or its deadline passed
            status = "CANCELLED"
            raise
        except SlcError as exc:
            status = GRPC_CODES[exc.kind]
            self.state.metrics.reject(exc.code)
            await context.abort(getattr(grpc.StatusCode, status), f"{exc.code}: {exc}")
        except Exception as exc:  # an abort raises too: counted as what it was
            if not isinstance(exc, grpc.aio.AbortError):
                status = "INTERNAL"
                log.exception("grpc %s failed", method)
                await context.abort(grpc.StatusCode.INTERNAL, "internal error")
            raise
        finally:
            seconds = time.perf_counter() - t0
            self.state.metrics.observe_request(f"grpc:{method}", "POST", status, seconds)
            self._observe_model(method, model if model is not None else getattr(request, "model_name", None),
                                status, seconds)
            if self.trimmer is not None and read is not None:
                self.trimmer.poke()  # its buffers are freed: back to the system

    def _observe_model(self, method: str, name: Optional[str], status: str, seconds: float) -> None:
        """slc_model_requests_total for a call naming a served model (a v2 name `X-full` counts as X)."""
        models = getattr(self.state, "models", None)
        if not name or models is None:
            return
        if name not in models.models and name.endswith("-full"):
            name = name[:-5]
        if name in models.models:
            self.state.metrics.observe_model(name, f"grpc:{method}", status, seconds)

    async def _within_deadline(self, work, request):
        timeout = self.state.settings.request_timeout_s
        try:  # the request deadline, as the HTTP routes have it (queue and compute included)
            with within(timeout):
                return await work(request)
        except TimeoutError:
            raise DeadlineExceeded(f"request not answered within its deadline of {timeout:g} s") from None


async def infer(engine, request, pb):
    """One ModelInfer on the engine: the tensors decoded, the shared v2 model run, raw outputs."""
    if request.model_version not in ("", VERSION):
        raise NotFound(f"model version {request.model_version!r} does not exist", code="unknown_version")
    kind = model_kind(engine, request.model_name)
    limit = engine.settings.max_inputs * (engine.input_size + 1)
    asked = [(o.name, plain_parameters(o.parameters)) for o in request.outputs] or None
    outputs = await run_model(engine, kind, decode_tensors(request, limit, engine.settings.max_inputs), asked,
                              plain_parameters(request.parameters))
    response = pb.ModelInferResponse(model_name=request.model_name, model_version=VERSION, id=request.id)
    for name, (dtype, arr) in outputs.items():  # in the order asked
        response.outputs.add(name=name, datatype=dtype, shape=list(arr.shape))
        response.raw_output_contents.append(tensor_bytes(dtype, arr))
    return response


def plain_parameters(parameters) -> dict:
    """A protobuf map<string, InferParameter> as {key: bool | int | float | str} (the oneof that is set),
    the form the HTTP front reads from JSON, so both fronts check the same values."""
    out = {}
    for key, param in parameters.items():
        which = param.WhichOneof("parameter_choice")
        out[key] = getattr(param, which) if which is not None else None
    return out


def model_metadata(engine, name: str, pb):
    m = model_metadata_of(engine, model_kind(engine, name))

    def tensors(items: list[dict]) -> list:
        return [pb.ModelMetadataResponse.TensorMetadata(name=t["name"], datatype=t["datatype"], shape=t["shape"])
                for t in items]

    return pb.ModelMetadataResponse(name=m["name"], versions=m["versions"], platform=m["platform"],
                                    inputs=tensors(m["inputs"]), outputs=tensors(m["outputs"]))


def build_service(state, trimmer: Optional[Trimmer] = None):
    """The servicer class bound to the server's state (engine, metrics)."""
    _, pb, pb_grpc = _modules()
    calls = Calls(state, trimmer)

    class Service(pb_grpc.GRPCInferenceServiceServicer):
        async def ServerLive(self, request, context):
            return pb.ServerLiveResponse(live=True)

        async def ServerReady(self, request, context):
            return pb.ServerReadyResponse(ready=bool(state.is_ready and await state.device_ready()))

        async def ServerMetadata(self, request, context):
            return pb.ServerMetadataResponse(name="slc", version=SERVER_VERSION, extensions=["classification"])

        async def ModelReady(self, request, context):
            async def work(_):
                model_kind(calls.engine(request.name), request.name)
                return pb.ModelReadyResponse(ready=bool(state.is_ready and await state.device_ready()))
            return await calls.run("ModelReady", context, work, model=request.name)

        async def ModelMetadata(self, request, context):
            def work(_):
                return _aw(model_metadata(calls.engine(request.name), request.name, pb))
            return await calls.run("ModelMetadata", context, work, model=request.name)

        async def ModelInfer(self, request_iterator, context):
            """Served as a stream-unary call (the wire is the same as unary): the message is awaited
            here, within body_timeout_s, instead of for as long as the client likes."""
            async def read(ctx):
                return await read_message(ctx, state.settings.body_timeout_s)

            return await calls.run("ModelInfer", context, lambda request: infer(calls.engine(request.model_name), request, pb), read=read)

    return Service


async def _aw(value):
    return value


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


class GrpcFront:
    """The gRPC front on host:port, started and stopped by the core's Lifecycle (serving/main.py):
    it runs with or without the HTTP front."""

    def __init__(self, state, host: str, port: int, max_message_bytes: int):
        self.state, self.host, self.port, self.max_message_bytes = state, host, port, max_message_bytes
        self.server = None
        self.bound: Optional[int] = None

    async def start(self) -> None:
        """Listening before the model loads: it answers UNAVAILABLE until ready."""
        grpc, _, _ = _modules()
        s = self.state.settings
        server = grpc.aio.server(options=server_options(s, message_limit(s, self.max_message_bytes)),
                                 maximum_concurrent_rpcs=s.grpc_max_concurrent_rpcs)
        server.add_generic_rpc_handlers((method_handlers(build_service(self.state, Trimmer())()),))
        self.bound = server.add_insecure_port(f"{self.host}:{self.port}")
        if self.bound == 0:
            raise RuntimeError(f"cannot listen for gRPC on {self.host}:{self.port}")
        await server.start()
        self.server = server
        log.info("gRPC KServe v2 on %s:%d", self.host, self.bound)

    async def stop(self, grace_s: float) -> None:
        if self.server is not None:
            await self.server.stop(grace_s)
