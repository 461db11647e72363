"""A deliberately misbehaving gRPC client, written as raw HTTP/2 frames (RFC 9113) so that it can
do what no well-behaved client library does: open streams whose request message announces
megabytes and never finishes, or calls that send only their headers. Used by `slc bench
hostile` and tests/serving/test_grpc_limits.py against `slc serve --grpc-port`.

Only what an attacker needs: the preface, SETTINGS (and their ACK), HEADERS as HPACK literals
without Huffman coding, DATA; incoming frames are read and dropped (SETTINGS and PING answered)
so that the server keeps the connection open until `close()`.
"""
from __future__ import annotations

import socket
import struct
import threading
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
INFER = "/inference.GRPCInferenceService/ModelInfer"


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream & 0x7FFFFFFF) + payload


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out, value = bytearray([first | limit]), value - limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def hpack(headers: list[tuple[str, str]]) -> bytes:
    """Header block of literal fields without indexing, new names, no Huffman coding."""
    out = bytearray()
    for name, value in headers:
        out += b"\x00" + _hpack_int(len(name), 7) + name.encode() + _hpack_int(len(value), 7) + value.encode()
    return bytes(out)


def call_headers(host: str, path: str = INFER) -> bytes:
    return hpack([(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", host),
                  ("content-type", "application/grpc"), ("te", "trailers")])


class RawConnection:
    """One HTTP/2 connection to a gRPC server; streams are opened with odd ids 1, 3, 5, ..."""

    def __init__(self, host: str, port: int, timeout: float = 10.0):
        self.host = f"{host}:{port}"
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send_lock = threading.Lock()
        self.next_stream = 1
        self.opened: list[int] = []
        self.closed = threading.Event()
        self.ended: set[int] = set()  # streams the server reset (RST_STREAM) or ended (END_STREAM)
        self.goaway = False
        # a large connection window of our own (the server's data is dropped anyway)
        self.send(PREFACE + frame(SETTINGS, 0, 0) + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 30)))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def send(self, data: bytes) -> None:
        with self._send_lock:
            self.sock.sendall(data)

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed by the server")
            buf += chunk
        return bytes(buf)

    def _read(self) -> None:
        try:
            while True:
                head = self._recv_exact(9)
                length, kind, flags = int.from_bytes(head[:3], "big"), head[3], head[4]
                stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
                payload = self._recv_exact(length)
                if kind == SETTINGS and not flags & ACK:
                    self.send(frame(SETTINGS, ACK, 0))
                elif kind == PING and not flags & ACK:
                    self.send(frame(PING, ACK, 0, payload))
                elif kind == RST_STREAM or (kind in (HEADERS, DATA) and flags & END_STREAM):
                    self.ended.add(stream)
                elif kind == GOAWAY:
                    self.goaway = True
        except OSError:
            pass
        finally:
            self.closed.set()

    def open_call(self, announce: int = 0, send: int = 0, chunk: int = 16384) -> int:
        """A ModelInfer call: its headers, then (when `announce`) a message prefix announcing
        `announce` bytes followed by `send` of them; the call is never finished. Its stream id."""
        stream, self.next_stream = self.next_stream, self.next_stream + 2
        self.opened.append(stream)
        out = [frame(HEADERS, END_HEADERS, stream, call_headers(self.host))]
        if announce:
            body = b"\x00" + struct.pack(">I", announce) + b"\x00" * send
            out += [frame(DATA, 0, stream, body[i:i + chunk]) for i in range(0, len(body), chunk)]
        self.send(b"".join(out))
        return stream

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._reader.join(5)


def open_stalled_streams(host: str, port: int, streams: int, announce: int, send: int,
                         per_connection: int = 10) -> list[RawConnection]:
    """`streams` calls, `per_connection` per connection, each announcing `announce` bytes and
    sending `send` of them, then stalling. Errors on one connection (refused, reset) are the
    server defending itself: the connection is kept for the caller to close."""
    conns = []
    for start in range(0, streams, per_connection):
        try:
            conn = RawConnection(host, port)
        except OSError:
            continue
        conns.append(conn)
        for _ in range(min(per_connection, streams - start)):
            try:
                conn.open_call(announce, send)
            except OSError:
                break
    return conns


def open_header_only_calls(host: str, port: int, calls: int, per_connection: int = 100) -> list[RawConnection]:
    """`calls` calls that send only their headers (no message, never ended)."""
    return open_stalled_streams(host, port, calls, 0, 0, per_connection)


def close_all(conns: list[RawConnection]) -> None:
    for c in conns:
        c.close()


def wait_closed(conns: list[RawConnection], timeout: float) -> int:
    """How many of the connections the server closed (or sent GOAWAY on) within `timeout` s."""
    deadline = time.monotonic() + timeout
    for c in conns:
        c.closed.wait(max(0.0, deadline - time.monotonic()))
    return sum(c.closed.is_set() or c.goaway for c in conns)


def open_streams(conns: list[RawConnection]) -> int:
    """Calls the server has not ended yet."""
    return sum(len(set(c.opened) - c.ended) for c in conns)
