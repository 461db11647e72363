"""serving/bundle/output.py: the one guarded output. Checks against the folder's bytes before and after."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from serving.bundle import output
from serving.bundle.output import OutputRefused, check, clean_stale, kind_of, lock, staged

ROOT = Path(__file__).resolve().parents[3]


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root (links as their target text) -> sha256: what the user had, byte for byte."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _bundle(path: Path, classes: int = 4, **kw) -> Path:
    from serving.bundle.synthetic import build_synthetic_bundle

    return build_synthetic_bundle(classes=classes, dim=8, input_dim=6, out=path, **kw)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_commit_replaces_only_the_old_artefacts_names_and_carries_the_rest(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(output._files, "exchange_dirs", lambda a, b: False)
    target = _bundle(tmp_path / "b", classes=4)
    (target / "notes.txt").write_text("mine")
    (target / "plots").mkdir()
    (target / "plots" / "a.png").write_bytes(b"png")
    old_names = output.bundle_names(target)
    _bundle(tmp_path / "b", classes=6, overwrite=True)
    new_manifest = json.loads((target / "manifest.json").read_text())
    assert new_manifest["num_classes"] == 6
    assert (target / "notes.txt").read_text() == "mine" and (target / "plots" / "a.png").read_bytes() == b"png"
    assert output.bundle_names(target) == {"manifest.json", *new_manifest["files"]}
    assert old_names  # the old one was recognised, so --overwrite was allowed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]  # no stage, note, lock or old folder left


def test_a_foreign_entry_whose_name_the_new_artefact_takes_is_kept_beside(tmp_path):
    target = _bundle(tmp_path / "b")
    (target / "head_int8.npy").write_bytes(b"a user's file of that name")
    _bundle(tmp_path / "b", overwrite=True, heads=("int8",))
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("b.kept-")]
    assert len(kept) == 1 and (kept[0] / "head_int8.npy").read_bytes() == b"a user's file of that name"


@pytest.mark.parametrize("case", ["not_a_bundle", "stray_manifest", "a_file", "a_symlink", "holds_input", "inside_input",
                                  "current_folder", "tampered_bundle"])
def test_check_refuses_in_one_line_and_touches_nothing(tmp_path, monkeypatch, case):
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("notes")
    src = _bundle(tmp_path / "src")
    out = {"not_a_bundle": user, "stray_manifest": user, "a_file": user / "notes.txt", "a_symlink": tmp_path / "link",
           "holds_input": tmp_path, "inside_input": src / "sub", "current_folder": Path("."),
           "tampered_bundle": src}[case]
    if case == "stray_manifest":
        (user / "manifest.json").write_text('{"name": "my web app"}')
    if case == "a_symlink":
        (tmp_path / "link").symlink_to(user)
    if case == "current_folder":
        monkeypatch.chdir(user)
    if case == "tampered_bundle":
        (src / "head_bias.npy").write_bytes((src / "head_bias.npy").read_bytes()[:-4] + b"\0\0\0\0")
    before = snapshot(tmp_path)
    with pytest.raises(OutputRefused) as err:
        check(out, "bundle", overwrite=True, inputs=[] if case in ("tampered_bundle",) else [src])
    assert "\n" not in str(err.value) and str(out) in str(err.value)
    assert snapshot(tmp_path) == before


def test_in_place_follows_a_symlink_to_the_real_bundle(tmp_path):
    real = _bundle(tmp_path / "real")
    (tmp_path / "link").symlink_to(real)
    assert check(tmp_path / "link", "bundle", in_place=True, inputs=[tmp_path / "link"]) == real.resolve()


def test_a_second_process_is_refused_while_the_first_holds_the_lock(tmp_path):
    target = tmp_path / "out"
    code = ("import sys; from pathlib import Path; from serving.bundle.output import lock, OutputRefused\n"
            "try:\n    lock(Path(sys.argv[1])).__enter__()\nexcept OutputRefused as e:\n    print(e); sys.exit(2)\n")
    with lock(target):
        r = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 2 and f"pid {os.getpid()}" in r.stdout and str(target) in r.stdout
        with lock(target):  # the same process again (a command, then its library call): held, not refused
            pass
        assert (tmp_path / ".out.slc-lock").exists()
    assert not (tmp_path / ".out.slc-lock").exists()
    r = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout


def _killed_mid_swap(tmp_path: Path, exchanged: bool, two_renames: bool = False) -> tuple[Path, Path]:
    """A bundle at b (with a user's notes), a complete stage of a new one, and the note a run writes
    just before it renames anything; then the renames that run got through before it was killed."""
    target = _bundle(tmp_path / "b", classes=4)
    (target / "notes.txt").write_text("mine")
    stage = tmp_path / f".b{output.STAGE}99999"
    _bundle(tmp_path / "new", classes=6)
    os.replace(tmp_path / "new", stage)
    own = output.bundle_names(target)
    output._note(stage).write_text(json.dumps({"inode": stage.stat().st_ino, "own": sorted(own)}))
    if exchanged and not two_renames:
        assert output._files.exchange_dirs(stage, target)
    if two_renames:
        os.replace(target, stage.with_name(stage.name + "-old"))  # killed before the second rename
    return target, stage


@pytest.mark.parametrize("state", ["before_any_rename", "exchanged", "between_two_renames"])
def test_the_next_run_finishes_a_swap_a_killed_run_left(tmp_path, state):
    target, stage = _killed_mid_swap(tmp_path, exchanged=state != "before_any_rename",
                                     two_renames=state == "between_two_renames")
    with lock(target):
        cleaned = clean_stale(target)
    assert cleaned
    assert (target / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]
    classes = json.loads((target / "manifest.json").read_text())["num_classes"]
    assert classes == (4 if state == "before_any_rename" else 6)
    assert output.bundle_names(target) is not None  # a whole bundle either way


def test_a_stage_a_killed_run_left_is_removed_by_the_next_write(tmp_path):
    stale = tmp_path / f".b{output.STAGE}12345"
    stale.mkdir()
    (stale / "head_weight.npy").write_bytes(b"half")
    legacy = tmp_path / ".b.recalibrating-777"
    legacy.mkdir()
    _bundle(tmp_path / "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_a_failed_verification_replaces_nothing(tmp_path):
    target = _bundle(tmp_path / "b")
    before = snapshot(tmp_path)
    with pytest.raises(output.WriteFailed, match="fails verification"):
        with staged(target, "bundle", overwrite=True, verify=lambda stage: ["samples.npz: wrong"]) as stage:
            (stage / "x").write_text("new")
    assert snapshot(tmp_path) == before


def test_report_files_never_replace_a_file_slc_did_not_write(tmp_path):
    from tools.report import write_text

    (tmp_path / "report.md").write_text("the user's own report")
    first = write_text(tmp_path / "report.md", "slc's report")
    assert first.name == "report-2.md" and (tmp_path / "report.md").read_text() == "the user's own report"
    again = write_text(tmp_path / "report-2.md", "slc's report, again")  # slc's own file: replaced in place
    assert again == first and first.read_text() == "slc's report, again"
    fresh = write_text(tmp_path / "scale.json", "{}")
    assert fresh.name == "scale.json"
    fresh.write_text("edited by hand")  # edited since: no longer slc's
    assert write_text(fresh, "{}").name == "scale-2.json" and fresh.read_text() == "edited by hand"


def test_caches_replace_only_their_own_kind(tmp_path):
    stage = tmp_path / ".stage"
    stage.mkdir()
    (stage / "x").write_text("1")
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("n")
    with pytest.raises(OutputRefused, match="is not a bundle slc built"):
        output.replace_cache(stage, user, "bundle")
    assert (user / "notes.txt").read_text() == "n"


def test_every_kind_a_command_names_is_registered():
    for name in ("bundle", "run", "Triton repository", "report folder", "glyph set", "image cache"):
        assert kind_of(name).name == name
