"""Atomic writes: a reader sees the old file or the whole new one, never half of either.

One fsync policy for every writer (bundle manifest, index cache, staged bundles): the new
content is fsynced before the rename, and the directory after it, so a power cut after the
call returns keeps the new version.
"""
from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import Callable, Optional


def fsync_dir(path: Path | str) -> None:
    """Persist a directory entry (a rename into it); a no-op where directories cannot be opened."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Persist every file of a folder, then the folder (before it is renamed into place)."""
    for p in [path, *path.rglob("*")]:
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(path)


def atomic_replace(path: Path | str, write: Callable[[str], None], mode: int = 0o644) -> Path:
    """Call `write(tmp_path)` on a temporary file next to `path`, fsync it, rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, mode)  # mkstemp makes 0600
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def atomic_write_text(path: Path | str, text: str) -> Path:
    return atomic_replace(path, lambda tmp: Path(tmp).write_text(text))


def exchange_dirs(a: Path | str, b: Path | str) -> bool:
    """Swap two directory entries in one step (Linux renameat2 RENAME_EXCHANGE): a reader of either
    path sees the old directory or the new one, never neither. False where the system cannot."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    if renameat2(at_cwd, os.fsencode(str(a)), at_cwd, os.fsencode(str(b)), exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # a file system or kernel without it
        return False
    raise OSError(err, os.strerror(err), str(b))


def check_writable_dir(path: Path | str) -> Path:
    """`path` as an output directory, checked before long work starts: it must be a directory
    (or not exist yet) and its nearest existing ancestor must take a new file (probed, since
    permission bits say nothing for root or read-only mounts). OSError naming the path otherwise."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} exists and is not a directory")
    parent = path
    while not parent.exists():
        parent = parent.parent
    try:
        with tempfile.TemporaryFile(dir=parent, prefix=".slc-write-probe-"):
            pass
    except OSError as exc:
        raise PermissionError(f"cannot write to {path}: {parent} does not take new files ({exc.strerror})") from None
    return path


def not_regular(path: Path | str) -> Optional[str]:
    """Why `path` must not be opened as a bundle file, or None: it must be a regular file itself,
    not a symlink (whatever it points to), a FIFO (an open would block), a device or a directory.
    lstat only: nothing is opened."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None  # absence is reported by the checks that need the file
    except OSError as exc:
        return f"cannot be examined ({exc.strerror})"
    if stat.S_ISREG(st.st_mode):
        return None
    kind = ("a symlink" if stat.S_ISLNK(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
            else "a directory" if stat.S_ISDIR(st.st_mode) else "a device or socket")
    return f"is {kind}, not a regular file (bundle files are opened only as regular files)"


def read_bounded(path: Path | str, max_bytes: int) -> bytes:
    """A regular file's bytes, refusing one larger than `max_bytes` before reading it."""
    size = os.lstat(path).st_size
    if size > max_bytes:
        raise ValueError(f"{size} bytes is over the limit of {max_bytes} for this file")
    with open(path, "rb") as f:  # what is there, +1 to see growth (read(n) allocates n bytes up front)
        data = f.read(size + 1)
    if len(data) > size:
        raise ValueError(f"{path} grew while it was read")
    return data
