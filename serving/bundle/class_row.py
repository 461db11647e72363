"""One class's head row and what detect needs beside it: the one record of a class that is not in
the bundle's head, from where enrollment computes it, through the store that keeps it, to the
snapshot the queries read and to `slc bundle fold`, which writes it into a head as an ordinary row.

Enrollment fills the row's values (name and slot unset); the store adds the slot, the name and its
write's sequence number and time; a deletion is a record with no row."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from serving.bundle.names import enrolled_class_problem


@dataclass
class ClassRow:
    row: Optional[np.ndarray]  # [d] float32; None: a deleted slot (a tombstone)
    bias: float
    threshold: float
    platt_a: float
    platt_b: float
    examples: int
    rule: str  # how the row and its threshold were made (e.g. "imprint+global")
    name: str = ""
    slot: int = -1  # its place among the enrolled classes: id = D + slot
    created: float = 0.0  # the store's write time (unix seconds)
    seq: int = 0  # the store's write sequence number
    deleted: bool = False
    problem: Optional[str] = None  # why the stored values cannot be served (the reader skips the record)
    lookalikes: tuple[int, ...] = ()  # class ids its examples resembled (serving/core/lookalikes.py)

    def unservable(self, d: int, trained: Callable[[str], bool]) -> Optional[str]:
        """Why this live stored class cannot be served (None: it can): a value the store could not give, a
        row not of d finite values, a non-finite bias, threshold or Platt value, a name no route can
        address, or one that `trained(name)` says a trained class has. The server and fold alike."""
        if self.problem:
            return self.problem
        if self.row is None:
            return f"its row has 0 values, not {d}"
        if problem := enrolled_class_problem(self, d):
            return problem
        return "its name is a trained class's" if trained(self.name) else None

    @property
    def norm(self) -> float:
        return float(np.linalg.norm(np.asarray(self.row, dtype=np.float64)))
