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


# ---------------------------------------------------------------------------- the README
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)  # code is not a link
    return LINK.findall(text)


def test_the_readme_starts_with_its_two_commands():
    """`make serve` and `make test` are the first thing a newcomer reads (the Makefile builds .venv for both)."""
    lines = README.read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("```"))
    assert not [line for line in lines[1:first] if line.strip()], "nothing between the title and the two commands"
    assert [line.split()[:2] for line in lines[first + 1:first + 3]] == [["make", "serve"], ["make", "test"]]


def test_the_readme_is_short():
    """A newcomer's page: what it is, two commands, the first curl, your own images, then links into docs/."""
    assert len(README.read_text().splitlines()) <= 150


def test_the_readme_links_only_inside_the_repository():
    outside = [t for t in _links(README) if re.match(r"[a-z][a-z0-9+.-]*:", t) or t.startswith("//")]
    assert outside == []
    assert not re.search(r"(?<![\w/])(https?://(?!127\.0\.0\.1|localhost)|www\.)", README.read_text())


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "docs" / "results" / "README.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = [t for t in _links(page) if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)
              and not (page.parent / t.split("#")[0]).exists()]
    assert broken == []


def test_the_readme_s_commands_name_options_that_exist():
    """Every `slc ...` line of the README's code blocks: its command exists and every --option is one of
    that command's (a renamed option fails here, not in a newcomer's terminal)."""
    import shlex

    import click

    from slc.cli import root

    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    lines = [line.split("#")[0] for block in blocks for line in block.splitlines()
             if line.startswith((".venv/bin/slc ", "slc "))]
    assert len(lines) >= 6
    for line in lines:
        args = shlex.split(line)[1:]
        cmd, ctx = root, click.Context(root)
        while isinstance(cmd, click.Group):
            cmd = cmd.get_command(ctx, args.pop(0))
            assert cmd is not None, line
            ctx = click.Context(cmd)
        known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
        assert [a for a in args if a.startswith("--") and a.split("=")[0] not in known] == [], line


def test_your_own_images_is_five_commands_and_a_recalibration():
    section = README.read_text().split("## Your own images", 1)[1].split("\n## ", 1)[0]
    first = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1).splitlines()
    assert [line.split()[1] if line.startswith(".venv") else line.split()[0] for line in first] == \
        ["train", "export", "verify", "serve", "curl"]
    assert "--dataset imagefolder:" in first[0] and "/detect" in first[4] and "--data-binary @" in first[4]
    assert ".venv/bin/slc calibrate " in section


# ---------------------------------------------------------------------------- the results index
def test_the_results_index_has_a_headline_table_with_a_page_and_a_command_per_row():
    text = (ROOT / "docs" / "results" / "README.md").read_text()
    table = text.split("## Headline results", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in table.splitlines() if r.startswith("| ") and not r.startswith("| what")]
    assert len(rows) >= 10
    for row in rows:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
        assert len(cells) == 4, row
        what, figure, page, command = cells
        assert what and figure and re.fullmatch(r"\[[\w.-]+\.md\]\([\w.-]+\.md\)", page), row
        assert (ROOT / "docs" / "results" / page.split("(")[1].rstrip(")")).is_file(), row
        assert "`" in command, row


# ---------------------------------------------------------------------------- docs/ARCHITECTURE.md
PACKAGES = ("slc", "models", "trainer", "serving", "tools")


def _tree() -> set[str]:
    """Every module as the table names it: a file's path, a package by its folder (for its __init__.py)."""
    names = set()
    for package in PACKAGES:
        for p in (ROOT / package).rglob("*.py"):
            rel = p.relative_to(ROOT)
            if {"build", "__pycache__"} & set(rel.parts):
                continue
            names.add(f"{rel.parent.as_posix()}/" if p.name == "__init__.py" else rel.as_posix())
    return names


def _table() -> list[str]:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for line in section.splitlines() if (m := re.match(r"\| `([^`]+)` \|", line))]


def test_the_architecture_table_names_every_module_once():
    named = _table()
    assert len(named) == len(set(named)), [n for n in named if named.count(n) > 1]
    assert sorted(_tree() - set(named)) == [], "modules missing from docs/ARCHITECTURE.md's table"


def test_every_module_the_architecture_table_names_exists():
    assert sorted(set(_table()) - _tree()) == [], "docs/ARCHITECTURE.md names modules that are not in the tree"
