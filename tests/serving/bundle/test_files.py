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


def test_exchange_dirs_swaps_both_names_or_says_it_cannot(tmp_path):
    from serving.bundle.files import exchange_dirs

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "1").write_text("a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2").write_text("b")
    if not exchange_dirs(tmp_path / "a", tmp_path / "b"):
        pytest.skip("this system cannot exchange two names in one step (output.commit falls back to two renames)")
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["2"] and [p.name for p in (tmp_path / "b").iterdir()] == ["1"]
