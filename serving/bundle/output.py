"""The one guarded output: every folder a command writes goes through here (docs/cli.md, "Output folders").

A command names the kind of folder it writes (a bundle, a run, a Triton repository, a report folder)
and its inputs. Before any work, `check` refuses in one line (OutputRefused, exit 2):
- a file, or a symlink where a folder would be replaced (`--in-place` follows the link instead);
- the current folder or one above it; a folder that holds an input, or lies inside one;
- a non-empty folder that is not an artefact of that kind (recognised by content: a bundle's
  manifest with its own hash and its files' hashes, a run's config; never by a file name alone);
- an artefact of that kind without `--overwrite`;
- a folder another slc command is writing (`lock`: one wins, the other is told which folder).

Whole kinds are written by `staged`: a staging folder beside the output is written, verified, then
swapped with the output in one rename exchange. Only the names the old artefact consists of go; any
other entry it held (a user's notes) is carried into the new one. A staging folder a killed run left
is removed by the next run on the same output (the lock says no live writer owns it).

Report folders are only added to: a file of the report's name that slc did not write (the folder's
ledger `.slc-written.json` lists what slc wrote, with hashes) is kept, and the report goes beside it.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

from serving.bundle import files as _files
from serving.bundle.files import fsync_dir, fsync_tree

log = logging.getLogger("slc.output")

STAGE = ".slc-stage-"  # .NAME.slc-stage-PID: a folder being written; + ".json": a swap under way
LEGACY_STAGES = (".staging-", ".recalibrating-", ".folding")  # what earlier versions left: only copies
LEDGER = ".slc-written.json"  # a report folder's record of the files slc wrote: {name: sha256}
SHOW = 4  # names listed when a folder is described


class OutputRefused(ValueError):
    """This output may not be written; one line, before any work (commands exit 2)."""


class WriteFailed(ValueError):
    """The staged artefact failed its verification; nothing was replaced."""


@dataclass(frozen=True)
class Kind:
    """A kind of output folder. `own(path)`: the names an artefact of this kind in `path` consists of,
    None when `path` is not one. `whole`: written as a whole (staged, swapped); else file by file."""

    name: str
    own: Callable[[Path], Optional[set[str]]]
    whole: bool = True
    hint: str = "choose another --out"  # what else to do, for the "already holds" line
    about: Callable[[Path], str] = lambda path: ""  # the artefact in a few words: " (ce on digits, finished)"


KINDS: dict[str, Kind] = {}


def register(kind: Kind) -> Kind:
    KINDS[kind.name] = kind
    return kind


def kind_of(name: str) -> Kind:
    if name not in KINDS:  # run and repository kinds register when their package is imported
        _import_kind(name)
    return KINDS[name]


def _import_kind(name: str) -> None:
    import importlib

    module = {"run": "trainer.run_dir", "Triton repository": "serving.bundle.triton", "glyph set": "trainer.data.glyphs", "image cache": "trainer.data.imagefiles"}.get(name)
    if module:
        importlib.import_module(module)


# ------------------------------------------------------------------------------ recognising artefacts
def bundle_names(path: Path) -> Optional[set[str]]:
    """The names of the bundle in `path`: its manifest (format, own hash) and every file it lists,
    each at its size and sha256; None when `path` holds no such bundle."""
    from serving.bundle.format import FORMAT, MANIFEST, SELF_HASH_KEY, canonical_manifest_hash, json_load, sha256_file

    try:
        manifest = json_load((path / MANIFEST).read_bytes()) if not (path / MANIFEST).is_symlink() else None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict) \
                or canonical_manifest_hash(manifest) != manifest.get(SELF_HASH_KEY):
            return None
    except (OSError, ValueError):
        return None
    names = {MANIFEST}
    for name, info in manifest["files"].items():
        p = path / str(name)
        if "/" in str(name) or not p.is_file() or p.is_symlink() or not isinstance(info, dict):
            return None
        if p.stat().st_size != info.get("bytes") or sha256_file(p)[0] != info.get("sha256"):
            return None
        names.add(str(name))
    return names


def report_names(path: Path) -> Optional[set[str]]:
    return set()  # a report folder is only added to: every folder may take reports


register(Kind("bundle", bundle_names))
register(Kind("report folder", report_names, whole=False))


def describe(path: Path) -> str:
    """What a folder holds, in a few words: `data/, notes.txt and 3 more`."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    shown = ", ".join(names[:SHOW])
    return shown + (f" and {len(names) - SHOW} more" if len(names) > SHOW else "")


# ------------------------------------------------------------------------------ the checks
def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def real_target(out: Path | str, in_place: bool = False, follow: bool = False) -> Path:
    """The absolute path written: the folder's parent resolved (links above it followed), the folder
    itself followed only when `in_place` or `follow` (a report folder)."""
    out = Path(out).expanduser()
    if in_place or follow:
        return out.resolve()
    return Path(os.path.realpath(out.parent)) / out.name


