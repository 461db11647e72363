"""The load client: target checks (loopback unless allowed), endpoint requests encoded once,
and three transports: raw keep-alive HTTP/1.1 over asyncio streams (the default: far less
client CPU per request), aiohttp, and one grpc.aio channel for the KServe v2 gRPC endpoint
(grpcio and tritonclient come with the optional extra slc[grpc]). Never imports torch."""
from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from dataclasses import dataclass, field
from typing import Optional, Sequence
from urllib.parse import quote, urlsplit

import numpy as np
import orjson

TRIVIAL_ENDPOINT = "live"
ENDPOINT_NAMES = ("detect", "softmax", "topk", "topk_exact", "topk_index", "live", "model", "v2", "v2_binary", "grpc")
V2_ENDPOINTS = ("v2", "v2_binary", "grpc")  # KServe v2: they name the model and take the class as an integer id
GRPC_ENDPOINTS = ("grpc",)  # sent over gRPC (their own transport), not HTTP
GRPC_EXTRA = "pip install 'slc[grpc]'"


def _dumps(obj) -> bytes:
    return orjson.dumps(obj)


loads = orjson.loads


class RemoteTargetError(ValueError):
    """The target is not a loopback address and --allow-remote was not given."""


def normalize_url(url: str) -> str:
    """`host:port` or `:port` -> http://host:port (no trailing slash); URLs pass unchanged."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + (url if not url.startswith(":") else "127.0.0.1" + url)
    return url.rstrip("/")


def check_target(url: str, allow_remote: bool = False) -> tuple[str, int]:
    """Resolve the URL's host; refuse anything that is not loopback unless allowed.

    Returns (host, port). Resolution (not string matching) decides: a name that resolves to
    any non-loopback address is refused.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", ""):
        raise ValueError(f"only http:// targets are supported, got {url!r}")
    host = parts.hostname
    if not host:
        raise ValueError(f"no host in {url!r}")
    port = parts.port or 80
    if allow_remote:
        return host, port
    try:
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise RemoteTargetError(f"cannot resolve {host!r} ({exc}); refusing without --allow-remote") from exc
    addresses = {info[4][0] for info in infos}
    remote = []
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if not ip.is_loopback:
            remote.append(address)
    if remote or not addresses:
        raise RemoteTargetError(
            f"{host!r} resolves to non-loopback address(es) {sorted(remote)}; "
            "load tests only target 127.0.0.0/8, ::1 or localhost unless --allow-remote is given"
        )
    return host, port


def check_endpoints(names: Sequence[str], grpc_port: Optional[int] = None) -> None:
    """Fail before the run (ValueError) on an unknown endpoint, or on grpc without the port to send it to."""
    for name in names:
        if name not in ENDPOINT_NAMES:
            raise ValueError(f"unknown endpoint {name!r}; choose from {', '.join(ENDPOINT_NAMES)}")
    if grpc_port is None and any(name in GRPC_ENDPOINTS for name in names):
        raise ValueError("the grpc endpoint needs the server's gRPC port (grpc_port=, --grpc-port)")


def grpc_modules():
    """grpcio and tritonclient's generated KServe v2 messages, imported only when a run uses gRPC:
    they are the optional extra slc[grpc], and every other endpoint must work without them."""
    try:
        import grpc
        from tritonclient.grpc import service_pb2
    except ImportError as exc:
        raise ImportError(f"the grpc endpoint needs grpcio and tritonclient[grpc] ({exc}): {GRPC_EXTRA}") from None
    return grpc, service_pb2


@dataclass
class V2Target:
    """What KServe v2 requests name: the model (the bundle's name) and the class as an integer id."""

    model: str
    class_id: int

    @property
    def path(self) -> str:
        return f"/v2/models/{quote(self.model, safe='')}/infer"


@dataclass
class EndpointSpec:
    """One endpoint of the mix: its name, method, path and a pool of pre-encoded bodies
    (for grpc: serialized ModelInferRequests, sent on the gRPC pool)."""

    name: str
    method: str
    path: str
    bodies: list[bytes]
    raw_requests: list[bytes] = field(default_factory=list)  # full HTTP/1.1 requests
    headers: list[dict] = field(default_factory=list)  # per body: Content-Type and friends (aiohttp)
    transport: str = "http"  # "http" or "grpc": which pool sends it


