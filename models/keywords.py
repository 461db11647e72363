"""k=v keywords from the command line (`--backbone-param`, `--loss-param`) checked against the
constructor they are for, so that a misspelt name or a word where a number goes is one line before
any data is read, not a TypeError from deep inside the first forward."""
from __future__ import annotations

import inspect
from typing import Callable


CHECKED = (bool, int, float, str)  # the kinds of default whose values are checked here


def accepted(fn: Callable, skip: tuple[str, ...] = ()) -> dict[str, inspect.Parameter]:
    """The keyword parameters `fn` takes, by name (`skip`: those the caller passes itself)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {n: p for n, p in inspect.signature(fn).parameters.items()
            if p.kind in kinds and n not in skip and n != "self"}


def check_keywords(fn: Callable, params: dict, label: str, skip: tuple[str, ...] = ()) -> None:
    """One-line ValueError unless every key of `params` is a keyword of `fn` and every value has the
    type of that keyword's default (an int where an int goes; an int or a float where a float goes;
    a bool where a bool goes; a string where a string goes). Other keywords take any value here."""
    known = accepted(fn, skip)
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
    for key, value in params.items():
        if key not in known and open_ended:  # **kwargs: the constructor names what it takes
            continue
        if key not in known:
            names = f"it takes: {', '.join(sorted(known))}" if known else "it takes none"
            raise ValueError(f"{label} takes no keyword {key!r}; {names}")
        default = known[key].default
        if type(default) not in CHECKED:  # no default, None, a sequence: the constructor checks the value
            continue
        if not _fits(value, type(default)):
            raise ValueError(f"{label}: {key} must be {_kind(type(default))}, got {value!r}")


def _fits(value, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


def _kind(kind: type) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(kind, kind.__name__)
