"""tools/report.py: the number formatter against the two formatters it replaced, markdown tables
read back by an independent parser, and the result files read back from disk."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from tools.report import fmt, md_table, write_json, write_result, write_text

# (x, digits or None for the default, expected): each expected string is what the formatter this
# style replaced returned, computed by calling it at the commit before tools/report.py existed
# (`git show HEAD:tools/bench/report.py` `_fmt`, default digits 1; `HEAD:tools/loadtest/report.py`
# `_fmt`, default digits 2).
BENCH = [  # (x, digits or None for the default, expected)
    (None, None, '–'), (float("nan"), None, '–'), (float("inf"), None, '–'), (float("-inf"), None, '–'),
    (0.0, None, '0.0'), (-0.0, None, '-0.0'), (0.001, None, '1.00e-03'), (-0.005, None, '-5.00e-03'),
    (0.0099, None, '9.90e-03'), (0.01, None, '0.0'), (0.5, None, '0.5'), (2.0, None, '2.0'),
    (1234.5678, None, '1,234.6'), (-1234.5678, None, '-1,234.6'), (1000000000.0, None, '1,000,000,000.0'),
    (1e-07, None, '1.00e-07'), (0, None, '0'), (7, None, '7'), (1234567, None, '1,234,567'), (-42, None, '-42'),
    (True, None, '1'), (False, None, '0'), ('text', None, 'text'), (np.float64(0.001), None, '1.00e-03'),
    (np.float64(12345.678), None, '12,345.7'), (np.float32(1.5), None, '1.5'), (np.int64(12345), None, '12345'),
    (0.001, 0, '1.00e-03'), (-0.005, 0, '-5.00e-03'), (0.0099, 0, '9.90e-03'), (1234.5678, 0, '1,235'),
    (1e-07, 0, '1.00e-07'), (1234567, 0, '1,234,567'), (np.float64(0.001), 0, '1.00e-03'), (0.001, 3, '1.00e-03'),
    (-0.005, 3, '-5.00e-03'), (0.0099, 3, '9.90e-03'), (1234.5678, 3, '1,234.568'), (1e-07, 3, '1.00e-07'),
    (1234567, 3, '1,234,567'), (np.float64(0.001), 3, '1.00e-03'),
]
LOADTEST = [  # (x, digits or None for the default, expected)
    (None, None, '–'), (float("nan"), None, '–'), (float("inf"), None, '–'), (float("-inf"), None, '–'),
    (0.0, None, '0.00'), (-0.0, None, '-0.00'), (0.001, None, '0.00'), (-0.005, None, '-0.01'),
    (0.0099, None, '0.01'), (0.01, None, '0.01'), (0.5, None, '0.50'), (2.0, None, '2.00'),
    (1234.5678, None, '1,234.57'), (-1234.5678, None, '-1,234.57'), (1000000000.0, None, '1,000,000,000.00'),
    (1e-07, None, '0.00'), (0, None, '0'), (7, None, '7'), (1234567, None, '1234567'), (-42, None, '-42'),
    (True, None, 'True'), (False, None, 'False'), ('text', None, 'text'), (np.float64(0.001), None, '0.00'),
    (np.float64(12345.678), None, '12,345.68'), (np.float32(1.5), None, '1.5'), (np.int64(12345), None, '12345'),
    (0.001, 0, '0'), (-0.005, 0, '-0'), (0.0099, 0, '0'), (1234.5678, 0, '1,235'), (1e-07, 0, '0'),
    (1234567, 0, '1234567'), (np.float64(0.001), 0, '0'), (0.001, 3, '0.001'), (-0.005, 3, '-0.005'),
    (0.0099, 3, '0.010'), (1234.5678, 3, '1,234.568'), (1e-07, 3, '0.000'), (1234567, 3, '1234567'),
    (np.float64(0.001), 3, '0.001'),
]


@pytest.mark.parametrize("x, digits, want", BENCH, ids=repr)
def test_fmt_defaults_are_the_scale_reports_formatter(x, digits, want):
    assert (fmt(x) if digits is None else fmt(x, digits)) == want


@pytest.mark.parametrize("x, digits, want", LOADTEST, ids=repr)
def test_fmt_plain_style_is_the_load_reports_formatter(x, digits, want):
    got = fmt(x, 2 if digits is None else digits, sci_below=0, group_ints=False)
    assert got == want


def test_the_load_report_formats_through_fmt():
    from tools.loadtest.report import _fmt

    assert [_fmt(x) if d is None else _fmt(x, d) for x, d, _ in LOADTEST] == [w for _, _, w in LOADTEST]


def _parse(table: str) -> tuple[list[str], list[str], list[list[str]]]:
    """(headers, alignment per column 'l'/'r', rows) of a GitHub markdown table, cells stripped and unescaped."""
    def cells(line: str) -> list[str]:
        assert line.startswith("|") and line.endswith("|"), line
        return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line[1:-1])]

    head, rule, *body = table.split("\n")
    align = ["r" if c.endswith(":") else "l" for c in cells(rule)]
    assert all(re.fullmatch(r"-{3,}:?", c) for c in cells(rule))
    return cells(head), align, [cells(line) for line in body]


def test_md_table_reads_back_as_its_cells():
    headers = ["name", "count", "ratio", "note"]
    rows = [["alpha", 3, "1,234.5", "a \\| b"], ["beta", 12, "–", ""], ["gamma", 0, "1.00e-03", "x"]]
    got_headers, align, got_rows = _parse(md_table(headers, rows))
    assert got_headers == headers
    assert got_rows == [["alpha", "3", "1,234.5", "a | b"], ["beta", "12", "–", ""], ["gamma", "0", "1.00e-03", "x"]]
    assert align == ["l", "r", "r", "l"]  # numbers and numeric text right; a dash or an empty cell does not count


def test_md_table_explicit_alignment_and_exact_text():
    text = md_table(["D", "kind", "ms"], [["1,000", "ivf", "0.25"], ["10", "", "7"]], align="rlr")
    assert text == "| D | kind | ms |\n|---:|---|---:|\n| 1,000 | ivf | 0.25 |\n| 10 | | 7 |"
    assert not text.endswith("\n")
    assert md_table(["a", "b"], []) == "| a | b |\n|---|---|"


def test_md_table_infers_left_for_text_and_bools():
    _, align, _ = _parse(md_table(["a", "b", "c"], [[True, "3 / 4", 1.5], [False, "x", 2]]))
    assert align == ["l", "l", "r"]


@pytest.mark.parametrize("rows, align", [([["1", "2", "3"]], None), ([["1", "2"]], "rx"), ([["1", "2"]], "r")])
def test_md_table_refuses_ragged_rows_and_bad_alignment(rows, align):
    with pytest.raises(ValueError):
        md_table(["a", "b"], rows, align)


def test_write_result_round_trips_and_returns_the_paths(tmp_path):
    data = {"rows": [{"D": 1000, "rps": 1.5, "name": "détect"}], "none": None, "nested": {"b": [1, 2]}}
    out = tmp_path / "new" / "dir"
    md, js = write_result(out, "bench", "# title\n", data)
    assert (md, js) == (out / "bench.md", out / "bench.json")
    assert md.read_text(encoding="utf-8") == "# title\n"
    text = js.read_text(encoding="utf-8")
    assert json.loads(text) == data
    assert text.endswith("}\n") and '\n  "rows": [' in text  # indent 2, one final newline, keys in insertion order
    assert "\\u00e9" in text  # ASCII-escaped, as json.dumps does by default
    assert sorted(p.name for p in out.iterdir()) == [".slc-written.json", "bench.json", "bench.md"]  # no temporary file; the ledger


def test_write_result_options(tmp_path):
    data = {"x": np.float32(0.5), "n": [np.int64(3)]}
    _, js = write_result(tmp_path, "r", "", data, indent=1, default=float, newline=False)
    text = js.read_text()
    assert json.loads(text) == {"x": 0.5, "n": [3.0]}
    assert text.split("\n")[1].startswith(' "x"') and not text.endswith("\n")
    with pytest.raises(TypeError):
        write_result(tmp_path, "s", "", data)  # numpy values need a default, as json.dumps does


def test_a_markdown_function_is_rendered_after_the_json_is_on_disk(tmp_path):
    def render():
        assert json.loads((tmp_path / "r.json").read_text()) == {"a": 1}
        raise RuntimeError("renderer bug")

    with pytest.raises(RuntimeError):
        write_result(tmp_path, "r", render, {"a": 1})
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": 1} and not (tmp_path / "r.md").exists()
    md, _ = write_result(tmp_path, "r", lambda: "text", {"a": 2})
    assert md.read_text() == "text"


def test_write_text_and_write_json_replace_what_was_there(tmp_path):
    path = write_text(tmp_path / "a" / "b.md", "first, a longer text")
    write_text(path, "second")
    assert path.read_text() == "second"
    write_json(tmp_path / "a" / "c.json", [1, {"k": "v"}])
    assert (tmp_path / "a" / "c.json").read_text() == '[\n  1,\n  {\n    "k": "v"\n  }\n]\n'
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [".slc-written.json", "b.md", "c.json"]


# The tables two migrated writers produced before tools/report.py, as those writers printed them
# at the commit before (computed with `git show HEAD:tools/...`, then pasted here).
GALLERY_TABLE = ("| change | n | p50 ms | p99 ms | max ms | never seen (10 s) |\n|---|---:|---:|---:|---:|---:|\n"
                 "| upsert | 3 | 1.2 | 2.0 | 2.0 | 0 |\n| delete | 3 | 0.5 | 10.6 | 12.0 | 1 |\n")
LOAD_TABLE = ("| endpoint | requests | ok | req/s | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms | errors |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n"
              "| detect | 1200 | 1199 | 1,234.6 | 0.00 | 1.50 | – | – | 12,345.68 | timeout: 1 |\n")


def test_migrated_writers_print_the_tables_they_printed_before():
    from tools.bench.gallery_sync import markdown
    from tools.loadtest.report import report_markdown

    g = {"items": 3, "poll_s": 0.5, "writes_per_s": 1234.4,
         "upsert": {"n": 3, "p50_ms": 1.25, "p99_ms": 2.0, "max_ms": 2.04, "lost": 0},
         "delete": {"n": 3, "p50_ms": 0.5, "p99_ms": 10.55, "max_ms": 12.0, "lost": 1}}
    assert GALLERY_TABLE in markdown(g, "slc bench gallery")
    rep = {"endpoints": {"detect": {"requests": 1200, "ok": 1199, "goodput_rps": 1234.56,
                                    "latency_ms": {"p50": 0.004, "p90": 1.5, "p99": None, "p99.9": float("nan"),
                                                   "max": 12345.678},
                                    "errors": {"timeout": 1}}},
           "url": "http://x", "class": "cat", "batch": 1, "load": {"model": "closed", "concurrency": 4},
           "interleave": "request", "requests": 1200, "window_s": 10.0, "warmup_s": 1, "warmup_requests": 7,
           "client": "raw", "ratios": {}}
    assert report_markdown(rep).endswith(LOAD_TABLE)


def test_the_machine_s_paths_are_written_portably(tmp_path, monkeypatch):
    """A result page names no path of the machine it ran on: the working directory's files relative to
    it, the temporary and home directories as $TMPDIR and ~ (tests/test_docs.py checks docs/)."""
    import os
    import tempfile

    from tools.report import portable_paths

    work, home, temp = tmp_path / "checkout", tmp_path / "home" / "me", tmp_path / "tmp"
    for d in (work, home, temp):
        d.mkdir(parents=True)
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    text = (f"--out {work}/docs/results --base {work} bundle {home}/.cache/slc/bench/b1, "
            f"scratch {temp}/slc-index-bench; {work}-old stays; /usr/share/fonts stays")
    want = (f"--out docs/results --base . bundle ~/.cache/slc/bench/b1, scratch $TMPDIR/slc-index-bench; "
            f"{work}-old stays; /usr/share/fonts stays")
    assert portable_paths(text) == want
    page = write_text(work / "docs" / "page.md", text)
    assert page.read_text() == want and os.getcwd() == str(work)
    assert json.loads(write_json(work / "r.json", {"bundle": f"{temp}/b"}).read_text()) == {"bundle": "$TMPDIR/b"}