def endpoint_request(name: str, class_: str, inputs: list, k: int = 10,
                     v2: Optional[V2Target] = None) -> tuple[str, str, Optional[dict]]:
    """(method, path, json body) of one JSON endpoint of docs/api.md (v2_binary and grpc are not JSON:
    see encode_http and grpc_infer_request)."""
    cls = quote(str(class_), safe="")
    if name == "detect":
        return "POST", f"/v1/classes/{cls}/detect", {"inputs": inputs}
    if name == "softmax":
        return "POST", f"/v1/classes/{cls}/softmax", {"inputs": inputs}
    if name in ("topk", "topk_exact"):
        return "POST", "/v1/topk", {"inputs": inputs, "k": k, "mode": "exact"}
    if name == "topk_index":
        return "POST", "/v1/topk", {"inputs": inputs, "k": k, "mode": "index"}
    if name == "live":
        return "GET", "/v1/health/live", None
    if name == "model":
        return "GET", "/v1/model", None
    if name == "v2":
        if v2 is None:
            raise ValueError("the v2 endpoint needs the model name and class id (v2=V2Target(...))")
        return "POST", v2.path, v2_json_body(np.asarray(inputs, dtype=np.float64), v2.class_id)
    raise ValueError(f"unknown endpoint {name!r}; choose from {', '.join(ENDPOINT_NAMES)}")


def v2_json_body(x: np.ndarray, class_id: int) -> dict:
    """KServe v2 JSON infer: flat row-major tensors, one class id per input (the same id for all)."""
    return {"inputs": [
        {"name": "input", "datatype": "FP32", "shape": list(x.shape), "data": x.reshape(-1).tolist()},
        {"name": "class_id", "datatype": "INT64", "shape": [len(x)], "data": [int(class_id)] * len(x)}]}


def _v2_tensors(x: np.ndarray, class_id: int) -> tuple[bytes, bytes]:
    """The raw little-endian input and class_id tensors, the bytes both binary protocols carry."""
    return np.ascontiguousarray(x, dtype="<f4").tobytes(), np.full(len(x), class_id, dtype="<i8").tobytes()


def v2_binary_body(x: np.ndarray, class_id: int) -> tuple[bytes, dict]:
    """KServe v2's binary tensor extension as tritonclient.http sends it: a JSON header of L bytes
    (sizes instead of data, outputs asked back binary too), then the raw tensors in input order.
    Returns (body, headers); the header length travels in Inference-Header-Content-Length."""
    raw_x, raw_ids = _v2_tensors(x, class_id)
    header = _dumps({
        "inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                    "parameters": {"binary_data_size": len(raw_x)}},
                   {"name": "class_id", "datatype": "INT64", "shape": [len(x)],
                    "parameters": {"binary_data_size": len(raw_ids)}}],
        "outputs": [{"name": n, "parameters": {"binary_data": True}} for n in ("logit", "match")]})
    return header + raw_x + raw_ids, {"Content-Type": "application/octet-stream",
                                      "Inference-Header-Content-Length": str(len(header))}


def grpc_infer_request(x: np.ndarray, v2: V2Target) -> bytes:
    """A serialized ModelInferRequest with raw_input_contents (what tritonclient.grpc sends):
    serialized once here so the run spends no client CPU on protobuf."""
    _, pb = grpc_modules()
    request = pb.ModelInferRequest(model_name=v2.model)
    request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    request.inputs.add(name="class_id", datatype="INT64", shape=[len(x)])
    request.outputs.add(name="logit")
    request.outputs.add(name="match")
    request.raw_input_contents.extend(_v2_tensors(x, v2.class_id))
    return request.SerializeToString()


def grpc_infer_method() -> str:
    """The ModelInfer method path, from tritonclient's compiled .proto rather than spelled by hand."""
    _, pb = grpc_modules()
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    return f"/{service.full_name}/{service.methods_by_name['ModelInfer'].name}"


def encode_http(name: str, class_: str, x: np.ndarray, k: int = 10,
                v2: Optional[V2Target] = None) -> tuple[str, str, Optional[bytes], dict]:
    """(method, path, body or None, headers) of one HTTP endpoint with the inputs x [N, ...]."""
    if name == "v2_binary":
        if v2 is None:
            raise ValueError("the v2_binary endpoint needs the model name and class id (v2=V2Target(...))")
        return ("POST", v2.path, *v2_binary_body(x, v2.class_id))
    method, path, obj = endpoint_request(name, class_, x.tolist(), k, v2)
    if obj is None:
        return method, path, None, {}
    return method, path, _dumps(obj), {"Content-Type": "application/json"}


