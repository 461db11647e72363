"""The house's floors: tools/ above trainer/ and serving/, the trainer reading only serving's
bundle format, the server never the trainer (docs/ARCHITECTURE.md). Read from every module's
import statements (ast), so an upward import anywhere, even inside a function, fails here."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    """Top-level package-qualified names every import statement of `path` reaches."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _offenders(package: str, allowed) -> list[str]:
    return [f"{p.relative_to(ROOT)}: {name}" for p in _modules(package) for name in sorted(_imports(p))
            if not allowed(name)]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("package", ["trainer", "serving", "models", "slc"])  # slc names tools' commands as strings
def test_no_library_package_imports_the_tools(package):
    assert _offenders(package, lambda n: not _under(n, "tools")) == []


def test_the_check_sees_imports_inside_functions():
    """tools/cli.py imports trainer modules inside its commands: the walk finds them."""
    assert any(o.startswith("tools/cli.py: tools.experiments.glyphs") for o in
               _offenders("tools", lambda n: not _under(n, "tools.experiments")))


def test_the_server_never_imports_the_trainer_or_models():
    assert _offenders("serving", lambda n: not (_under(n, "trainer") or _under(n, "models"))) == []


def test_the_trainer_reads_only_the_bundle_format_of_serving():
    assert _offenders("trainer", lambda n: not _under(n, "serving") or _under(n, "serving.bundle")) == []
