"""Command-line checks every package's commands share (click callbacks): an output directory
that can be written and a bundle directory that exists, each failing as one line before any
work starts; `guarded`, the one way a command claims the folder it writes (serving/bundle/output.py)."""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Callable, Optional, Sequence

import click

from serving.bundle.files import check_writable_dir
from serving.bundle.format import MANIFEST


def slc_command() -> str:
    """How to run slc again, for every next-command hint: `slc` when PATH finds the program running
    now; else its own path (`.venv/bin/slc`, as the README runs it, on no PATH), or `PYTHON -m slc`."""
    import shutil
    import sys

    found = shutil.which("slc")
    program = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if program is not None and program.name == "slc":
        if found and os.path.realpath(found) == os.path.realpath(program):
            return "slc"
        return _shown_path(program)
    if found and os.path.dirname(os.path.realpath(found)) == os.path.dirname(os.path.realpath(sys.executable)):
        return "slc"  # `python -m slc` of the install whose slc PATH finds
    return f"{_shown_path(Path(sys.executable))} -m slc"


def _shown_path(path: Path) -> str:
    """A path as a user pastes it: relative to the working directory when under it, else absolute."""
    absolute = Path(os.path.abspath(path))
    try:
        return str(absolute.relative_to(Path.cwd()))
    except ValueError:
        return str(absolute)


# the files that make a folder a training run (trainer/run_dir.py RUN_FILES: the server never imports the trainer)
RUN_MARKERS = ("config.json", "checkpoint.pt")


def out_dir(ctx: click.Context, param: click.Parameter, value: Optional[Path]) -> Optional[Path]:
    """--out must be a writable directory, or creatable inside one."""
    if value is None:
        return None
    try:
        return check_writable_dir(value)
    except OSError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


def bundle_dir(ctx: click.Context, param: click.Parameter, value: Optional[Path]) -> Optional[Path]:
    """A bundle directory with its manifest (what it holds is verify's job)."""
    if value is not None and not (Path(value) / MANIFEST).is_file():
        if all((Path(value) / name).is_file() for name in RUN_MARKERS):
            raise click.BadParameter(f"{value} is a training run, not a bundle: export it first with "
                                     f"`{slc_command()} export {value} --out BUNDLE`, then give BUNDLE", ctx, param)
        what = "does not exist" if not Path(value).exists() else f"has no {MANIFEST}"
        raise click.BadParameter(f"{value} is not a bundle directory ({what})", ctx, param)
    return None if value is None else Path(value)


def key_values(ctx: click.Context, param: click.Parameter, items: tuple[str, ...]) -> dict:
    """Repeated k=v options; values parsed as JSON when they can be (numbers, lists), else strings."""
    import json

    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise click.BadParameter(f"expected k=v, got {item!r}", ctx, param)
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


POSITIVE = click.FloatRange(min=0.0, min_open=True)
OUT = dict(type=click.Path(path_type=Path), callback=out_dir)


def require(module: str, extra: str) -> None:
    """Fail before the work when a command's optional dependency is missing, naming the extra."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise click.ClickException(f"this command needs {module}, which this install lacks: pip install 'slc[{extra}]'")


def guarded(kind: str, *, inputs: Sequence[str | Callable[[dict], Optional[Path]]] = (), out: str = "out",
            in_place: Optional[str] | bool = None,
            target: Optional[Callable[[dict], Optional[Path]]] = None) -> Callable:
    """Decorate a command that writes a folder: before its body runs, the folder is checked
    (serving/bundle/output.py: one line, exit 2) and locked until the command ends. Whole kinds get
    an `--overwrite` flag, passed on to the body as `overwrite`. `inputs`: the parameters naming the
    command's inputs (or functions of the parameters giving one); `in_place`: the flag that makes the input itself the output
    (True: always, as `slc bundle quantize` writes its BUNDLE); `target`: the
    output from the parameters when it is not `out` alone (a run resumed in place)."""
    from serving.bundle.output import kind_of

    whole = kind_of(kind).whole

    def wrap(body: Callable) -> Callable:
        @functools.wraps(body)
        def run(**params):
            place = in_place is True or bool(in_place and params.get(in_place))
            folder = target(params) if target else params.get(out)
            if folder is None or os.environ.get("RANK", "0") != "0":  # a torchrun worker: rank 0 claims it
                return body(**params)
            with claim(folder, kind, overwrite=params.get("overwrite", False), in_place=place,
                       inputs=_paths(name(params) if callable(name) else params.get(name) for name in inputs)):
                return body(**params)

        run.slc_output = kind  # tests/cli/test_outputs.py: every command with --out carries one
        if whole and in_place is not True:
            run = click.option("--overwrite", is_flag=True, help=f"replace the {kind} already in --out (only "
                               "its own files; anything else in the folder stays)")(run)
        return run

    return wrap


def _paths(values) -> list[Path]:
    """The input paths among parameter values (a path, a tuple of paths, None)."""
    out = []
    for value in values:
        out += [Path(v) for v in (value if isinstance(value, (list, tuple)) else [value]) if v is not None]
    return out


def claim(folder: Path, kind: str, **how):
    """The checked, locked output folder as a context manager; a refusal as click's one-line usage error."""
    import contextlib

    from serving.bundle.output import OutputRefused, check, lock

    try:
        real = check(folder, kind, **how)
        stack = contextlib.ExitStack()
        stack.enter_context(lock(real))
    except OutputRefused as exc:
        raise click.UsageError(str(exc)) from None
    return stack
