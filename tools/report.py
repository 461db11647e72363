"""The one writer of the results in docs/results: number cells, markdown tables, OUT/<stem>.md + .json.

Every benchmark and experiment under tools/ used to carry its own copy of these: two `_fmt`s that
had already drifted apart, a hand-written `| a | b |` / `|---|---:|` per table, and a
`mkdir` + `json.dumps` + `write_text` sequence per report. One copy keeps the reports alike and a
fix in one place. The writers still build their own prose; they take the pieces from here.
"""
from __future__ import annotations

import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Union

DASH = "–"  # a missing or non-finite number
_NUMERIC = re.compile(r"[-+]?(\d[\d,]*)?\.?\d+(e[-+]?\d+)?")
_PLACEHOLDERS = {DASH, "—", ""}


def fmt(x: Any, digits: int = 1, *, sci_below: float = 0.01, group_ints: bool = True) -> str:
    """x as a table cell. None and non-finite floats: "–". Floats: `digits` decimals with thousands
    separators, or e-notation with 2 decimals when 0 < |x| < sci_below (sci_below=0: never). ints
    (bools too): with thousands separators if group_ints, else str(x). Anything else: str(x).

    tools/bench/report.py uses the defaults; tools/loadtest/report.py digits=2, sci_below=0,
    group_ints=False (the two styles the reports had before they shared this function)."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return DASH
    if isinstance(x, float):
        return f"{x:,.{digits}f}" if abs(x) >= sci_below or x == 0 else f"{x:.2e}"
    if group_ints and isinstance(x, int):
        return f"{x:,}"
    return str(x)


def _is_number(cell: Any) -> bool:
    if isinstance(cell, bool):
        return False
    return isinstance(cell, (int, float)) or (isinstance(cell, str) and bool(_NUMERIC.fullmatch(cell)))


def _inferred_align(rows: list[list], columns: int) -> str:
    """"r" for a column whose cells are all numbers (or numeric text, "–" / "—" allowed), else "l"."""
    align = ""
    for i in range(columns):
        cells = [row[i] for row in rows if not (isinstance(row[i], str) and row[i] in _PLACEHOLDERS)]
        align += "r" if cells and all(_is_number(c) for c in cells) else "l"
    return align


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], align: Optional[str] = None) -> str:
    """A markdown table (no trailing newline): the header row, the alignment row, one line per row.

    Cells are written as given (str() of anything not a str; an empty cell as `| |`): format
    numbers first (fmt) and escape a literal "|" as "\\|". align: one letter per column, "l"
    (`|---|`) or "r" (`|---:|`); None: right-aligned where every cell of the column is a number or
    numeric text ("–" / "—" / "" cells aside)."""
    rows = [list(r) for r in rows]
    n = len(headers)
    for row in rows:
        if len(row) != n:
            raise ValueError(f"a row of {len(row)} cells in a table of {n} columns: {row!r}")
    align = _inferred_align(rows, n) if align is None else align
    if len(align) != n or set(align) - {"l", "r"}:
        raise ValueError(f"align {align!r}: want one of 'l'/'r' for each of {n} columns")
    line = lambda cells: "|" + "|".join(" " if isinstance(c, str) and not c else f" {c} " for c in cells) + "|"  # noqa: E731
    rule = "|" + "".join("---:|" if a == "r" else "---|" for a in align)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def portable_paths(text: str) -> str:
    """The machine's own paths in a report, as a reader elsewhere can read them: under the working
    directory relative to it, the temporary directory as $TMPDIR, the home directory as ~
    (tests/test_docs.py fails on an absolute machine path anywhere in docs/)."""
    for prefix, short in ((os.getcwd(), "."), (tempfile.gettempdir(), "$TMPDIR"), (os.path.expanduser("~"), "~")):
        prefix = prefix.rstrip("/")
        if not prefix:  # "/": nothing to shorten
            continue
        text = text.replace(prefix + "/", "" if short == "." else short + "/")
        text = re.sub(re.escape(prefix) + r"(?![\w.-])", lambda _: short, text)
    return text


def write_text(path: Path, text: str) -> Path:
    """Write text to path atomically (a sibling temporary file renamed over it), creating the directory;
    the machine's paths in it made portable (portable_paths); a file there that slc did not write is
    kept and the text goes beside it (serving/bundle/output.py). Returns where it went."""
    return write_file(path, lambda tmp: tmp.write_text(portable_paths(text), encoding="utf-8"))


def write_file(path: Path, write: Callable[[Path], Any]) -> Path:
    """`write(tmp)` then rename to the report's place in its folder (output.report_file), recorded in
    the folder's ledger; the path written."""
    from serving.bundle import output

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path = output.report_file(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return output.record(path)


def write_json(path: Path, data: Any, *, indent: Optional[int] = 2, default: Optional[Callable] = None,
               newline: bool = True) -> Path:
    """json.dumps(data, indent=indent, default=default) (+ "\\n" if newline) to path, atomically."""
    return write_text(path, json.dumps(data, indent=indent, default=default) + ("\n" if newline else ""))


def write_result(out_dir: Path, stem: str, markdown: Union[str, Callable[[], str]], data: Any, *,
                 indent: Optional[int] = 2, default: Optional[Callable] = None, newline: bool = True) -> list[Path]:
    """OUT/stem.json (write_json with these options), then OUT/stem.md; returns [md path, json path].

    markdown may be a function of no arguments returning the text: it is called once the JSON is
    on disk, so a failing renderer never costs the measurements."""
    out_dir = Path(out_dir)
    js = write_json(out_dir / f"{stem}.json", data, indent=indent, default=default, newline=newline)
    return [write_text(out_dir / f"{stem}.md", markdown() if callable(markdown) else markdown), js]
