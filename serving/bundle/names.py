"""Compact class names: "0".."D-1" stored as a count, not a million strings."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Iterator, Union

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

