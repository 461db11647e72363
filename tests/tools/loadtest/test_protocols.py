"""The load client's protocol endpoints (v2 JSON, v2 binary, gRPC) beside detect: mixed runs
against a real `slc serve --grpc-port` answer only 200s, and the pre-encoded requests, sent once
by hand, give the logit the /v1 detect route gives for the same inputs and class (the
independent truth). Plus the mistakes that fail before a run."""
from __future__ import annotations

import json
import socket
import sys
from types import SimpleNamespace

import numpy as np
import orjson
import pytest

from tools import loadtest as lt
from tools.loadtest import client as lc
from tests.serving.helpers import free_port, serve_process, slc, wait_http_ready

try:
    import grpc
    from tritonclient.grpc import service_pb2
    GRPC_MISSING = None
except ImportError as exc:  # pragma: no cover - depends on the install
    GRPC_MISSING = f"grpcio/tritonclient not importable ({exc}): pip install 'slc[grpc]'"

needs_grpc = pytest.mark.skipif(GRPC_MISSING is not None, reason=GRPC_MISSING or "")
HTTP_PROTOCOLS = ["detect", "v2", "v2_binary"]


# ---------------------------------------------------------------------------------------------
# mistakes, without a server


def test_grpc_without_port_is_one_clear_error(tmp_path, capsys):
    with pytest.raises(ValueError, match="grpc_port"):
        lt.run_loadtest("http://127.0.0.1:9", ["detect", "grpc"], concurrency=1, duration=0.1, warmup=0)
    out = tmp_path / "out"
    assert slc("loadtest", "--url", "127.0.0.1:9", "--endpoint", "detect,grpc", "--duration", "0.1",
               "--out", out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--grpc-port" in err[0]
    assert not out.exists() or not any(out.iterdir())


def test_missing_grpc_extra_names_the_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "grpc", None)  # `import grpc` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'slc\[grpc\]'"):
        lc.grpc_modules()
    assert slc("loadtest", "--url", "127.0.0.1:9", "--endpoint", "grpc", "--grpc-port", "9", "--duration", "0.1",
               "--out", tmp_path / "out") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'slc[grpc]'" in err[0]


def test_v2_target_resolves_names_and_ids():
    model = {"name": "m", "manifest": {"classes_preview": ["cat", "dog", "7"]}}
    assert lc.v2_target(model, "dog") == lc.V2Target("m", 1)
    assert lc.v2_target(model, "7") == lc.V2Target("m", 2)  # a name wins over an id, as on the server
    assert lc.v2_target(model, "31") == lc.V2Target("m", 31)
    assert lc.v2_target({"name": "a b"}, "0").path == "/v2/models/a%20b/infer"
    with pytest.raises(ValueError, match="integer id"):
        lc.v2_target(model, "zebra")


def test_v2_binary_body_is_header_then_raw_tensors():
    x = np.arange(6, dtype=np.float64).reshape(2, 3) / 8
    body, headers = lc.v2_binary_body(x, 5)
    n = int(headers["Inference-Header-Content-Length"])
    head = json.loads(body[:n])
    sizes = [t["parameters"]["binary_data_size"] for t in head["inputs"]]
    assert [t["shape"] for t in head["inputs"]] == [[2, 3], [2]] and sizes == [24, 16]
    assert len(body) == n + sum(sizes) and headers["Content-Type"] == "application/octet-stream"
    np.testing.assert_array_equal(np.frombuffer(body[n:n + 24], "<f4").reshape(2, 3), x)
    np.testing.assert_array_equal(np.frombuffer(body[n + 24:], "<i8"), [5, 5])


# ---------------------------------------------------------------------------------------------
# against a real server (a subprocess of `slc serve`, with --grpc-port when grpc is installed)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from serving.bundle import synthetic

    tmp = tmp_path_factory.mktemp("lt-protocols")
    bundle = synthetic.build_synthetic_bundle(classes=50, dim=16, input_dim=8, seed=0, out=tmp / "bundle")
    port, grpc_port = free_port(), (free_port() if GRPC_MISSING is None else None)
    flags = ["--grpc-port", str(grpc_port)] if grpc_port is not None else []
    proc = serve_process(bundle, tmp, port, *flags)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(url, proc, timeout=120)
        yield SimpleNamespace(url=url, port=port, grpc_port=grpc_port)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except Exception:  # pragma: no cover
            proc.kill()


def _all_ok(report: dict, names: list[str]) -> None:
    assert list(report["endpoints"]) == names
    for name in names:
        ep = report["endpoints"][name]
        assert ep["requests"] > 0 and ep["ok"] == ep["requests"] and ep["errors"] == {}, (name, ep)


