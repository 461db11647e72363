"""`slc bundle triton`: every config.pbtxt parses as Triton's ModelConfig protobuf (the schema
tritonclient ships) and declares the names, types and dims of its ONNX graph; each version
folder holds a graph that onnxruntime runs from there (external data included) to the same
outputs as the bundle's."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner

from serving.bundle.triton import write_triton_repository
from slc.cli import root

model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2",
                                       reason="pip install 'tritonclient[grpc]' (Triton's model-config schema)")
from google.protobuf import text_format  # noqa: E402  (comes with tritonclient[grpc])

ONNX_TO_TRITON = {1: model_config_pb2.TYPE_FP32, 7: model_config_pb2.TYPE_INT64}


@pytest.fixture(scope="module")
def repo(bundle_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("triton") / "repo"
    return out, write_triton_repository(bundle_path, out, max_batch=32, delay_us=500)


def _config(path) -> "model_config_pb2.ModelConfig":
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


@pytest.mark.parametrize("kind", ["backbone", "full", "single"])
def test_config_parses_and_matches_its_graph(repo, bundle, bundle_path, kind):
    out, models = repo
    name = f"{bundle.name}-{kind}"
    assert name in models
    config = _config(out / name / "config.pbtxt")
    assert config.name == name and config.platform == "onnxruntime_onnx" and config.max_batch_size == 32
    assert config.dynamic_batching.max_queue_delay_microseconds == 500
    graph = onnx.load(str(bundle_path / f"{kind}.onnx"), load_external_data=False)
    for declared, values in ((config.input, graph.graph.input), (config.output, graph.graph.output)):
        assert [t.name for t in declared] == [v.name for v in values]
        for t, v in zip(declared, values):
            dims = [d.dim_value for d in v.type.tensor_type.shape.dim][1:]  # the batch dim is Triton's
            assert t.data_type == ONNX_TO_TRITON[v.type.tensor_type.elem_type]
            if dims:
                assert list(t.dims) == dims and not t.HasField("reshape")
            else:  # [N] in the graph: [batch, 1] for Triton, reshaped to [batch]
                assert list(t.dims) == [1] and list(t.reshape.shape) == []


@pytest.mark.parametrize("kind", ["backbone", "full", "single"])
def test_the_repository_graph_runs_to_the_bundle_outputs(repo, bundle, bundle_path, kind):
    out, _ = repo
    x = np.random.default_rng(0).normal(size=(5, *bundle.input_shape)).astype(np.float32)
    feeds = {"input": x} if kind != "single" else {"input": x, "class_id": np.array([0, 3, 7, 1, 49])}
    ours = ort.InferenceSession(str(bundle_path / f"{kind}.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)
    theirs = ort.InferenceSession(str(out / f"{bundle.name}-{kind}" / "1" / "model.onnx"),
                                  providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_array_equal(theirs[0], ours[0])


def test_the_command_refuses_a_folder_that_is_not_a_bundle(tmp_path):
    result = CliRunner().invoke(root, ["bundle", "triton", str(tmp_path), "--out", str(tmp_path / "repo")])
    assert result.exit_code == 2 and "is not a bundle directory" in result.output
