"""tools/bench/device_profile.py on the CPU provider: one line per D, every node of the softmax graph
profiled (the graph's own node list is the truth), each on the provider asked for."""
from __future__ import annotations

import onnx

from serving.core.device import head as device_head
from tools.bench import device_profile


def test_the_profile_names_every_node_of_the_softmax_graph_on_its_provider(monkeypatch):
    monkeypatch.setattr(device_profile, "RUNS", 3)
    out = device_profile.profile(3000, 16, "cpu")
    blocks, width = device_head.block_shape(3000, 100)
    graph = onnx.load_from_string(device_head.softmax_graph(3000, 16, blocks, width)).graph
    assert out["blocks"] == blocks and out["providers"] == ["CPUExecutionProvider"]
    assert sorted(op for _, _, op, _ in out["profile"]["nodes"]) == sorted(n.op_type for n in graph.node)
    assert {prov for _, prov, _, _ in out["profile"]["nodes"]} == {"CPUExecutionProvider"}
    assert set(out["ms"]) >= {"softmax_1", "softmax_8", "topk10_1", "logits_1"} and all(v > 0 for v in out["ms"].values())


def test_the_profile_leaves_no_file_behind(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(device_profile, "RUNS", 2)
    device_profile.profile(1500, 8, "cpu")
    assert list(tmp_path.iterdir()) == []
