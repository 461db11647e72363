"""Class names: the compact "0".."D-1" kept as a count, not a million strings; and the one rule for
the names a server can be given (enrolled classes: `PUT /v1/classes/{name}`) and fold carries into a
bundle, `class_name_problem`."""
from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from typing import Any, Iterator, Optional, Union

import numpy as np

from serving.bundle.calibration import float32_finite, number_problem

MAX_NAME_CHARS = 256
_INTEGER = re.compile(r"-?[0-9]{1,18}")  # what a class path reads as an id (serving/bundle/loader.py)
# Characters no class name holds. Cc: C0, DEL and C1 (U+0085 NEL included): they end or reshape lines
# in logs, listings and terminals. Cs: a lone surrogate, which no UTF-8 (JSON answer, path) can carry.
# Zl, Zp: U+2028, U+2029, line breaks to many readers. The bidirectional embeddings, overrides and
# isolates (Cf, U+202A..U+202E, U+2066..U+2069): they reorder the text shown around them ("Trojan
# Source"). Other Cf characters are allowed (ZWJ in emoji, ZWNJ in Persian and Indic scripts, soft
# hyphen), and so are unassigned code points (which ones are depends on the Python's Unicode version).
# Every range here is fixed by Unicode, so the rule does not move with the Python version.
_REFUSED = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_WHAT = {"Cc": "a control character", "Cs": "a lone surrogate", "Zl": "a line separator",
         "Zp": "a paragraph separator", "Cf": "a bidirectional formatting character"}

class IdNames(Sequence):
    """Class names that are just the ids "0".."D-1": a sequence of str that stores only D.

    Equal to any sequence holding the same strings, so code written for a list keeps working.
    """

    __slots__ = ("_n",)

    def __init__(self, n: int):
        self._n = int(n)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, j):
        if isinstance(j, slice):
            return [str(i) for i in range(*j.indices(self._n))]
        j = int(j)  # np.integer too; TypeError for anything that is not an index
        if j < 0:
            j += self._n
        if not 0 <= j < self._n:
            raise IndexError(f"class index {j} out of range 0..{self._n - 1}")
        return str(j)

    def __iter__(self) -> Iterator[str]:
        return map(str, range(self._n))

    def id_of(self, name: Any) -> int | None:
        """The id whose name is exactly `name`, else None (no dict needed: the name is the id)."""
        if (type(name) is not str or not name.isascii() or not name.isdigit() or len(name) > 18
                or (len(name) > 1 and name[0] == "0")):
            return None
        j = int(name)
        return j if j < self._n else None

    def __contains__(self, name: object) -> bool:
        return self.id_of(name) is not None

    def index(self, name: Any, start: int = 0, stop: int | None = None) -> int:
        j = self.id_of(name)
        if j is None or not start <= j < (self._n if stop is None else stop):
            raise ValueError(f"{name!r} is not a class name")
        return j

    def count(self, name: Any) -> int:
        return int(self.id_of(name) is not None)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, IdNames):
            return self._n == other._n
        if isinstance(other, (list, tuple, Sequence)) and not isinstance(other, (str, bytes)):
            return len(other) == self._n and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # like a list

    def __repr__(self) -> str:
        return f"IdNames({self._n})"


def compact_names(raw: Sequence) -> Union[IdNames, list[str]]:
    """Manifest class names as str; IdNames when they are exactly "0".."D-1" (no million strings at D = 1M)."""
    names = [c if type(c) is str else str(c) for c in raw]
    n = len(names)
    if n and names[0] == "0" and names[-1] == str(n - 1) and names == list(map(str, range(n))):
        return IdNames(n)
    return names



def refused_character(name: str) -> Optional[str]:
    """What the first character a class name must never hold is ("U+0085, a control character"),
    or None: the character part of `class_name_problem`, which lookups of a name share."""
    bad = _REFUSED.search(name)
    if bad is None:
        return None
    ch = bad.group()
    return f"U+{ord(ch):04X}, {_WHAT[unicodedata.category(ch)]}"


def class_name_problem(name: Any) -> Optional[str]:
    """Why `name` cannot be an enrolled class's name, or None: 1..256 characters, none refused
    (`refused_character`), no "/" (a path segment), and not an integer (it would read as a class
    id). The server refuses such a name at `PUT /v1/classes/{name}` and `slc bundle fold` refuses to
    fold one, so no bundle or store a server reads holds a name it cannot be asked about."""
    if type(name) is not str:
        return f"is a {type(name).__name__}, not a string"
    if not name:
        return "is empty"
    if len(name) > MAX_NAME_CHARS:
        return f"has {len(name)} characters, more than {MAX_NAME_CHARS}"
    if found := refused_character(name):
        return f"holds {found}"
    if "/" in name:
        return "holds '/', which would split the URL path"
    if _INTEGER.fullmatch(name):
        return "is an integer, which reads as a class id"
    return None


def shown(name: str, limit: int = 40) -> str:
    """A name for a one-line message: repr (control characters escaped), cut to `limit` characters."""
    return repr(name[:limit]) + ("…" if len(name) > limit else "")


def enrolled_class_problem(c: Any, d: int) -> Optional[str]:
    """What makes a stored enrolled class (`name`, `row`, `bias`, `threshold`, `platt_a`, `platt_b`:
    a store record, or fold's copy of one) unservable, or None: its name (`class_name_problem`), a row
    not of d values finite in float32, a bias, threshold or Platt a / b not finite in float32. The
    server ignores such a record and `slc bundle fold` refuses it."""
    if problem := class_name_problem(c.name):
        return f"the name {problem}"
    row = None if c.row is None else np.asarray(c.row)
    if row is None or row.shape != (d,) or not float32_finite(row).all():
        return f"its row is not {d} values finite in float32"
    for what in ("bias", "threshold", "platt_a", "platt_b"):
        if problem := number_problem(what, getattr(c, what)):
            return problem
    return None
