"""The server's commands: `slc serve` and `slc verify`. Neither imports the trainer or torch."""
from __future__ import annotations

import json
import time
from pathlib import Path

import click

from serving.bundle.cliopts import bundle_dir


@click.command()
@click.argument("bundles", nargs=-1, metavar="[BUNDLE]...", callback=lambda ctx, param, value: _bundles(ctx, param, value))
@click.option("--model-repository", type=click.Path(path_type=Path, exists=True, file_okay=False),
              help="a folder of bundle folders: each served under its folder's name, loadable and unloadable by "
                   "name (POST /v2/repository/models/NAME/load | unload) [default: none]")
@click.option("--host", help="[default: 127.0.0.1, or SLC_HOST]")
@click.option("--port", type=click.IntRange(0, 65535), help="[default: 8000, or SLC_PORT]")
@click.option("--data-dir", type=click.Path(path_type=Path), help="gallery and index cache [default: $SLC_HOME/data]")
@click.option("--grpc-port", type=click.IntRange(0, 65535), help="also serve KServe v2 over gRPC on this port [default: off]")
@click.option("--http/--no-http", default=None, help="serve HTTP; --no-http: gRPC alone [default: --http]")
@click.option("--gallery-url", help="postgresql://… : a gallery shared by every replica [default: SQLite in --data-dir]")
@click.option("--max-batch", type=click.IntRange(min=1), help="inputs per backbone call [default: 64]")
@click.option("--max-delay-ms", type=click.FloatRange(min=0.0), help="batching wait in ms [default: 2.0]")
@click.option("--queue-size", type=click.IntRange(min=1), help="queued inputs before 429 [default: 1024]")
@click.option("--drain-delay", "drain_delay_s", type=click.FloatRange(min=0.0),
              help="on SIGTERM, seconds of readiness 503 while still accepting [default: 0, or SLC_DRAIN_DELAY_S]")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]),
              help="[default: auto: CUDA when onnxruntime can use a GPU, else CPU]")
@click.option("--allow-open-writes", is_flag=True, default=None,
              help="accept gallery writes without SLC_API_KEY on a non-loopback --host (anyone who reaches the port "
                   "may write) [default: refused with 403, or SLC_ALLOW_OPEN_WRITES]")
def serve(bundles: tuple, **flags) -> None:
    """Serve BUNDLE over HTTP and/or gRPC (docs/api.md); without one, the embedded default model.

    Several bundles (`slc serve A B NAME=C`): each served under its own name (its manifest's, or NAME),
    the first as the default model of today's routes, every one under /v1/models/NAME/… and
    /v2/models/NAME/…; bundles with the same backbone graph share one backbone session.

    Flags override SLC_* environment variables (docs/configuration.md)."""
    from pydantic import ValidationError

    from serving.main import run_server
    from serving.settings import Settings

    bundle, extra = (bundles[0], list(bundles[1:])) if bundles else (None, None)
    overrides = {k: v for k, v in dict(bundle=bundle, bundles=extra or None, **flags).items() if v is not None}
    try:
        settings = Settings(**overrides)  # every SLC_* variable checked before anything starts
    except ValidationError as exc:
        first = exc.errors()[0]
        if not first["loc"]:  # a rule between settings: its message names them
            raise click.UsageError(str(first["msg"]).removeprefix("Value error, ")) from None
        field = str(first["loc"][0])
        flag = f" / --{field.replace('_', '-')}" if field in flags else ""
        raise click.UsageError(f"SLC_{field.upper()}{flag}: {first['msg']} (got {first.get('input')!r})") from None
    if settings.http:
        check_port(settings.host, settings.port, "--port", "SLC_PORT")
    if settings.grpc_port is not None:
        check_port(settings.host, settings.grpc_port, "--grpc-port", "SLC_GRPC_PORT")
    if settings.open_writes_refused():
        from serving.http.v1 import OPEN_WRITES_REFUSED

        click.echo("warning: " + OPEN_WRITES_REFUSED.format(host=settings.host), err=True)
    run_server(overrides)


def _bundles(ctx: click.Context, param: click.Parameter, values: tuple) -> tuple:
    """BUNDLE... : the first a bundle folder (the default model), the others `PATH` or `NAME=PATH`,
    each checked to be a bundle folder before anything starts."""
    out = []
    for i, text in enumerate(values):
        name, sep, path = text.partition("=")
        named = bool(sep and name and "/" not in name)
        if named and i == 0:
            raise click.BadParameter(f"{text}: the first bundle is the default model, served under its manifest's "
                                     "name (NAME=PATH names the others)", ctx, param)
        folder = bundle_dir(ctx, param, Path(path if named else text))
        out.append(folder if i == 0 else (f"{name}={folder}" if named else str(folder)))
    return tuple(out)


class PortTaken(click.ClickException):
    exit_code = 2  # a usage problem, found before anything loads


def check_port(host: str, port: int, flag: str, variable: str) -> None:
    """Bind `host:port` once, as uvicorn will (SO_REUSEADDR), before the bundle loads: a port in use
    is one line and exit 2 now, not uvicorn's `[Errno 98]` (exit 3) after minutes of loading."""
    import errno
    import socket

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PortTaken(f"cannot listen on {host}: {exc.strerror} (--host / SLC_HOST)") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortTaken(f"port {port} on {host} is already in use (another slc serve?): pick another with "
                                f"{flag} {port + 1 if port < 65535 else 8000} (or {variable}), or stop what listens "
                                "there") from None
            raise PortTaken(f"cannot listen on {host}:{port}: {exc.strerror} ({flag} / {variable})") from None


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path, exists=True, file_okay=False))
def verify(bundle: Path) -> None:
    """Re-check hashes, graphs, samples and calibration of BUNDLE; exit 1 on any problem."""
    from serving.bundle import verify_bundle
    from serving.bundle.format import MANIFEST

    t0 = time.perf_counter()
    problems = verify_bundle(bundle)
    if problems:
        for p in problems:
            click.echo(f"FAIL {p}", err=True)
        raise click.ClickException(f"{bundle}: {len(problems)} problem(s); the bundle must not be served")
    m = json.loads((bundle / MANIFEST).read_text())
    click.echo(f"OK {bundle}: {m['num_classes']} classes, d={m['embed_dim']}, {len(m['files'])} files hashed, "
               f"graphs and samples checked ({time.perf_counter() - t0:.1f} s)")