def _raw_request(method: str, path: str, host: str, port: int, body: Optional[bytes],
                 headers: Optional[dict] = None) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
    if body is not None:
        head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()) + f"Content-Length: {len(body)}\r\n"
    return (head + "\r\n").encode("latin-1") + (body or b"")


def model_input_info(model: dict) -> tuple[list[int], Optional[str]]:
    """Input shape (without batch) and a default class from GET /v1/model, tolerant of nesting."""
    holders = [h for h in (model, model.get("manifest"), model.get("model")) if isinstance(h, dict)]
    shape = None
    for holder in holders:
        spec = holder.get("input")
        if isinstance(spec, dict) and isinstance(spec.get("shape"), list):
            shape = spec["shape"]
            break
        if isinstance(holder.get("input_shape"), list):
            shape = holder["input_shape"]
            break
    if shape is None:
        raise ValueError(f"GET /v1/model has no input shape: keys {sorted(model)}")
    shape = [int(s) for s in shape if s not in (None, -1, "N", "batch")]
    default_class = None
    for holder in holders:
        classes = holder.get("classes")
        if isinstance(classes, list) and classes:
            default_class = str(classes[0]) if not isinstance(classes[0], dict) else str(
                classes[0].get("name", classes[0].get("id", 0)))
            break
    return shape, default_class


_DECIMAL = re.compile(r"[0-9]+")


def _class_names(model: dict) -> list[str]:
    """The class names GET /v1/model shows (the server lists the first ones as `classes_preview`)."""
    for holder in (model, model.get("manifest") or {}, model.get("model") or {}):
        for key in ("classes", "classes_preview"):
            classes = holder.get(key)
            if isinstance(classes, list) and classes:
                return [str(c.get("name", c.get("id"))) if isinstance(c, dict) else str(c) for c in classes]
    return []


def v2_target(model: dict, class_: str) -> V2Target:
    """The model name and integer class id v2 requests need, from GET /v1/model. A name is looked
    up in the classes it shows, else a decimal id is taken as is (the server's rule: a name wins)."""
    name = model.get("name") or (model.get("manifest") or {}).get("name")
    if not name:
        raise ValueError(f"GET /v1/model has no model name: keys {sorted(model)}")
    names = _class_names(model)
    if str(class_) in names:
        return V2Target(str(name), names.index(str(class_)))
    if _DECIMAL.fullmatch(str(class_)):
        return V2Target(str(name), int(class_))
    raise ValueError(f"class {class_!r} is not among the classes GET /v1/model shows; "
                     "give its integer id for the v2, v2_binary and grpc endpoints")


def build_endpoints(names: Sequence[str], class_: str, input_shape: Sequence[int], host: str, port: int,
                    batch: int = 1, pool: int = 8, k: int = 10, seed: int = 0,
                    v2: Optional[V2Target] = None) -> list[EndpointSpec]:
    """Encode `pool` request bodies per endpoint once (random inputs of the bundle's shape), so the
    run spends its CPU on sending, not encoding. Every endpoint gets the same inputs."""
    rng = np.random.default_rng(seed)
    arrays = [np.round(rng.standard_normal((batch, *input_shape)), 4) for _ in range(pool)]
    specs = []
    for name in names:
        if name in GRPC_ENDPOINTS:
            if v2 is None:
                raise ValueError("the grpc endpoint needs the model name and class id (v2=V2Target(...))")
            specs.append(EndpointSpec(name=name, method="POST", path=grpc_infer_method(),
                                      bodies=[grpc_infer_request(x, v2) for x in arrays], transport="grpc"))
        else:
            specs.append(_http_spec(name, class_, arrays, host, port, k, v2))
    return specs


def _http_spec(name: str, class_: str, arrays: list, host: str, port: int, k: int,
               v2: Optional[V2Target]) -> EndpointSpec:
    """One HTTP endpoint's bodies and full raw requests (a GET has one, bodiless)."""
    encoded = [encode_http(name, class_, x, k, v2) for x in arrays]
    method, path, first, _ = encoded[0]
    if first is None:
        encoded = encoded[:1]
    spec = EndpointSpec(name=name, method=method, path=path, bodies=[e[2] or b"" for e in encoded],
                        headers=[e[3] for e in encoded])
    spec.raw_requests = [_raw_request(method, path, host, port, body, headers) for _, _, body, headers in encoded]
    return spec


# ----------------------------------------------------------------------------------------------
# transports


class HttpError(Exception):
    pass


