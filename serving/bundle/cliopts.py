"""Command-line checks every package's commands share (click callbacks): an output directory
that can be written and a bundle directory that exists, each failing as one line before any
work starts."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import click

from serving.bundle.files import check_writable_dir
from serving.bundle.format import MANIFEST


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
