"""The documentation as a reader meets it: no path of the machine a page was written on (docs/ and
the README), a README that starts with its two commands, stays short and links only inside the
repository, a results index whose pages exist, and docs/ARCHITECTURE.md's module table equal to the tree."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TEXT = {".md", ".json", ".jsonl", ".csv", ".txt"}

# Paths that exist on one machine only: a checkout or scratch folder, a home directory. /home/me is
# the docs' placeholder user, /home/slc the images' user (deploy/); system paths (/usr/share/fonts)
# and the images' own (/opt/slc, /runs) are the same everywhere they are named.
MACHINE_PATH = re.compile(r"(?<![\w.~$}/-])/(?:work|tmp|root|Users|scratch)/|(?<![\w.~$}/-])/home/(?!me\b|slc\b)")


def _docs() -> list[Path]:
    return sorted(p for p in (ROOT / "docs").rglob("*") if p.suffix in TEXT) + [README]


def test_no_page_names_a_path_of_the_machine_it_ran_on():
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:120]}" for p in _docs()
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if MACHINE_PATH.search(line)]
    assert found == [], "\n".join(found[:20])


@pytest.mark.parametrize("line, bad", [("--out /tmp/scale_out", True), ("runs at /work/runs37/A-s0", True),
                                       ('"bundle": "/root/.cache/slc/b"', True), ("HOME=/home/alice/x", True),
                                       ("--out $TMPDIR/scale_out", False), ("~/.cache/slc", False),
                                       ("docs/tmp/x", False), ("/usr/share/fonts/x.ttf", False),
                                       ("imagefolder:/home/me/scans", False), ("HOME=/home/slc", False)])
def test_the_machine_path_pattern(line, bad):
    assert bool(MACHINE_PATH.search(line)) is bad
