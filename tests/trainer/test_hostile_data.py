"""The trainer never destroys what it did not write, and reads only what it should (issue 39):
`--out` / `--overwrite` onto folders that are not runs (every byte checked before and after),
FIFOs, dangling symlinks and missing CSV rows named in one line or skipped with a count, two
paths to one file caught, a same-size same-mtime rewrite that changes the fingerprint, and a
decoded-size bound on image files."""
from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.trainer.test_imagefolder import render_folder
from trainer.data import data_record, load_dataset, load_run_data
from trainer.data import imagefiles
from trainer.run_dir import RUN_FILES, clear_run, run_config
from trainer.train import TrainConfig, train

ROOT = Path(__file__).resolve().parents[2]
SLC = [sys.executable, "-m", "slc"]


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SLC_HOME", str(tmp_path / "home"))


def snapshot(root: Path) -> dict[str, str]:
    """Independent truth of a tree: every path -> sha256 of a file's bytes, 'dir', or the link target."""
    out = {}
    for here, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(here, name)
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _slc(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(SLC + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _train_args(data: Path) -> list[str]:
    return ["train", "--dataset", f"imagefolder:{data}", "--epochs", "1", "--backbone", "mlp"]


@pytest.fixture
def project(tmp_path) -> Path:
    """P holding P/data (an image folder) and P/notes.txt: a user's folder, not a run."""
    p = tmp_path / "P"
    render_folder(p / "data", classes="ABC", per_class=5)
    (p / "notes.txt").write_text("my notes\n")
    return p


@pytest.mark.parametrize("case", ["holds_the_data", "current_folder", "not_a_run", "a_file", "inside_the_data"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_out_that_is_not_a_run_is_one_line_exit_2_and_every_byte_stays(project, tmp_path, case, overwrite):
    out, cwd = {"holds_the_data": (project, tmp_path), "current_folder": (Path("."), project),
                "not_a_run": (project, tmp_path), "a_file": (project / "notes.txt", tmp_path),
                "inside_the_data": (project / "data" / "run", tmp_path)}[case]
    data = project / "data" if case != "not_a_run" else _other_data(tmp_path)
    before = snapshot(tmp_path)
    r = _slc(_train_args(data) + ["--out", str(out)] + (["--overwrite"] if overwrite else []), cwd)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    expected = {"holds_the_data": "holds the input", "current_folder": "current folder",
                "not_a_run": "is not a run written by slc (it holds data/, notes.txt)", "a_file": "exists and is not a directory",
                "inside_the_data": "lies inside the input"}[case]
    assert expected in lines[0]
    assert snapshot(tmp_path) == before


def _other_data(tmp_path: Path) -> Path:
    return render_folder(tmp_path / "elsewhere", classes="AB", per_class=5)


def _cfg(data: Path, **kw) -> TrainConfig:
    base = dict(dataset=f"imagefolder:{data}", backbone="mlp", backbone_params={"hidden": 16}, loss="ce", epochs=1,
                lr=0.01, seed=0, batch_size=8)
    return TrainConfig(**{**base, **kw})


def test_overwrite_replaces_only_the_runs_own_files_after_the_data_is_checked(tmp_path):
    data = _other_data(tmp_path)
    run = train(_cfg(data), tmp_path / "run", progress=False)
    assert run_config(run) is not None
    (run / "my-notes.txt").write_text("kept")
    (run / "plots").mkdir()
    (run / "plots" / "mine.png").write_bytes(b"x")
    # without --overwrite: refused, naming the run
    with pytest.raises(ValueError, match="already holds a run .ce on imagefolder"):
        train(_cfg(data), run, progress=False)
    # --overwrite with data that cannot be loaded: the old run is untouched
    before = snapshot(run)
    with pytest.raises(ValueError, match="not found"):
        train(_cfg(tmp_path / "nowhere"), run, progress=False, overwrite=True)
    (data / "A" / "0.png").write_bytes(b"broken")
    with pytest.raises(ValueError, match="A/0.png"):
        train(_cfg(data), run, progress=False, overwrite=True)
    assert snapshot(run) == before
    render_folder(tmp_path / "fixed", classes="AB", per_class=5)
    old_config = json.loads((run / "config.json").read_text())
    train(_cfg(tmp_path / "fixed", seed=3), run, progress=False, overwrite=True)
    assert json.loads((run / "config.json").read_text())["seed"] == 3 != old_config["seed"]
    assert (run / "my-notes.txt").read_text() == "kept" and (run / "plots" / "mine.png").read_bytes() == b"x"
    assert all((run / name).is_file() for name in ("config.json", "data.json", "checkpoint.pt", "metrics.json"))


def test_clear_run_removes_exactly_the_names_a_run_writes(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for name in RUN_FILES + ("config.json.tmp", "keep.txt", "checkpoint.pt.bak"):
        (run / name).write_text("x")
    (run / "checkpoints" / "step-1.pt").write_text("x")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "precious").write_text("p")
    (run / "tensorboard").symlink_to(target)  # a link is removed, never followed
    assert clear_run(run) == ["checkpoint.pt.bak", "keep.txt"]
    assert sorted(os.listdir(run)) == ["checkpoint.pt.bak", "keep.txt"]
    assert (target / "precious").read_text() == "p"


# ------------------------------------------------------------------------------ what is read
def test_a_fifo_is_named_in_one_line_or_skipped_never_opened(tmp_path, caplog):
    data = _other_data(tmp_path)
    os.mkfifo(data / "A" / "x.png")  # opening it for reading would wait for a writer forever
    with pytest.raises(ValueError) as err:
        load_dataset(f"imagefolder:{data}", progress=False)
    msg = str(err.value)
    assert "A/x.png" in msg and "FIFO" in msg and "--skip-bad-images" in msg and "\n" not in msg
    with caplog.at_level(logging.WARNING, logger="trainer.data.imagefiles"):
        s = load_dataset(f"imagefolder:{data}", skip_bad=True, progress=False)
    assert sum(len(s.split(n)[1]) for n in ("train", "calibration", "test")) == 10
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "skipped 1 unreadable" in warnings[0] and "A/x.png" in warnings[0]


def test_the_cli_names_a_fifo_and_exits_2(tmp_path):
    data = _other_data(tmp_path)
    os.mkfifo(data / "B" / "pipe.png")
    r = _slc(_train_args(data) + ["--out", str(tmp_path / "run")], tmp_path)
    assert r.returncode == 2 and "B/pipe.png" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "run").exists()


def _write_csv(path: Path, rows: list[tuple[str, str]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "label"])
        w.writerows(rows)


def test_missing_and_dangling_files_are_one_line_or_skipped_with_a_count(tmp_path, caplog):
    data = _other_data(tmp_path)
    rows = [(f"{c}/{i}.png", c) for c in "AB" for i in range(5)]
    os.symlink(tmp_path / "gone.png", data / "A" / "link.png")
    _write_csv(tmp_path / "list.csv", [(f"elsewhere/{p}", c) for p, c in rows]
               + [("elsewhere/A/link.png", "A"), ("elsewhere/B/9.png", "B")])
    with pytest.raises(ValueError) as err:
        load_dataset(f"csv:{tmp_path / 'list.csv'}", progress=False)
    msg = str(err.value)
    assert "elsewhere/A/link.png (a dangling symlink) and 1 more" in msg and "\n" not in msg
    with caplog.at_level(logging.WARNING, logger="trainer.data.imagefiles"):
        s = load_dataset(f"csv:{tmp_path / 'list.csv'}", skip_bad=True, progress=False)
    assert sum(len(s.split(n)[1]) for n in ("train", "calibration", "test")) == 10
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "skipped 2 unreadable" in warnings[0] and "elsewhere/B/9.png" in warnings[0]
    r = _slc(["train", "--dataset", f"csv:{tmp_path / 'list.csv'}", "--out", str(tmp_path / "run")], tmp_path)
    assert r.returncode == 2 and "elsewhere/A/link.png" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_two_paths_to_one_file_are_caught(tmp_path):
    data = _other_data(tmp_path)
    rows = [(f"elsewhere/{c}/{i}.png", c) for c in "AB" for i in range(5)]
    _write_csv(tmp_path / "dots.csv", rows + [("./elsewhere/A/0.png", "B")])
    with pytest.raises(ValueError, match=r"^\S+: ./elsewhere/A/0.png and elsewhere/A/0.png are the same file"):
        load_dataset(f"csv:{tmp_path / 'dots.csv'}", progress=False)
    _write_csv(tmp_path / "up.csv", rows + [("elsewhere/B/../A/1.png", "B")])
    with pytest.raises(ValueError, match="are the same file"):
        load_dataset(f"csv:{tmp_path / 'up.csv'}", progress=False)
    os.symlink(data / "A" / "2.png", data / "B" / "linked.png")  # one file in two class folders
    with pytest.raises(ValueError, match="A/2.png and B/linked.png are the same file"):
        load_dataset(f"imagefolder:{data}", progress=False)


# ------------------------------------------------------------------------------ the fingerprint means content
def _bmp_folder(root: Path) -> Path:
    """BMP files: every image of one size has one file size, whatever its pixels."""
    rng = np.random.default_rng(0)
    for c in "AB":
        (root / c).mkdir(parents=True)
        for i in range(5):
            Image.fromarray(rng.integers(0, 256, (24, 24), dtype=np.uint8)).save(root / c / f"{i}.bmp")
    return root


def test_a_same_size_same_mtime_rewrite_changes_the_fingerprint_and_the_pixels(tmp_path):
    data = _bmp_folder(tmp_path / "bmp")
    name = f"imagefolder:{data}"
    first = load_dataset(name, progress=False)
    info = {"dataset": name, "classes": first.classes, "input_shape": list(first.input_shape), **data_record(first)}
    target = data / "A" / "0.bmp"
    st = target.stat()
    Image.fromarray(np.full((24, 24), 7, np.uint8)).save(target)  # other pixels, same size
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert target.stat().st_size == st.st_size and target.stat().st_mtime_ns == st.st_mtime_ns
    again = load_dataset(name, progress=False)
    assert again.fingerprint != first.fingerprint
    rows = imagefiles.row_files(again)
    split = next(s for s, files in rows.items() if "A/0.bmp" in files)
    row = rows[split].index("A/0.bmp")
    assert np.all(again.split(split)[0][row] == 7)  # the new pixels, not the cached ones
    with pytest.raises(ValueError, match="not the data the run was trained on"):
        load_run_data(info, progress=False)


# ------------------------------------------------------------------------------ decoded size
def _png_header_only(path: Path, width: int, height: int, colour_type: int = 6) -> None:
    """A real PNG of width x height (colour type 6: RGBA), all zero, compressed row by row (a few
    hundred KB for 9000 x 9000 without ever holding the pixels)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    z, row = zlib.compressobj(9), b"\0" * (1 + width * 4)
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, colour_type, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


@pytest.mark.timeout(120)
def test_an_image_that_decodes_to_far_more_than_allowed_is_refused_by_its_header(tmp_path):
    data = _other_data(tmp_path)
    _png_header_only(data / "A" / "huge.png", 9000, 9000)
    assert (data / "A" / "huge.png").stat().st_size < 1_000_000
    with pytest.raises(ValueError) as err:
        load_dataset(f"imagefolder:{data}", progress=False)
    msg = str(err.value)
    assert "A/huge.png" in msg and "309 MiB" in msg and "128 MiB" in msg and "\n" not in msg
    s = load_dataset(f"imagefolder:{data}", skip_bad=True, progress=False)
    assert sum(len(s.split(n)[1]) for n in ("train", "calibration", "test")) == 10
    imagefiles_bound = imagefiles.FILE_MAX_DECODED_BYTES
    assert 9000 * 9000 * 4 > imagefiles_bound >= 4000 * 4000 * 4  # a 16-megapixel RGBA photo passes
