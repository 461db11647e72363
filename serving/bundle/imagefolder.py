"""A user's labelled image files, listed: `imagefolder:DIR` (DIR/CLASS/*.png, or DIR/{train,val,test}/CLASS/...)
and `csv:FILE` (path,label[,split]) (docs/datasets.md). The listing alone, shared by the trainer (which
decodes them into a dataset: trainer/data/imagefiles.py) and `slc calibrate` (which embeds them with a
bundle's backbone): no image is opened here, only the files' names, kinds and identities.
"""
from __future__ import annotations

import csv
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from serving.bundle.image import EXTENSIONS

SPLITS = ("train", "calibration", "test")

SPLIT_ALIASES = {"train": "train", "val": "calibration", "calibration": "calibration", "test": "test"}


@dataclass(frozen=True)
class Entry:
    """One image file: its path relative to the dataset's root (as listed), label, and given split."""

    rel: str
    label: str
    split: str | None


def is_image_dataset(name: str) -> bool:
    return name.startswith(("imagefolder:", "csv:"))


def dataset_path(name: str) -> Path:
    """The folder of `imagefolder:DIR` or the file of `csv:FILE`."""
    return Path(name.partition(":")[2]).expanduser()


def check_name(name: str) -> None:
    """ValueError unless the folder / CSV file exists (nothing is read)."""
    path = dataset_path(name)
    if name.startswith("imagefolder:") and not path.is_dir():
        raise ValueError(f"image folder {str(path)!r} not found (imagefolder:DIR needs DIR/CLASS/*.png ...)")
    if name.startswith("csv:") and not path.is_file():
        raise ValueError(f"CSV file {str(path)!r} not found (csv:FILE needs columns path,label[,split])")


def absolute_name(name: str) -> str:
    """The dataset name with an absolute path, to load it again from anywhere."""
    kind, _, _ = name.partition(":")
    return f"{kind}:{dataset_path(name).resolve()}"


def _image_files(folder: Path, root: Path) -> list[str]:
    """Image files under `folder` (recursive, symlinks followed once, hidden names skipped), relative to root."""
    out, seen = [], set()
    for here, dirs, files in os.walk(folder, followlinks=True):
        real = os.path.realpath(here)
        if real in seen:  # a symlink loop
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out += [Path(here, f).relative_to(root).as_posix() for f in sorted(files)
                if not f.startswith(".") and f.lower().endswith(EXTENSIONS)]
    return out


def _class_entries(folder: Path, root: Path, split: str | None) -> list[Entry]:
    classes = sorted(d.name for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))
    return [Entry(rel, c, split) for c in classes for rel in _image_files(folder / c, root)]


def _folder_entries(root: Path) -> list[Entry]:
    """DIR/CLASS/... or DIR/{train,val|calibration,test}/CLASS/..."""
    top = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if "train" not in top:
        entries = _class_entries(root, root, None)
    else:
        if stray := [d for d in top if d not in SPLIT_ALIASES]:
            raise ValueError(f"image folder {root}: with a train/ folder, the others must be val (or calibration) "
                             f"and test, not {', '.join(stray)}")
        if "val" in top and "calibration" in top:
            raise ValueError(f"image folder {root}: give val/ or calibration/ (the same split), not both")
        found = {SPLIT_ALIASES[d] for d in top}
        if missing := [s for s in SPLITS if s not in found]:
            raise ValueError(f"image folder {root}: split folders train, val (or calibration) and test are all "
                             f"needed, {' and '.join(missing)} missing; or put every class folder in {root} itself "
                             "for a seeded 60/20/20 split")
        entries = [e for d in top for e in _class_entries(root / d, root, SPLIT_ALIASES[d])]
    if not entries:
        raise ValueError(f"image folder {root}: no image files ({', '.join(e[1:] for e in EXTENSIONS)}) "
                         "in class folders DIR/CLASS/")
    return entries


def _csv_entries(path: Path) -> list[Entry]:
    """Rows path,label[,split] of a CSV file with a header; paths relative to the CSV's folder."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        fields = [c.strip().lower() for c in reader.fieldnames or []]
        if "path" not in fields or "label" not in fields:
            raise ValueError(f"{path}: needs a header line with columns path,label[,split]; got {fields}")
        reader.fieldnames = fields
        has_split = "split" in fields
        entries, seen = [], set()
        for line, row in enumerate(reader, start=2):
            rel, label = (row.get("path") or "").strip(), (row.get("label") or "").strip()
            split = (row.get("split") or "").strip().lower() if has_split else None
            if not rel or not label:
                raise ValueError(f"{path} line {line}: path and label are both needed")
            if has_split and split not in SPLIT_ALIASES:
                raise ValueError(f"{path} line {line}: split {split!r} is not one of train, val, calibration, test")
            if rel in seen:
                raise ValueError(f"{path} line {line}: {rel} is listed twice")
            seen.add(rel)
            entries.append(Entry(rel, label, SPLIT_ALIASES[split] if has_split else None))
    if not entries:
        raise ValueError(f"{path}: no rows")
    if has_split and (missing := [s for s in SPLITS if s not in {e.split for e in entries}]):
        raise ValueError(f"{path}: the split column gives no {' and no '.join(missing)} rows; train, val (or "
                         "calibration) and test are all needed, or leave the column out for a seeded 60/20/20 split")
    return entries


def list_entries(name: str) -> tuple[Path, list[Entry]]:
    """(the folder paths are relative to, the entries sorted by path)."""
    check_name(name)
    path = dataset_path(name)
    if name.startswith("imagefolder:"):
        return path, sorted(_folder_entries(path), key=lambda e: e.rel)
    return path.parent, sorted(_csv_entries(path), key=lambda e: e.rel)


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _not_regular(path: Path) -> str | None:
    """Why `path` (symlinks followed) may not be read as an image file, or None for a regular file."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a dangling symlink" if os.path.islink(path) else "no such file"
    except OSError as exc:
        return one_line(exc)
    if stat.S_ISREG(mode):
        return None
    return "not a regular file: " + next((what for test, what in _KINDS if test(mode)), "a special file")


def check_files(name: str, root: Path, entries: list[Entry]) -> tuple[list[Entry], list[tuple[str, str]]]:
    """(the entries that are regular files, the others as (rel, why)), nothing opened; ValueError when
    two entries are one file (same device and inode: `./a.png` and `a.png`, a symlink, a hard link)."""
    ok, bad, seen = [], [], {}
    for e in entries:
        if why := _not_regular(root / e.rel):
            bad.append((e.rel, why))
            continue
        st = os.stat(root / e.rel)
        if (other := seen.setdefault((st.st_dev, st.st_ino), e.rel)) != e.rel:
            raise ValueError(f"{name}: {other} and {e.rel} are the same file; list each image once")
        ok.append(e)
    return ok, bad


def read_regular(path: str | os.PathLike) -> bytes:
    """The bytes of a regular file; OSError for anything else (a FIFO swapped in after the check
    is never waited on: opened non-blocking, refused by fstat before any read)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def one_line(exc: BaseException, data: bytes | None = None) -> str:
    """An error as one line, without Python object addresses; with the file's bytes, what they look
    like when Pillow could not tell (serving/bundle/sniff.py)."""
    from serving.bundle.sniff import describe, plain

    line = f"{type(exc).__name__}: {plain(' '.join(str(exc).split()))[:160]}"
    if data is not None and type(exc).__name__ == "UnidentifiedImageError":
        line += f" (the file holds {describe(data)})"
    return line