def check(out: Path | str, kind: str, *, overwrite: bool = False, inputs: Iterable[Path | str] = (),
          in_place: bool = False) -> Path:
    """The folder to write for `out` (module doc), or OutputRefused naming what is there."""
    k = kind_of(kind)
    out = Path(out).expanduser()
    if out.is_symlink() and k.whole and not in_place:
        raise OutputRefused(f"--out {out} is a symlink (to {os.readlink(out)}); slc never replaces a link: give the "
                            "folder itself, or a new one")
    target = real_target(out, in_place, follow=not k.whole)
    if target.exists() and not target.is_dir():
        raise OutputRefused(f"--out {out} is a file ({target.stat().st_size:,} bytes), not a folder; give a new "
                            f"folder for the {k.name}")
    _check_place(out, target, [Path(p).expanduser().resolve() for p in inputs if p is not None], in_place, k.whole)
    if in_place or not target.is_dir() or not any(target.iterdir()) or not k.whole:
        return target
    if k.own(target) is None:
        raise OutputRefused(f"--out {out} is not a {k.name} written by slc (it holds {describe(target)}); give a new "
                            f"or empty folder (--overwrite replaces only a {k.name})")
    if not overwrite:
        raise OutputRefused(f"--out {out} already holds a {k.name}{k.about(target)}; add --overwrite to replace it, "
                            f"or {k.hint.format(out=out)}")
    return target


def _check_place(out: Path, target: Path, inputs: list[Path], in_place: bool, whole: bool = True) -> None:
    """The current folder and the inputs (a report folder may be either: it only adds files)."""
    cwd = Path.cwd().resolve()
    if whole and _inside(cwd, target):
        what = "the current folder" if target == cwd else f"a folder above the current one ({cwd})"
        raise OutputRefused(f"--out {out} is {what}; give a new folder, e.g. --out out/NAME")
    for src in inputs:
        if in_place and src == target:
            continue
        if _inside(src, target) and (whole or src == target):
            what = "is the input" if src == target else f"holds the input {src}"
            raise OutputRefused(f"--out {out} {what}; give a folder outside it")
        if whole and src.is_dir() and _inside(target, src):
            raise OutputRefused(f"--out {out} lies inside the input {src}; give a folder outside it")


# ------------------------------------------------------------------------------ one writer at a time
_HELD: dict[str, int] = {}  # lock files this process holds, with their depth (a command, then its library call)


@contextlib.contextmanager
def lock(target: Path) -> Iterator[None]:
    """Hold `target`'s lock (a file beside it, flock'ed; removed when released): OutputRefused at once
    when another process holds it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    path = target.parent / f".{target.name}.slc-lock"
    key = str(path)
    if key in _HELD:
        _HELD[key] += 1
        try:
            yield
        finally:
            _HELD[key] -= 1
        return
    fd = _acquire(path, target)
    _HELD[key] = 1
    try:
        yield
    finally:
        del _HELD[key]
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def _acquire(path: Path, target: Path) -> int:
    """An open, locked descriptor of `path`, the file still at that name (an unlink raced is retried)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise OutputRefused(f"{target} is being written by another slc command (pid {holder}); wait for it "
                                    "to finish or choose another --out") from None
            raise
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            return fd
        os.close(fd)


# ------------------------------------------------------------------------------ whole kinds: stage, verify, swap
@contextlib.contextmanager
def staged(out: Path | str, kind: str, *, overwrite: bool = False, inputs: Iterable[Path | str] = (),
           in_place: bool = False, verify: Optional[Callable[[Path], list[str]]] = None) -> Iterator[Path]:
    """Yield an empty staging folder beside the output; when the block ends without an error, the
    stage is verified (`verify(stage)` -> problems) and swapped into place (module doc)."""
    target = check(out, kind, overwrite=overwrite, inputs=inputs, in_place=in_place)
    with lock(target):
        clean_stale(target)
        stage = target.parent / f".{target.name}{STAGE}{os.getpid()}"
        stage.mkdir()
        try:
            yield stage
            if verify is not None and (problems := verify(stage)):
                raise WriteFailed(f"the new {kind} fails verification, nothing was replaced: " + "; ".join(problems[:3]))
            commit(stage, target, kind_of(kind))
        finally:
            if stage.exists() and not _note(stage).exists():
                shutil.rmtree(stage, ignore_errors=True)


def _note(stage: Path) -> Path:
    """The swap's note beside its stage: the stage's inode and the old artefact's own names, written
    before anything is renamed, so that a run killed mid-swap is finished by the next one (clean_stale)."""
    return stage.with_name(stage.name + ".json")


