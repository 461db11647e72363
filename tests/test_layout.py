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


def test_the_trainer_reads_only_the_bundle_format_and_the_calibration_of_serving():
    allowed = ("serving.bundle", "serving.calibration")
    assert _offenders("trainer", lambda n: not _under(n, "serving") or _any_under(n, allowed)) == []


# ---------------------------------------------------------------------------- one room per idea
PRODUCT = ("slc", "serving", "trainer", "models", "tools")


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _package_of(module: str, is_package: bool) -> str:
    return module if is_package else module.rpartition(".")[0]


def test_no_module_imports_another_packages_private_names():
    """`from serving.x import _name` only inside serving/ (tests aside): a name another folder needs is
    made public where it lives."""
    offenders = []
    for path in (p for pkg in PRODUCT for p in _modules(pkg)):
        here = _package_of(_module_name(path), path.name == "__init__.py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                    node.module.split(".")[0] in PRODUCT:
                target = (ROOT / Path(*node.module.split(".")))
                there = node.module if target.is_dir() else node.module.rpartition(".")[0]
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private and there != here:
                    offenders.append(f"{path.relative_to(ROOT)}: from {node.module} import {', '.join(private)}")
    assert offenders == []


def _graph() -> dict[str, set[str]]:
    """module -> the product modules it imports (at the top or inside a function)."""
    paths = {_module_name(p): p for pkg in PRODUCT for p in _modules(pkg)}
    graph = {}
    for name, path in paths.items():
        targets = set()
        for imported in _imports(path):
            while imported and imported not in paths:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                targets.add(imported)
        graph[name] = targets
    return graph


def test_no_circle_between_modules():
    """Tarjan's strongly connected components over every import: none holds two modules (a package's
    __init__ re-exporting its own modules aside)."""
    graph, index, low, stack, on, circles = _graph(), {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    import sys
    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert circles == []


# ---------------------------------------------------------------------------- serving's floors
# serving.errors (the protocol-free vocabulary) <- codecs <- core <- fronts (http, grpc) <- main
FRAMEWORKS = ("fastapi", "starlette", "uvicorn", "grpc", "tritonclient", "httptools")
FRONTS = ("serving.http", "serving.grpc", "serving.main", "serving.cli")


def _any_under(name: str, prefixes) -> bool:
    return any(_under(name, p) for p in prefixes)


@pytest.mark.parametrize("floor", ["serving/core", "serving/codecs", "serving/gallery", "serving/bundle"])
def test_the_core_and_what_it_reads_import_no_web_or_rpc_framework(floor):
    assert _offenders(floor, lambda n: not _any_under(n, FRAMEWORKS)) == []


@pytest.mark.parametrize("floor", ["serving/core", "serving/codecs", "serving/gallery", "serving/bundle"])
def test_nothing_below_the_fronts_imports_a_front(floor):
    assert _offenders(floor, lambda n: not _any_under(n, FRONTS)) == []


def test_the_codecs_never_import_the_core():
    assert _offenders("serving/codecs", lambda n: not _under(n, "serving.core")) == []


@pytest.mark.parametrize("front, other", [("serving/http", "serving.grpc"), ("serving/grpc", "serving.http")])
def test_the_fronts_never_import_each_other(front, other):
    assert _offenders(front, lambda n: not _under(n, other)) == []


def test_the_core_runs_with_no_web_or_rpc_framework_importable():
    """A fresh interpreter where fastapi, starlette, uvicorn and grpc cannot be imported loads
    every core and codec module, and the neutral errors."""
    import subprocess
    import sys

    modules = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts)
                     for floor in ("serving/core", "serving/codecs") for p in _modules(floor))
    modules = [m.removesuffix(".__init__") for m in modules] + ["serving.errors"]
    code = ("import sys\n"
            f"for name in {FRAMEWORKS!r}: sys.modules[name] = None  # import fails\n"
            f"import importlib\nfor m in {modules!r}: importlib.import_module(m)\n"
            f"assert not [n for n in sys.modules if n.split('.')[0] in {FRAMEWORKS!r} and sys.modules[n] is not None]\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


# ---------------------------------------------------------------------------- no test hooks in the product
HOOKS = ("SLC_TEST_", "_for_tests", "import pytest", "from pytest")


@pytest.mark.parametrize("package", ["serving", "trainer", "models", "slc"])
def test_no_test_hook_lives_in_product_code(package):
    """What only tests need (a worker that stalls on cue, a switch read from the environment) lives in
    tests/ and reaches the product by monkeypatching (tests/serving/stalling_worker.py)."""
    assert [f"{p.relative_to(ROOT)}: {h}" for p in _modules(package) for h in HOOKS if h in p.read_text()] == []


# ---------------------------------------------------------------------------- the device as one backend
DEVICE_PACKAGE = "serving/core/device"  # the only place of the server that decides anything about CUDA


def _mentions_cuda(node: ast.AST) -> bool:
    for n in ast.walk(node):
        text = (n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute)
                else n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else "")
        if "cuda" in text.lower():
            return True
    return False


