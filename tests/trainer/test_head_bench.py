"""`slc bench head` writes one row per D for the head and for whole training steps, each with the
full, sampled and 2-shard figures measured (the shards in 2 real gloo processes)."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from slc.cli import root


@pytest.mark.integration
def test_bench_head_writes_every_size_with_all_three_heads(tmp_path):
    result = CliRunner().invoke(root, ["bench", "head", "--classes", "64,300", "--dim", "8", "--batch", "16",
                                       "--train-classes", "40", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "head-bench.json").read_text())
    assert [r["classes"] for r in data["head"]] == [64, 300] and [r["classes"] for r in data["train"]] == [40]
    for r in data["head"]:
        assert r["full_ms"] > 0 and r["sampled_ms"] > 0 and r["sharded_ms"] > 0
        assert r["rows_per_rank"] == -(-r["classes"] // 2) and r["sampled_columns"] == max(16, round(0.1 * r["classes"]))
    assert all(data["train"][0][k] > 0 for k in ("full_images_s", "sampled_images_s", "sharded_images_s"))
    md = (tmp_path / "head-bench.md").read_text()
    assert "| 300 | 8 | 16 | ce |" in md and "| 40 | 256 | 16 | ce |" in md
