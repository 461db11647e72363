"""Servers under test as subprocesses: `slc serve`, the plain torch peer and the onnxruntime peer, ready when
/v1/health/ready answers 200, with the resident memory of their process tree."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

READY_TIMEOUT_S = 1800.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server in a subprocess; ready when GET /v1/health/ready answers 200."""

    def __init__(self, argv: list[str], port: int, log_path: Path, env: Optional[dict] = None,
                 cwd: Optional[Path] = None):
        self.port, self.log_path, self.grpc_port = port, log_path, None
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd,
                                     env={**os.environ, **(env or {})})
        self.started = time.perf_counter()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> float:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/v1/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - self.started
            except OSError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def timed_request(url: str, body: Optional[bytes] = None, method: Optional[str] = None,
                  content_type: str = "application/json", timeout: float = 120) -> tuple[int, str, float]:
    """(status, the error envelope's code or "", seconds) of one request; status 0 and the exception's
    name when it timed out or the connection failed."""
    import orjson

    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": content_type})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, answer = r.status, r.read()
    except urllib.error.HTTPError as exc:
        status, answer = exc.code, exc.read()
    except OSError as exc:  # a timeout, a refused or reset connection: the request failed
        return 0, type(exc).__name__, time.perf_counter() - t0
    code = orjson.loads(answer).get("error", {}).get("code", "") if answer[:9] == b'{"error":' else ""
    return status, code, time.perf_counter() - t0


def process_tree_memory(pid: int) -> dict:
    """Resident memory (VmRSS) and its peak (VmHWM) of a process and its descendants, in bytes."""
    try:
        import psutil  # noqa: F401  (optional)

        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
        rss = sum(p.memory_info().rss for p in procs)
        return {"rss": rss, "hwm": None, "processes": len(procs), "source": "psutil"}
    except ImportError:
        pass
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    todo, pids = [pid], []
    while todo:
        p = todo.pop()
        pids.append(p)
        todo.extend(children.get(p, []))
    fields = {"VmRSS:": "rss", "VmHWM:": "hwm", "RssAnon:": "rss_anon", "RssFile:": "rss_file"}
    total = dict.fromkeys(fields.values(), 0)
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                key = fields.get(line.split(":", 1)[0] + ":")
                if key:
                    total[key] += int(line.split()[1]) * 1024
        except OSError:
            continue
    # rss_file: pages of mapped files (the head's .npy), clean, which the kernel drops under pressure
    return {**total, "processes": len(pids), "source": "/proc/PID/status"}


def grpc_available() -> bool:
    """Whether this install can serve and load-test KServe v2 over gRPC (the slc[grpc] extra)."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("grpc", "tritonclient"))


def slc_server(bundle: Optional[Path], log_dir: Path, tag: str, data_dir: Path, grpc: bool = False,
               env: Optional[dict] = None) -> ServerProcess:
    """`slc serve BUNDLE` (the default model when None) on a free port, logging to log_dir; with `grpc`,
    KServe v2 over gRPC on a second free port (`.grpc_port`); `env`: more SLC_* settings."""
    port = free_port()
    argv = [sys.executable, "-m", "slc", "serve"] + ([str(bundle)] if bundle else []) + [
        "--port", str(port), "--data-dir", str(data_dir)]
    grpc_port = free_port() if grpc else None
    if grpc_port:
        argv += ["--grpc-port", str(grpc_port)]
    server = ServerProcess(argv, port, log_dir / f"server-{tag}.log", env={"SLC_LOG_LEVEL": "warning", **(env or {})})
    server.grpc_port = grpc_port
    return server


def peer_server(bundle: Path, log_dir: Path, tag: str) -> ServerProcess:
    """The torch peer (tools/bench/torch_peer.py; needs the train extra) on a free port."""
    port = free_port()
    argv = [sys.executable, "-m", "tools.bench.torch_peer", str(bundle), "--port", str(port)]
    return ServerProcess(argv, port, log_dir / f"peer-{tag}.log")


def ort_peer_server(bundle: Path, log_dir: Path, tag: str, device: str = "auto") -> ServerProcess:
    """The onnxruntime peer (tools/bench/ort_peer.py: FastAPI over full.onnx and single.onnx) on a free port,
    on the CUDA provider where listed (`device` auto / cuda) or the CPU's."""
    port = free_port()
    argv = [sys.executable, "-m", "tools.bench.ort_peer", str(bundle), "--port", str(port), "--device", device]
    return ServerProcess(argv, port, log_dir / f"ort-peer-{tag}.log")


def run_peer(create_app, description: str, default_port: int, argv: Optional[list[str]] = None,
             device: bool = False) -> None:
    """A hand-written peer's command line (BUNDLE --host --port [--device]) and its uvicorn process."""
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=default_port)
    if device:
        parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    args = parser.parse_args(argv)
    app = create_app(args.bundle, args.device) if device else create_app(args.bundle)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)


def add_health_routes(app) -> None:
    """GET /v1/health/live and /v1/health/ready: always up once the app exists."""
    @app.get("/v1/health/live")
    def live():
        return {"status": "live"}

    @app.get("/v1/health/ready")
    def ready():
        return {"status": "ready"}
