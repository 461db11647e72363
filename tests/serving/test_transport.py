"""Transport limits and shutdown on a real `slc serve` process, spoken to over raw sockets:
headers that never finish, headers too large, malformed HTTP, a body that stops half-way, the
drain delay, and a request cut off by shutdown. Every refusal is the JSON envelope and counted."""
from __future__ import annotations

import json
import signal
import socket
import time
import weakref

import httpx
import pytest

from tests.serving.helpers import free_port, serve_process, wait_http_ready

pytestmark = pytest.mark.integration  # real processes and sockets


def _response(sock: socket.socket, timeout: float = 20.0) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one HTTP response read from a raw socket until it closes."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def _envelope(status: int, headers: dict, body: bytes, want_status: int, want_code: str) -> str:
    assert status == want_status, body
    assert headers["content-type"] == "application/json"
    err = json.loads(body)["error"]
    assert err["code"] == want_code and set(err) == {"code", "message"}
    return err["message"]


@pytest.fixture(scope="module")
def server(bundle_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("transport")
    port = free_port()
    proc = serve_process(bundle_path, tmp, port, SLC_HEADER_TIMEOUT_S="0.5", SLC_BODY_TIMEOUT_S="0.5",
                         SLC_MAX_HEADER_BYTES="2048")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(url, proc, timeout=120)
        yield url, port
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=20)


def test_headers_that_never_finish_get_408_and_the_connection_closes(server):
    _, port = server
    with _connect(port) as s:
        s.sendall(b"GET /v1/health/live HTTP/1.1\r\nHost: x\r\n")  # no blank line, ever
        assert "headers did not arrive" in _envelope(*_response(s), 408, "request_timeout")


def test_a_connection_that_never_sends_a_request_is_closed(server):
    _, port = server
    with _connect(port) as s:
        _envelope(*_response(s), 408, "request_timeout")


