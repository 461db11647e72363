"""`slc loadtest`: load a running server and write report.json, report.md and latency.png.

Mistakes fail before the run: an endpoint outside the choices, both --concurrency and
--rate, a remote target without --allow-remote, an unwritable --out, a closed port, the grpc
endpoint without --grpc-port or without the slc[grpc] extra. A run in which no request
succeeded exits 1.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import click

from serving.bundle.cliopts import OUT, POSITIVE, guarded
from tools import require as require_lab
from tools.loadtest.client import (
    ENDPOINT_NAMES, GRPC_ENDPOINTS, RemoteTargetError, check_target, grpc_modules, normalize_url,
)


def _endpoints(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    names = [e.strip() for e in value.split(",") if e.strip()]
    bad = [e for e in names if e not in ENDPOINT_NAMES]
    if bad or not names:
        raise click.BadParameter(f"{(bad or [value])[0]!r} is not an endpoint; choose from {', '.join(ENDPOINT_NAMES)} "
                                 "(a comma list interleaves them)", ctx, param)
    return names


def _target(url: str, allow_remote: bool) -> str:
    url = normalize_url(url)
    try:
        check_target(url, allow_remote)
    except (RemoteTargetError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="--url") from None
    return url


def _check_grpc(endpoints: list[str], grpc_port: Optional[int]) -> None:
    """The grpc endpoint needs the server's gRPC port and the slc[grpc] extra: say so before the run."""
    if not any(e in GRPC_ENDPOINTS for e in endpoints):
        return
    if grpc_port is None:
        raise click.BadParameter("the grpc endpoint needs the server's gRPC port (slc serve --grpc-port)",
                                 param_hint="--grpc-port")
    try:
        grpc_modules()
    except ImportError as exc:
        raise click.ClickException(str(exc)) from None


@click.command()
@click.option("--url", required=True, help="the server: http://HOST:PORT or HOST:PORT (loopback unless --allow-remote)")
@click.option("--endpoint", "endpoints", default="detect", show_default=True, callback=_endpoints,
              help=f"one of {', '.join(ENDPOINT_NAMES)}; a comma list interleaves them")
@click.option("--class", "class_", help="class name or id [default: the model's first class]")
@click.option("--concurrency", type=click.IntRange(min=1), help="closed loop workers [default: 8 unless --rate]")
@click.option("--rate", type=POSITIVE, help="open loop: requests/s (not with --concurrency)")
@click.option("--duration", type=POSITIVE, default=10.0, show_default=True, help="measured seconds")
@click.option("--warmup", type=click.FloatRange(min=0.0), default=2.0, show_default=True, help="seconds before measuring")
@click.option("--max-requests", type=click.IntRange(min=1), help="stop after this many measured requests")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True, help="inputs per request")
@click.option("--allow-remote", is_flag=True, help="allow a non-loopback target")
@click.option("--grpc-port", type=click.IntRange(1, 65535),
              help="the server's gRPC port (slc serve --grpc-port), same host as --url; needed by --endpoint grpc")
@click.option("--out", required=True, help="report directory", **OUT)
@guarded("report folder")
def loadtest(url: str, endpoints: list[str], class_: Optional[str], concurrency: Optional[int], rate: Optional[float],
             duration: float, warmup: float, max_requests: Optional[int], batch: int, allow_remote: bool,
             grpc_port: Optional[int], out: Path) -> None:
    """Load a running server; writes report.json, report.md, latency.png to OUT."""
    from tools.loadtest.report import report_markdown, write_reports
    from tools.loadtest.run import run_with_ceiling

    if concurrency is not None and rate is not None:
        raise click.UsageError("give either --concurrency or --rate, not both")
    require_lab("matplotlib")  # latency.png, written after the run
    _check_grpc(endpoints, grpc_port)
    url = _target(url, allow_remote)
    try:
        result = run_with_ceiling(url, endpoints, class_=class_, concurrency=concurrency, rate=rate, duration=duration,
                                  warmup=warmup, max_requests=max_requests, batch=batch, allow_remote=allow_remote,
                                  grpc_port=grpc_port)
    except OSError as exc:
        raise click.ClickException(f"cannot reach the server at {url}: {exc.strerror or exc}") from None
    except ValueError as exc:  # found only once the server answered, e.g. a class name v2 cannot turn into an id
        raise click.ClickException(str(exc)) from None
    result.report["command"] = _command(url, ",".join(endpoints), class_, concurrency, rate, duration, warmup, batch,
                                        out, grpc_port)
    paths = write_reports(result, out)
    click.echo(report_markdown(result.report))
    _summary(result.report, paths)


def _command(url, endpoint, class_, concurrency, rate, duration, warmup, batch, out, grpc_port=None) -> str:
    parts = [f"slc loadtest --url {url} --endpoint {endpoint}"]
    parts += [f"--grpc-port {grpc_port}"] if grpc_port is not None else []
    parts += [f"--class {class_}"] if class_ is not None else []
    parts += [f"--concurrency {concurrency}"] if concurrency is not None else []
    parts += [f"--rate {rate:g}"] if rate is not None else []
    parts += [f"--duration {duration:g} --warmup {warmup:g} --batch {batch} --out {out}"]
    return " ".join(parts)


def _summary(report: dict, paths: list[Path]) -> None:
    """One line per endpoint; exit 1 when nothing succeeded (a run of errors is not a measurement)."""
    for name, ep in report["endpoints"].items():
        p50 = ep["latency_ms"].get("p50")
        errs = sum(ep["errors"].values())
        click.echo(f"{name}: {ep['ok']}/{ep['requests']} ok, {ep['goodput_rps']:.1f} req/s"
                   + (f", p50 {p50:.2f} ms" if p50 is not None else "") + (f", {errs} errors {ep['errors']}" if errs else ""))
    click.echo(f"reports: {', '.join(str(p) for p in paths)}")
    if report["ok"] == 0:
        raise click.ClickException(f"no request succeeded ({report['requests']} sent); see {paths[1]}")
