"""The server's wheel holds the product and nothing of the lab: `pip wheel .` packs slc/, serving/,
trainer/ and models/, never tools/ (the load tester, benchmarks and experiments are the second
distribution, slc-lab, in tools/pyproject.toml; docs/ARCHITECTURE.md, "Install"). Built from a copy
of the checkout (a build writes build/ and *.egg-info beside its sources), without build isolation:
the running interpreter's setuptools, nothing fetched. About 3 s for both wheels."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("slc", "serving", "trainer", "models")
COPIED = ("pyproject.toml", "README.md", *PRODUCT, "tools")


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, list[str]]:
    """{distribution: the names in its wheel} for the server (.) and slc-lab (./tools)."""
    tmp = tmp_path_factory.mktemp("wheels")
    src = tmp / "src"
    src.mkdir()
    for name in COPIED:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
        else:
            shutil.copy2(ROOT / name, src / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp / "out"), ".", "./tools"],
                           cwd=src, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    names = {}
    for wheel in (tmp / "out").glob("*.whl"):
        names[wheel.name.split("-")[0]] = zipfile.ZipFile(wheel).namelist()
    assert set(names) == {"slc", "slc_lab"}, names
    return names


def _packages(names: list[str]) -> set[str]:
    return {n.split("/")[0] for n in names if n.endswith(".py")}


def test_the_server_wheel_holds_no_experiment_code(wheels):
    names = wheels["slc"]
    assert not [n for n in names if n.startswith("tools/")], "tools/ is in the server's wheel"
    assert _packages(names) == set(PRODUCT)
    for module in ("slc/cli.py", "serving/main.py", "serving/bundle/format.py", "trainer/train.py",
                   "models/backbones.py", "serving/http/static/demo.html"):
        assert module in names, module


def test_the_lab_wheel_holds_the_whole_of_tools_and_nothing_else(wheels):
    names = wheels["slc_lab"]
    assert _packages(names) == {"tools"}
    tracked = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tools").rglob("*.py")
               if not {"build", "__pycache__"} & set(p.relative_to(ROOT).parts)}
    assert tracked == {n for n in names if n.endswith(".py")}, "a tools/ module is missing from slc-lab's wheel"


def test_the_lab_depends_on_the_server_and_brings_what_its_commands_import():
    """slc-lab requires slc and the load tester's and benches' libraries; the server's pyproject has no
    bench extra left to drift from it, and names no tools package."""
    server = tomllib.loads((ROOT / "pyproject.toml").read_text())
    lab = tomllib.loads((ROOT / "tools" / "pyproject.toml").read_text())
    assert lab["project"]["name"] == "slc-lab" and "slc" in lab["project"]["dependencies"]
    wanted = {d.split(">")[0].split("=")[0].split("[")[0] for d in lab["project"]["dependencies"]}
    assert {"matplotlib", "aiohttp", "schemathesis"} <= wanted
    assert "bench" not in server["project"]["optional-dependencies"]
    assert not [p for p in server["tool"]["setuptools"]["packages"]["find"]["include"] if p.startswith("tools")]


def test_make_setup_installs_the_lab_beside_the_server():
    """`make serve` / `make test` build .venv from nothing with everything: the lab comes with it."""
    makefile = (ROOT / "Makefile").read_text()
    assert '-e ".[$(EXTRAS)]" -e ./tools' in makefile
    assert "tools/pyproject.toml" in re.search(r"^\$\(STAMP\): (.*)$", makefile, flags=re.M).group(1).split()


def test_the_root_command_line_and_the_lab_name_the_same_install_line():
    """slc/cli.py cannot import tools/ (it may be absent), so it repeats the line: they must agree."""
    import tools
    from slc import cli

    assert cli.LAB_INSTALL == tools.LAB_INSTALL == "pip install ./tools"