def test_headers_over_the_limit_get_431(server):
    _, port = server
    with _connect(port) as s:
        s.sendall(b"GET /v1/health/live HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 4096 + b"\r\n\r\n")
        assert "2048 bytes" in _envelope(*_response(s), 431, "headers_too_large")


def test_malformed_http_gets_a_json_400(server):
    _, port = server
    with _connect(port) as s:
        s.sendall(b"THIS IS NOT HTTP\r\n\r\n")
        _envelope(*_response(s), 400, "malformed_http")


def test_a_body_that_stops_half_way_gets_408(server):
    _, port = server
    with _connect(port) as s:
        s.sendall(b"POST /v1/classes/1/detect HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"inputs\": [[")
        assert "body did not arrive" in _envelope(*_response(s), 408, "request_timeout")


def test_protocol_refusals_are_counted(server):
    url, port = server
    with _connect(port) as s:
        s.sendall(b"\x00\x01 nonsense\r\n\r\n")
        _response(s)
    text = httpx.get(url + "/metrics", timeout=10).text
    assert 'slc_rejections_total{reason="malformed_http"}' in text
    assert 'slc_http_requests_total{endpoint="(protocol)",method="-",status="400"}' in text
    assert 'slc_rejections_total{reason="request_timeout"}' in text


def test_an_ordinary_keep_alive_client_is_unaffected(server):
    url, _ = server
    with httpx.Client(timeout=10) as c:
        for _ in range(3):
            assert c.get(url + "/v1/health/live").status_code == 200
            time.sleep(0.3)  # idle between requests is the keep-alive timeout's business, not the header timer's


def test_a_keep_alive_connection_idle_longer_than_the_header_timeout_is_not_refused(server):
    """No byte of a next request: the connection is idle, not slow (the header timeout is 0.5 s;
    the idle connection is the keep-alive timeout's to close, 5 s)."""
    _, port = server
    request = b"GET /v1/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
    with _connect(port) as s:
        s.sendall(request)
        assert _read_one(s)[0] == 200
        time.sleep(1.2)
        s.sendall(request)
        status, body = _read_one(s)
    assert status == 200, body


def test_headers_that_stall_on_a_kept_alive_connection_get_408(server):
    """After an answered request, a next request whose headers stop half-way is timed as the first."""
    _, port = server
    with _connect(port) as s:
        s.sendall(b"GET /v1/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_one(s)[0] == 200
        s.sendall(b"GET /v1/health/live HTTP/1.1\r\nHo")
        status, headers, body = _response(s)
    _envelope(status, headers, body, 408, "request_timeout")  # the keep-alive timeout would close without a word


def test_drain_delay_keeps_accepting_while_readiness_is_503(bundle_path, tmp_path):
    port = free_port()
    proc = serve_process(bundle_path, tmp_path, port, SLC_DRAIN_DELAY_S="3")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(url, proc, timeout=120)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert httpx.get(url + "/v1/health/ready", timeout=5).status_code == 503
        r = httpx.post(url + "/v1/classes/1/detect", json={"inputs": [[0.5] * 12]}, timeout=5)  # still accepted
        assert r.status_code == 200, r.text
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_request_cut_off_by_shutdown_gets_a_json_503(bundle_path, tmp_path):
    """A body still arriving when the grace period (request_timeout_s + 5 s) ends."""
    port = free_port()
    proc = serve_process(bundle_path, tmp_path, port, SLC_REQUEST_TIMEOUT_S="0.5", SLC_BODY_TIMEOUT_S="120")
    try:
        wait_http_ready(f"http://127.0.0.1:{port}", proc, timeout=120)
        with _connect(port) as s:
            s.sendall(b"POST /v1/classes/1/detect HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"inputs\": [[")
            time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            _envelope(*_response(s, timeout=30), 503, "shutting_down")
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def _request(method: str, path: str, body: bytes = b"", extra: bytes = b"") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + extra + b"\r\n" + body


_LEFTOVER: "weakref.WeakKeyDictionary[socket.socket, bytes]" = weakref.WeakKeyDictionary()


def _read_one(sock: socket.socket, timeout: float = 20.0) -> tuple[int, bytes]:
    """The next response (Content-Length framed) on a kept-alive connection: (status, body). Bytes
    read past it (the next answer to pipelined requests can come in the same recv) are kept for
    the next call."""
    sock.settimeout(timeout)
    data = _LEFTOVER.pop(sock, b"")
    while b"\r\n\r\n" not in data:
        data += _recv(sock, data)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(rest) < length:
        rest += _recv(sock, data + rest)
    _LEFTOVER[sock] = rest[length:]
    return int(head.split()[1]), rest[:length]


def _recv(sock: socket.socket, so_far: bytes) -> bytes:
    chunk = sock.recv(65536)
    if not chunk:  # (recv returns b"" for ever once the server has closed: fail, do not spin)
        raise ConnectionError(f"the server closed the connection mid-response; received {so_far[:300]!r}")
    return chunk


def test_a_body_still_arriving_after_an_early_answer_is_not_counted_as_headers(server):
    """A 1 MB body to an unknown route gets its 404 before the body is read; the next request on
    the same connection is answered (once 431, its bytes taken for headers)."""
    _, port = server
    with _connect(port) as s:
        s.sendall(_request("POST", "/v1/nope", b"x" * (1 << 20)))
        assert _read_one(s)[0] == 404
        s.sendall(b"GET /v1/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_one(s) == (200, b'{"status":"live"}')


def test_pipelined_requests_with_a_large_body_are_both_answered(server):
    _, port = server
    small = json.dumps({"inputs": [[0.5] * 12]}).encode()
    large = json.dumps({"inputs": [[0.5] * 12], "threshold": 0.0}).encode() + b" " * 200_000  # JSON allows trailing space
    with _connect(port) as s:
        s.sendall(_request("POST", "/v1/classes/1/detect", small) + _request("POST", "/v1/classes/1/detect", large))
        assert _read_one(s)[0] == 200
        status, body = _read_one(s)
        assert status == 200, body


def test_a_chunked_body_over_the_limit_gets_413_and_connection_close(server):
    _, port = server
    with _connect(port) as s:
        s.sendall(b"POST /v1/classes/1/detect HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"[" * 65536
        try:
            for _ in range(200):  # 13 MB offered; the server answers once it has seen 8 MiB
                s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        except OSError:
            pass  # the server closed its side
        status, headers, body = _response(s)
    assert status == 413 and headers.get("connection") == "close"
    assert json.loads(body)["error"]["code"] == "payload_too_large"


def test_a_client_that_keeps_sending_after_413_is_cut_off(server):
    """The lingering close that lets the client read its 413 is bounded: a client that never
    stops sending is disconnected (the server's limit is 5 s; the test allows 20)."""
    _, port = server
    with _connect(port) as s:
        s.sendall(b"POST /v1/classes/1/detect HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (65536, b"[" * 65536)
        cut_off = False
        end = time.monotonic() + 20
        while time.monotonic() < end:
            try:
                s.sendall(chunk)
            except OSError:
                cut_off = True
                break
    assert cut_off