@pytest.mark.integration
@pytest.mark.parametrize("with_grpc", [False, pytest.param(True, marks=needs_grpc)], ids=["http", "http+grpc"])
def test_block_interleaved_run_over_protocols_only_200s(server, with_grpc):
    names = HTTP_PROTOCOLS + (["grpc"] if with_grpc else [])
    res = lt.run_loadtest(server.url, names, concurrency=2, duration=1.0, warmup=0.2, interleave="block",
                          block_s=0.125, grpc_port=server.grpc_port)
    _all_ok(res.report, names)
    assert res.report["v2"] == {"model": "synthetic-D50-d16-s0", "class_id": 0}


@pytest.mark.integration
@needs_grpc
def test_cli_request_interleaved_run_with_grpc_port(server, tmp_path):
    names = HTTP_PROTOCOLS + ["grpc"]
    assert slc("loadtest", "--url", server.url, "--endpoint", ",".join(names), "--grpc-port", server.grpc_port,
               "--class", "7", "--concurrency", "2", "--duration", "1", "--warmup", "0.2", "--out", tmp_path) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    _all_ok(report, names)
    assert report["v2"]["class_id"] == 7 and f"--grpc-port {server.grpc_port}" in report["command"]


@pytest.mark.integration
@needs_grpc
def test_unknown_class_id_is_404_on_every_protocol(server):
    """Out of range (50 classes): NOT_FOUND over gRPC is counted as 404, like the HTTP answers."""
    names = HTTP_PROTOCOLS + ["grpc"]
    res = lt.run_loadtest(server.url, names, class_="50", concurrency=1, duration=30, warmup=0, max_requests=8,
                          grpc_port=server.grpc_port)
    for name in names:
        ep = res.report["endpoints"][name]
        assert ep["ok"] == 0 and ep["errors"] == {"404": 2}, (name, ep)


def _send_raw(port: int, raw: bytes) -> tuple[int, dict, bytes]:
    """One pre-encoded HTTP/1.1 request, exactly the bytes the load run sends; (status, headers, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(raw)
        data = b""
        while b"\r\n\r\n" not in data:
            data += _recv(s)
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        while len(body) < int(headers["content-length"]):
            body += _recv(s)
    return int(lines[0].split()[1]), headers, body


def _recv(s: socket.socket) -> bytes:
    chunk = s.recv(65536)
    if not chunk:  # a closed connection: fail rather than spin on b""
        raise ConnectionError("the server closed the connection before its answer was complete")
    return chunk


def _logits(name: str, headers: dict, body: bytes) -> np.ndarray:
    """The logits of one answer, read by the protocol's own rules (not the client's code)."""
    if name == "detect":
        return np.array([r["logit"] for r in orjson.loads(body)["results"]])
    n = int(headers.get("inference-header-content-length", len(body)))
    offset = n
    for out in orjson.loads(body[:n])["outputs"]:
        size = (out.get("parameters") or {}).get("binary_data_size")
        if out["name"] == "logit":
            return np.asarray(out["data"]) if size is None else np.frombuffer(body[offset:offset + size], "<f4")
        offset += size or 0
    raise AssertionError(f"no logit in {body[:n]!r}")


def _specs(server, names: list[str], class_: str = "7"):
    model = json.loads(_send_raw(server.port, b"GET /v1/model HTTP/1.1\r\nHost: x\r\n\r\n")[2])
    specs = lc.build_endpoints(names, class_, model["input"]["shape"], "127.0.0.1", server.port, batch=3, pool=4,
                               v2=lc.v2_target(model, class_))
    return {s.name: s for s in specs}


@pytest.mark.integration
def test_pre_encoded_v2_requests_give_the_detect_logit(server):
    specs = _specs(server, HTTP_PROTOCOLS)
    for i in range(4):
        got = {}
        for name, spec in specs.items():
            status, headers, body = _send_raw(server.port, spec.raw_requests[i])
            assert status == 200, (name, body[:300])
            got[name] = _logits(name, headers, body)
        assert got["detect"].shape == (3,)
        for name in ("v2", "v2_binary"):
            np.testing.assert_allclose(got[name], got["detect"], rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.integration
@needs_grpc
def test_pre_encoded_grpc_request_gives_the_detect_logit(server):
    specs = _specs(server, ["detect", "grpc"])
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        call = channel.unary_unary(specs["grpc"].path)
        for i in range(4):
            status, headers, body = _send_raw(server.port, specs["detect"].raw_requests[i])
            assert status == 200
            answer = service_pb2.ModelInferResponse.FromString(call(specs["grpc"].bodies[i]))
            j = [o.name for o in answer.outputs].index("logit")
            np.testing.assert_allclose(np.frombuffer(answer.raw_output_contents[j], "<f4"),
                                       _logits("detect", headers, body), rtol=1e-5, atol=1e-5)