def cuda_branch_points(source: str) -> list[tuple[int, str]]:
    """(line, kind) of each CUDA branch point of a module: a condition (the test of an if, while,
    conditional expression, assert or comprehension filter, or any other boolean operation, comparison
    or `not` outside one) naming cuda (a name, attribute or string holding "cuda", any case: uses_cuda,
    device == "cuda"); a call loading libcuda; a "CUDAExecutionProvider" literal outside a counted
    condition. Docstrings, comments and plain messages are not branch points."""
    tree, found, seen = ast.parse(source), [], set()

    def mark(node: ast.AST, kind: str) -> None:
        found.append((node.lineno, kind))
        seen.update(id(n) for n in ast.walk(node))

    tests = [t for n in ast.walk(tree) for t in (
        [n.test] if isinstance(n, (ast.If, ast.While, ast.IfExp, ast.Assert)) else
        n.ifs if isinstance(n, ast.comprehension) else [])]
    for t in tests:
        if id(t) not in seen and _mentions_cuda(t):
            mark(t, "condition")
    for n in ast.walk(tree):
        if id(n) in seen:
            continue
        if isinstance(n, (ast.BoolOp, ast.Compare, ast.UnaryOp)) and _mentions_cuda(n):
            mark(n, "condition")
        elif isinstance(n, ast.Call) and any(isinstance(a, ast.Constant) and isinstance(a.value, str)
                                             and "libcuda" in a.value for a in n.args):
            mark(n, "libcuda load")
    for n in ast.walk(tree):
        if id(n) not in seen and isinstance(n, ast.Constant) and n.value == "CUDAExecutionProvider":
            mark(n, "provider literal")
    return sorted(found)


def cuda_branch_counts(root: Path = ROOT) -> dict[str, int]:
    """{serving/ file: its CUDA branch points}, files without any left out."""
    counts = {str(p.relative_to(root)): len(cuda_branch_points(p.read_text()))
              for p in sorted((root / "serving").rglob("*.py"))}
    return {path: n for path, n in counts.items() if n}


def test_no_cuda_branch_outside_the_device_backend():
    """Providers, the libcuda probe, device memory, lanes, the index policy and the device head pass are
    asked of serving/core/device/; no other module of the server tests for CUDA itself."""
    assert [p for p in cuda_branch_counts() if not p.startswith(DEVICE_PACKAGE + "/")] == []


@pytest.mark.parametrize("snippet, kinds", [
    ('lanes = n if threads > 1 and not runtime.uses_cuda else 1', ["condition"]),
    ('if device == "cuda":\n    pass', ["condition"]),
    ('on = wanted == "device" or (wanted == "auto" and rt.uses_cuda)', ["condition"]),
    ('P = [("CUDAExecutionProvider", {"use_tf32": "0"})]', ["provider literal"]),
    ('import ctypes\nlib = ctypes.CDLL("libcuda.so.1")', ["libcuda load"]),
    ('x = [p for p in ps if "CUDAExecutionProvider" in p]', ["condition"]),
    ('"""Runs on CUDA when asked."""\n# if device == "cuda"\nlog.info("cuda: %s", x)', []),
    ('lanes = backend.lanes(n, runtime)\nwhere = backend.kind(runtime)', []),
])
def test_the_cuda_check_sees_branches_and_not_prose(snippet, kinds):
    assert [kind for _, kind in cuda_branch_points(snippet)] == kinds


if __name__ == "__main__":  # python tests/test_layout.py [ROOT]: the CUDA branch points per serving/ file
    import sys

    counts = cuda_branch_counts(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT)
    for path, n in counts.items():
        print(f"{n:3d}  {path}")
    print(f"{sum(counts.values()):3d}  total in {len(counts)} files")