class RawHttpPool:
    """Keep-alive HTTP/1.1 connections over asyncio streams; at most `size` requests in flight."""

    def __init__(self, host: str, port: int, size: int):
        self.host, self.port = host, port
        self._sem = asyncio.Semaphore(size)
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _connect(self):
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer

    async def acquire_slot(self):
        await self._sem.acquire()

    async def roundtrip(self, spec: EndpointSpec, body_index: int) -> int:
        """Send one request on an idle connection (slot already held); returns the status."""
        conn = self._idle.pop() if self._idle else await self._connect()
        reader, writer = conn
        reusable = False
        try:
            writer.write(spec.raw_requests[body_index])
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length, chunked, close = None, False, False
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"transfer-encoding" and b"chunked" in value.lower():
                    chunked = True
                elif name == b"connection" and b"close" in value.lower():
                    close = True
            if chunked:
                while True:
                    size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                    await reader.readexactly(size + 2)
                    if size == 0:
                        break
            elif length is not None:
                await reader.readexactly(length)
            else:
                await reader.read()
                close = True
            reusable = not close
            return status
        finally:
            if reusable:
                self._idle.append(conn)
            else:
                writer.close()

    def release_slot(self):
        self._sem.release()

    async def close(self):
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


class AiohttpPool:
    """The same interface over aiohttp (selectable with client='aiohttp')."""

    def __init__(self, host: str, port: int, size: int):
        import aiohttp

        self._base = f"http://{host}:{port}"
        self._sem = asyncio.Semaphore(size)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=size, force_close=False),
            timeout=aiohttp.ClientTimeout(total=None),
            skip_auto_headers=("User-Agent",),
        )

    async def acquire_slot(self):
        await self._sem.acquire()

    async def roundtrip(self, spec: EndpointSpec, body_index: int) -> int:
        data = spec.bodies[body_index] if spec.method == "POST" else None
        headers = spec.headers[body_index] if data is not None else None
        async with self._session.request(spec.method, self._base + spec.path, data=data, headers=headers) as resp:
            await resp.read()
            return resp.status

    def release_slot(self):
        self._sem.release()

    async def close(self):
        await self._session.close()


# gRPC status code name -> the HTTP status the error accounting knows (the server's own mapping, inverted)
GRPC_STATUS = {"OK": 200, "INVALID_ARGUMENT": 422, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429,
               "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504, "UNAUTHENTICATED": 401, "CANCELLED": 499}


class GrpcPool:
    """The RawHttpPool interface over one grpc.aio channel (HTTP/2 multiplexes the requests on it);
    at most `size` requests in flight. Bodies are serialized ModelInferRequests, sent and answered
    as bytes: no protobuf work per request. gRPC status codes become HTTP-like statuses."""

    def __init__(self, host: str, port: int, size: int, max_message_bytes: int = 256 * 1024 * 1024):
        grpc, _ = grpc_modules()
        self._error = grpc.aio.AioRpcError
        self._sem = asyncio.Semaphore(size)
        self._channel = grpc.aio.insecure_channel(
            f"{host}:{port}" if ":" not in host else f"[{host}]:{port}",
            options=[("grpc.max_send_message_length", max_message_bytes),
                     ("grpc.max_receive_message_length", max_message_bytes)])
        self._calls: dict[str, object] = {}

    async def acquire_slot(self):
        await self._sem.acquire()

    async def roundtrip(self, spec: EndpointSpec, body_index: int) -> int:
        call = self._calls.get(spec.path)
        if call is None:  # no serializers: the pre-serialized bytes go out as they are
            call = self._calls[spec.path] = self._channel.unary_unary(spec.path)
        try:
            await call(spec.bodies[body_index])
        except self._error as exc:
            return GRPC_STATUS.get(exc.code().name, 500)
        return 200

    def release_slot(self):
        self._sem.release()

    async def close(self):
        await self._channel.close()



async def get_json(host: str, port: int, path: str) -> dict:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
        data = await reader.read()
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head[9:12])
    if b"transfer-encoding: chunked" in head.lower():
        body = dechunk(body)
    if status != 200:
        raise HttpError(f"GET {path} -> {status}: {body[:200]!r}")
    return loads(body)


def dechunk(data: bytes) -> bytes:
    out, pos = bytearray(), 0
    while True:
        end = data.index(b"\r\n", pos)
        size = int(data[pos:end].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += data[end + 2:end + 2 + size]
        pos = end + 2 + size + 2

