"""`slc`: the root command line. It composes the commands of each package and imports a
command's module only when that command runs (or its help is shown), so `slc serve` and
`slc verify` never import the trainer or torch.

Every mistake ends in one line on stderr: a usage error (bad choice, bad path, missing
option) exits 2, a failure while working exits 1. Tracebacks only with --debug or SLC_DEBUG=1.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys
from importlib import metadata
from typing import Optional, Sequence

import click

# name -> ("module:attribute" of a click command, one-line help shown by `slc --help`)
COMMANDS: dict[str, tuple[Optional[str], str]] = {
    "train": ("trainer.cli:train", "Fit a backbone and class head with a loss; writes a run directory."),
    "evaluate": ("trainer.cli:evaluate", "Single-logit metrics of a trained run on a split."),
    "export": ("trainer.cli:export", "Write the ONNX bundle of a trained run, calibrated on its calibration split."),
    "calibrate": ("serving.calibration.cli:calibrate", "Choose a bundle's thresholds again on your own labelled images (no torch)."),
    "data": ("trainer.cli:data", "Datasets that are built, not downloaded (glyphs rendered from fonts)."),
    "verify": ("serving.cli:verify", "Re-check every hash, graph, sample and threshold of a bundle."),
    "serve": ("serving.cli:serve", "Serve a bundle over HTTP (the embedded default model without one)."),
    "enroll": ("serving.enroll_cli:enroll", "Enroll a class on a running server from image files (no retraining)."),
    "bundle": ("serving.bundle_cli:bundle", "Bundles without training (synthetic, for scale work), enrolled classes folded in, Triton model repositories."),
    "loadtest": ("tools.loadtest.cli:loadtest", "Load a running server (single logit against full softmax); writes report.json, report.md, latency.png."),
    "bench": (None, "Benchmarks written to docs/results: scale (single logit vs full softmax as D grows), and the lab's."),
    "experiment": ("tools.cli:experiment", "Paper experiments (table1, glyphs, thresholds, ...)."),
}
BENCH: dict[str, tuple[Optional[str], str]] = {
    "scale": ("tools.bench.cli:scale", "Single-logit vs full softmax serving as the number of classes grows."),
    "index": ("tools.bench.cli:index", "Top-k index build time, memory and recall on a synthetic head."),
    "soak": ("tools.bench.cli:soak", "Mixed load with kill -9 during writes: acknowledged writes lost, memory, fds."),
    "routes": ("tools.bench.cli:routes", "Server time per request on each route, the app called in-process (no HTTP noise)."),
    "ab": ("tools.bench.cli:ab", "This checkout's server against another checkout's, alternating blocks (before/after a change)."),
    "mixed": ("tools.bench.cli:mixed", "Detect latency beside full-softmax load: one batch at a time against two lanes."),
    "hostile": ("tools.bench.cli:hostile", "Hostile bodies up to the limit: time, memory, a concurrent probe."),
    "fuzz": ("tools.bench.cli:fuzz", "schemathesis from the server's OpenAPI: server errors, schema conformance."),
    "device": ("tools.bench.cli:device", "The server on a GPU against the device floor and the CPU server, as D grows."),
    "gpu": ("tools.bench.cli:gpu", "The one prepared GPU check: correctness, slc beside an onnxruntime peer on the same device, by D and precision."),
    "enroll": ("tools.bench.cli:enroll", "Classes enrolled into a large server: time each, detect under enrollment, memory, the limit."),
    "many-models": ("tools.bench.cli:many_models", "Many class-sets on one server sharing a backbone against one bundle: RSS, detect p50, load/unload."),
    "neighbours": ("tools.bench.cli:neighbours", "One model flooded on a backbone it shares with another: the other's latency and failures."),
    "replica": ("tools.bench.cli:replica", "One replica of a very large head (10^7 classes, int8): ready time, memory, latency."),
    "precision": ("tools.bench.cli:precision", "int8 / bf16 heads against float64: logit error, p(j) error, top-k agreement."),
    "agreement": ("tools.bench.cli:agreement", "HTTP answers on a labelled split against the bundle's offline figures."),
    "gallery": ("tools.bench.cli:gallery", "Shared (PostgreSQL) gallery: how soon another replica sees a write."),
    "losses": ("tools.cli:bench_losses", "Forward+backward time of smooth_topk against ce."),
    "head": ("tools.cli:bench_head", "Training at many classes: full vs sampled vs sharded head, as D grows."),
}
# The load tester, the benchmarks and the experiments are tools/: a second distribution, slc-lab
# (tools/pyproject.toml), left out of the server's wheel. Installed from the checkout with this line.
LAB_INSTALL = "pip install ./tools"
# `slc --help` and `slc bench --help` list the lab's commands in sections of their own
SECTIONS = [("Commands", ["train", "evaluate", "export", "calibrate", "data", "verify", "serve", "enroll", "bundle"]),
            (f"Load tests and benchmarks (slc-lab: {LAB_INSTALL})", ["loadtest", "bench"]),
            ("Experiments (slc-lab and torch: pip install '.[train]' ./tools)", ["experiment"])]
BENCH_SECTIONS = [(f"Single logit against full softmax (slc-lab: {LAB_INSTALL})", ["scale"]),
                  (f"The lab's benchmarks (slc-lab: {LAB_INSTALL})", [n for n in BENCH if n != "scale"])]
# what slc-lab brings besides tools/ itself (tools/pyproject.toml): missing, the lab line says how to get them
LAB_NEEDS = ("tools", "matplotlib", "aiohttp", "schemathesis")
DEBUG_ENV = "SLC_DEBUG"


class LazyGroup(click.Group):
    """A group whose commands are imported on first use (click's lazy-loading pattern);
    `slc --help` lists them from the table above without importing anything."""

    def __init__(self, *args, lazy: dict[str, tuple[Optional[str], str]],
                 sections: Optional[list[tuple[str, list[str]]]] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy, self.sections = lazy, sections

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.lazy)

    def get_command(self, ctx: click.Context, name: str) -> Optional[click.Command]:
        if name not in self.lazy:
            return None
        target = self.lazy[name][0]
        if target is None:  # a nested lazy group
            return bench_group
        module, _, attr = target.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except ImportError as exc:  # a command whose distribution or extra is not installed
            raise click.ClickException(_missing(f"{ctx.command_path} {name}", module, exc)) from None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        for title, names in self.sections or [("Commands", list(self.lazy))]:
            with formatter.section(title):
                formatter.write_dl([(name, self.lazy[name][1]) for name in names])

    def resolve_command(self, ctx: click.Context, args: list[str]):
        name = args[0] if args else None
        if name is not None and name not in self.lazy and not name.startswith("-"):
            close = [c for c in self.lazy if c[:2] == name[:2]]
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise click.UsageError(f"no command {name!r}{hint} (commands: {', '.join(self.lazy)})", ctx)
        return super().resolve_command(ctx, args)


def _missing(command: str, module: str, exc: ImportError) -> str:
    """The one line for a command whose code or dependency this install lacks, with what installs it."""
    missing = exc.name or str(exc)
    if module.startswith("tools") and missing.split(".")[0] in LAB_NEEDS:
        return (f"`{command}` is part of slc-lab (the load tester, benchmarks and experiments), which this "
                f"install lacks: {LAB_INSTALL} (from the slc checkout)")
    return f"`{command}` needs {missing}, which this install lacks: pip install 'slc[train]'"


def _version() -> str:
    try:
        return metadata.version("slc")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


@click.group(cls=LazyGroup, lazy=COMMANDS, sections=SECTIONS, context_settings={"help_option_names": ["-h", "--help"]},
             invoke_without_command=False, no_args_is_help=True)
@click.version_option(_version(), "--version", prog_name="slc", message="%(prog)s %(version)s")
@click.option("--debug", is_flag=True, help=f"Show tracebacks (also {DEBUG_ENV}=1). Accepted after any command too.")
def root(debug: bool) -> None:
    """Single-logit classification: train, export, verify, serve, measure."""


bench_group = LazyGroup("bench", lazy=BENCH, sections=BENCH_SECTIONS, no_args_is_help=True, help=COMMANDS["bench"][1])


def _usage_line(exc: click.UsageError) -> str:
    path = exc.ctx.command_path if exc.ctx is not None else "slc"
    hint = f" (see: {path} --help)" if exc.ctx is not None else ""
    return f"{path}: {exc.format_message()}{hint}"


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of the `slc` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get(DEBUG_ENV, "").lower() in ("1", "true", "yes")
    args = [a for a in args if a != "--debug"]
    if debug:
        os.environ[DEBUG_ENV] = "1"  # subprocesses (the default model's build) show theirs too
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(message)s")
    for ours in ("slc", "trainer", "serving", "models"):  # our progress at INFO; other libraries' chatter stays quiet
        logging.getLogger(ours).setLevel(logging.DEBUG if debug else logging.INFO)
    try:
        code = root.main(args=args, prog_name="slc", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:  # `slc`, `slc bench`: the help, as asked
        click.echo(exc.ctx.get_help() if exc.ctx else exc.format_message(), err=True)
        sys.exit(2)
    except click.UsageError as exc:
        if debug:
            raise
        click.echo(_usage_line(exc), err=True)
        sys.exit(2)
    except click.ClickException as exc:  # a failure a command explained
        if debug:
            raise
        click.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except (click.Abort, KeyboardInterrupt):
        click.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - an unexplained failure: one line, the traceback with --debug
        if debug:
            raise
        click.echo(f"error: {type(exc).__name__}: {exc} (run again with --debug for the traceback)", err=True)
        sys.exit(1)
    if isinstance(code, int) and code:  # click.exceptions.Exit(code) inside a command
        sys.exit(code)
