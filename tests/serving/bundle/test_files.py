"""serving/bundle/files.py: bounded reads of bundle files."""
from __future__ import annotations

import pytest

from serving.bundle.files import read_bounded


def test_read_bounded_reads_the_file_whatever_the_bound():
    """A bound far above the file (the calibration.json of 10⁷ classes is allowed 40 GB) costs
    nothing: only the file's own bytes are allocated (read(n) used to allocate the bound)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "f"
        p.write_bytes(b"x" * 1000)
        assert read_bounded(p, 1 << 50) == b"x" * 1000
        assert read_bounded(p, 1000) == b"x" * 1000
        with pytest.raises(ValueError, match="over the limit of 999"):
            read_bounded(p, 999)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_swap_dir_puts_the_new_folder_in_place_and_removes_the_old(tmp_path, monkeypatch, exchange):
    """Where the system exchanges two names in one step and where it cannot (two renames): either way
    the target holds exactly the staged files after, and nothing else is left beside it."""
    from serving.bundle import files

    if not exchange:
        monkeypatch.setattr(files, "exchange_dirs", lambda a, b: False)
    target, staged = tmp_path / "bundle", tmp_path / ".bundle.staging"
    target.mkdir()
    (target / "old.txt").write_text("old")
    staged.mkdir()
    (staged / "new.txt").write_text("new")
    files.swap_dir(staged, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]
    assert [(p.name, p.read_text()) for p in target.iterdir()] == [("new.txt", "new")]
    fresh = tmp_path / ".fresh"
    fresh.mkdir()
    files.swap_dir(fresh, tmp_path / "absent")  # no target yet: a plain rename
    assert (tmp_path / "absent").is_dir() and not fresh.exists()


def test_exchange_dirs_swaps_both_names_or_says_it_cannot(tmp_path):
    from serving.bundle.files import exchange_dirs

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "1").write_text("a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2").write_text("b")
    if not exchange_dirs(tmp_path / "a", tmp_path / "b"):
        pytest.skip("this system cannot exchange two names in one step (swap_dir falls back to two renames)")
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["2"] and [p.name for p in (tmp_path / "b").iterdir()] == ["1"]
