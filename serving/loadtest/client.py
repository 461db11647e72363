"""The load client: target checks (loopback unless allowed), endpoint requests encoded once,
and two transports: raw keep-alive HTTP/1.1 over asyncio streams (the default: far less
client CPU per request) and aiohttp. Never imports torch."""
from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass, field
from typing import Optional, Sequence
from urllib.parse import quote, urlsplit

import numpy as np
import orjson

TRIVIAL_ENDPOINT = "live"
ENDPOINT_NAMES = ("detect", "softmax", "topk", "topk_exact", "topk_index", "live", "model")


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


@dataclass
class EndpointSpec:
    """One endpoint of the mix: its name, method, path and a pool of pre-encoded bodies."""

    name: str
    method: str
    path: str
    bodies: list[bytes]
    raw_requests: list[bytes] = field(default_factory=list)  # full HTTP/1.1 requests


def endpoint_request(name: str, class_: str, inputs: list, k: int = 10) -> tuple[str, str, Optional[dict]]:
    """(method, path, json body) of one endpoint of docs/api.md."""
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
    raise ValueError(f"unknown endpoint {name!r}; choose from {', '.join(ENDPOINT_NAMES)}")


def _raw_request(method: str, path: str, host: str, port: int, body: Optional[bytes]) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return (head + "\r\n").encode("latin-1") + (body or b"")


def model_input_info(model: dict) -> tuple[list[int], Optional[str]]:
    """Input shape (without batch) and a default class from GET /v1/model, tolerant of nesting."""
    shape = None
    for holder in (model, model.get("manifest") or {}, model.get("model") or {}):
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
    for holder in (model, model.get("manifest") or {}, model.get("model") or {}):
        classes = holder.get("classes")
        if isinstance(classes, list) and classes:
            default_class = str(classes[0]) if not isinstance(classes[0], dict) else str(
                classes[0].get("name", classes[0].get("id", 0)))
            break
    return shape, default_class


def build_endpoints(names: Sequence[str], class_: str, input_shape: Sequence[int], host: str, port: int,
                    batch: int = 1, pool: int = 8, k: int = 10, seed: int = 0) -> list[EndpointSpec]:
    """Encode `pool` request bodies per endpoint once (random inputs of the bundle's shape)."""
    rng = np.random.default_rng(seed)
    inputs_pool = [np.round(rng.standard_normal((batch, *input_shape)), 4).tolist() for _ in range(pool)]
    specs = []
    for name in names:
        method, path, body_obj = endpoint_request(name, class_, inputs_pool[0], k)
        bodies = []
        if body_obj is not None:
            for inputs in inputs_pool:
                _, _, obj = endpoint_request(name, class_, inputs, k)
                bodies.append(_dumps(obj))
        spec = EndpointSpec(name=name, method=method, path=path, bodies=bodies or [b""])
        spec.raw_requests = [_raw_request(method, path, host, port, b if body_obj is not None else None)
                             for b in spec.bodies]
        specs.append(spec)
    return specs


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
        headers = {"Content-Type": "application/json"} if data is not None else None
        async with self._session.request(spec.method, self._base + spec.path, data=data, headers=headers) as resp:
            await resp.read()
            return resp.status

    def release_slot(self):
        self._sem.release()

    async def close(self):
        await self._session.close()



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