def commit(stage: Path, target: Path, kind: Kind) -> Path:
    """Put the complete `stage` at `target`: one exchange where Linux can, else two renames; the old
    artefact's own names are removed and anything else it held is carried into the new folder."""
    fsync_tree(stage)
    if not target.exists():
        os.replace(stage, target)
        fsync_dir(target.parent)
        return target
    own = kind.own(target) or set()
    note = _note(stage)
    note.write_text(json.dumps({"inode": stage.stat().st_ino, "own": sorted(own)}))
    fsync_dir(target.parent)
    if _files.exchange_dirs(stage, target):
        old = stage
    else:
        old = stage.with_name(stage.name + "-old")
        os.replace(target, old)
        os.replace(stage, target)
    fsync_dir(target.parent)
    _retire(old, target, own)
    note.unlink()
    return target


def _retire(old: Path, target: Path, own: set[str]) -> None:
    """Carry the entries of a replaced artefact that were not its own into `target`, then remove it;
    an entry whose name the new artefact took keeps the old folder, renamed so that a user sees it."""
    kept = []
    for entry in sorted(old.iterdir()):
        if entry.name in own:
            continue
        if (target / entry.name).exists() or (target / entry.name).is_symlink():
            kept.append(entry.name)
        else:
            os.replace(entry, target / entry.name)
    if kept:
        keep = target.parent / f"{target.name}.kept-{os.getpid()}"
        os.replace(old, keep)
        log.warning("%s: %s of the replaced folder clash with the new files; kept in %s", target, ", ".join(kept), keep)
        return
    shutil.rmtree(old)


def clean_stale(target: Path) -> list[Path]:
    """Finish or remove what killed runs left beside `target` (the caller holds its lock, so no live
    writer owns any of it): a swap cut short is completed, a stage never swapped is removed."""
    cleaned = []
    prefix = f".{target.name}"
    for note in sorted(target.parent.glob(glob.escape(prefix + STAGE) + "*.json")):
        _finish_swap(note, target)
        cleaned.append(note)
    for p in sorted(target.parent.glob(glob.escape(prefix) + ".*")):
        rest = p.name[len(prefix):]
        if p.is_dir() and not p.is_symlink() and rest.startswith((STAGE, *LEGACY_STAGES)):
            shutil.rmtree(p)  # never swapped: it holds what that run wrote, nothing else
            cleaned.append(p)
    for p in cleaned:
        log.warning("cleaned %s, left by a killed run", p)
    return cleaned


def _finish_swap(note: Path, target: Path) -> None:
    stage = note.with_name(note.name[:-len(".json")])
    aside = stage.with_name(stage.name + "-old")
    info = json.loads(note.read_text())
    own = set(info.get("own", []))
    if aside.is_dir():  # two renames: the old folder was moved aside; the new one may not be in place yet
        if not target.exists() and stage.is_dir():
            os.replace(stage, target)
        _retire(aside, target, own)
    elif stage.is_dir():
        if stage.stat().st_ino == info.get("inode"):
            shutil.rmtree(stage)  # not exchanged: the old artefact is still the target
        else:
            _retire(stage, target, own)  # exchanged: the stage's name holds the old artefact
    note.unlink()


# ------------------------------------------------------------------------------ caches slc builds for itself
def replace_cache(stage: Path | str, target: Path | str, kind: str) -> Path:
    """Move a fully written cache folder (a rendered dataset, a bench bundle, the default model) into
    place, replacing only an artefact of the same kind: OutputRefused for anything else at `target`."""
    stage, target = Path(stage), real_target(target)
    k = kind_of(kind)
    if target.exists() and (not target.is_dir() or (any(target.iterdir()) and k.own(target) is None)):
        raise OutputRefused(f"{target} is not a {k.name} slc built (it holds {describe(target) if target.is_dir() else 'a file'}); "
                            "move it away and run again")
    with lock(target):
        return commit(stage, target, k)


# ------------------------------------------------------------------------------ report folders: added to
def report_file(path: Path | str) -> Path:
    """Where a report file meant for `path` is written: `path` itself, unless a file is there that slc
    did not write (the folder's ledger), which is kept: then NAME-2.EXT (or -3, ...) beside it."""
    path = Path(path)
    ledger = _ledger(path.parent)
    candidate, n = path, 1
    while candidate.exists() or candidate.is_symlink():
        if candidate.is_file() and not candidate.is_symlink() and ledger.get(candidate.name) == _sha(candidate):
            return candidate
        n += 1
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
    if candidate != path:
        log.warning("%s is not a file slc wrote: kept; the report goes to %s", path, candidate.name)
    return candidate


def record(path: Path | str) -> Path:
    """Enter a report file slc has just written into its folder's ledger."""
    from serving.bundle.files import atomic_write_text

    path = Path(path)
    ledger = _ledger(path.parent)
    ledger[path.name] = _sha(path)
    atomic_write_text(path.parent / LEDGER, json.dumps(dict(sorted(ledger.items())), indent=0) + "\n")
    return path


def _ledger(folder: Path) -> dict[str, str]:
    try:
        data = json.loads((folder / LEDGER).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
