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
