"""Export: graphs faithful to the torch network, a plain Gather, and the train -> export -> verify round trip."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from serving.calibration.defaults import default_rule
import torch
from onnx import TensorProto, helper

from models import ClassHead, SLCNet, build_backbone
from serving.bundle import REQUIRED_FILES, load_bundle, verify_bundle, write_manifest
from trainer import export as export_mod
from serving.calibration.counts import rates_at


def session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


def hand_made_net(D: int = 7) -> SLCNet:
    torch.manual_seed(0)
    body = build_backbone("mlp", (12,), hidden=16)
    net = SLCNet(body, ClassHead(body.embed_dim, D), torch.rand(12), torch.rand(12) + 0.5)
    with torch.no_grad():  # non-trivial BatchNorm statistics, so folding them is tested
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm1d):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
    return net.eval()


@pytest.fixture(scope="module")
def single_graph(tmp_path_factory):
    net = hand_made_net()
    module = export_mod._wrappers(net)["single"]
    path = tmp_path_factory.mktemp("g") / "single.onnx"
    x = torch.randn(3, 12)
    export_mod._export_graph(module, "single", (x, torch.tensor([0, 3, 6])), path, external=False)
    return path, module, net


def test_single_graph_is_plain_gather_and_matches_torch(single_graph):
    path, module, net = single_graph
    export_mod.check_graph(path, "single")
    model = onnx.load(str(path))
    ops = [n.op_type for n in model.graph.node]
    assert "Gather" in ops and "GatherND" not in ops
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((41, 12)) * 3).astype(np.float32)  # a batch size never seen at export
    cid = rng.integers(0, 7, 41).astype(np.int64)
    assert export_mod.parity(path, "single", module, x, cid) <= 1e-4
    got = session(path).run(None, {"input": x, "class_id": cid})[0]
    with torch.no_grad():
        full = net(torch.from_numpy(x)).double().numpy()  # [41, 7]
    np.testing.assert_allclose(got, full[np.arange(41), cid], rtol=1e-4, atol=1e-5)


def test_parity_fails_loudly_when_graph_and_module_differ(single_graph):
    path, _, _ = single_graph
    other = export_mod._wrappers(hand_made_net())["single"]
    with torch.no_grad():
        other.net.head.weight.add_(0.1)
    x = np.random.default_rng(2).standard_normal((5, 12)).astype(np.float32)
    with pytest.raises(export_mod.ExportError, match="single.onnx"):
        export_mod.parity(path, "single", other, x, np.zeros(5, dtype=np.int64))


def _tiny_graph(path: Path, op: str, batch) -> None:
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 3], np.arange(12, dtype=np.float32))
    if op == "GatherND":
        nodes = [helper.make_node("Unsqueeze", ["class_id", "ax"], ["idx"]),
                 helper.make_node("GatherND", ["w", "idx"], ["rows"])]
        inits = [w, helper.make_tensor("ax", TensorProto.INT64, [1], [1])]
    else:
        nodes, inits = [helper.make_node("Gather", ["w", "class_id"], ["rows"], axis=0)], [w]
    nodes += [helper.make_node("Mul", ["input", "rows"], ["prod"]),
              helper.make_node("ReduceSum", ["prod", "axes"], ["logit"], keepdims=0)]
    inits.append(helper.make_tensor("axes", TensorProto.INT64, [1], [1]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, 3]),
                                           helper.make_tensor_value_info("class_id", TensorProto.INT64, [batch])],
                              [helper.make_tensor_value_info("logit", TensorProto.FLOAT, [batch])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def test_check_graph_rejects_gathernd_and_fixed_batch(tmp_path):
    _tiny_graph(tmp_path / "ok.onnx", "Gather", "N")
    export_mod.check_graph(tmp_path / "ok.onnx", "single")
    _tiny_graph(tmp_path / "nd.onnx", "GatherND", "N")
    with pytest.raises(export_mod.ExportError, match="Gather"):
        export_mod.check_graph(tmp_path / "nd.onnx", "single")
    _tiny_graph(tmp_path / "fixed.onnx", "Gather", 2)
    with pytest.raises(export_mod.ExportError, match="batch"):
        export_mod.check_graph(tmp_path / "fixed.onnx", "single")


def test_refuses_to_overwrite_a_non_bundle(tmp_path):
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "thesis.tex").write_text("x")
    with pytest.raises(ValueError, match="is not a bundle written by slc"):  # before the run is even opened
        export_mod.export_bundle(tmp_path / "no-run", tmp_path / "precious")
    assert (tmp_path / "precious" / "thesis.tex").read_text() == "x"
    with pytest.raises(ValueError):
        export_mod._target(0.9, 0.9)
    assert export_mod._target(None, None) == {"precision": 0.99}


# ---------------------------------------------------------------- round trip on digits (slow)


@pytest.fixture(scope="module", params=["batch_ce", "ce"])
def exported(request, tmp_path_factory):
    from trainer.data import load_dataset
    from trainer.train import TrainConfig, train

    root = tmp_path_factory.mktemp(request.param)
    cfg = TrainConfig(dataset="digits", backbone="mlp", backbone_params={"hidden": 32}, loss=request.param,
                      epochs=3, lr=0.003, seed=0)
    run = train(cfg, root / "run", progress=False)
    bundle = export_mod.export_bundle(run, root / "bundle", target_precision=0.95)
    return request.param, run, bundle, load_dataset("digits")


@pytest.mark.slow
def test_round_trip_verifies_and_describes_the_run(exported):
    loss, run, bundle, splits = exported
    negatives = ["calibration_embeddings.npy", "calibration_labels.npy"]
    assert sorted(p.name for p in bundle.iterdir()) == sorted(list(REQUIRED_FILES) + negatives + ["manifest.json"])
    assert verify_bundle(bundle) == []
    b = load_bundle(bundle)
    manifest = b.manifest
    assert manifest["loss"]["name"] == loss and manifest["loss"]["pols"] == (loss == "batch_ce")
    assert b.num_classes == 10 and b.input_shape == (64,) and b.classes == [str(c) for c in splits.classes]
    assert manifest["test_metrics"] == json.loads((run / "metrics.json").read_text())["test"]
    assert json.loads((bundle / "calibration.json").read_text())["target"] == {"precision": 0.95}


@pytest.mark.slow
def test_graphs_match_torch_and_each_other(exported):
    from trainer.runs import load_run

    _, run, bundle, splits = exported
    net, _, _ = load_run(run)
    x = np.array(splits.test[0][:37], dtype=np.float32)  # batch size unlike any at export
    with torch.no_grad():
        t_emb = net.embed(torch.from_numpy(x)).double().numpy()
        t_logits = net(torch.from_numpy(x)).double().numpy()
    emb = session(bundle / "backbone.onnx").run(None, {"input": x})[0]
    full = session(bundle / "full.onnx").run(None, {"input": x})[0]
    scale = np.abs(t_logits).max()
    assert np.abs(emb - t_emb).max() <= 1e-4 * max(1, np.abs(t_emb).max())
    assert np.abs(full - t_logits).max() <= 1e-4 * max(1, scale)
    b = load_bundle(bundle)
    ref = emb.astype(np.float64) @ np.asarray(b.weight, np.float64).T + b.bias  # from the .npy rows
    np.testing.assert_allclose(full, ref, rtol=1e-4, atol=1e-4 * max(1, scale))
    single = session(bundle / "single.onnx")
    for j in range(10):
        got = single.run(None, {"input": x, "class_id": np.full(len(x), j, dtype=np.int64)})[0]
        np.testing.assert_allclose(got, full[:, j], rtol=1e-5, atol=1e-5 * max(1, scale))
    one = single.run(None, {"input": x[:1], "class_id": np.array([9], dtype=np.int64)})[0]
    np.testing.assert_allclose(one, full[:1, 9], rtol=1e-5, atol=1e-5 * max(1, scale))


@pytest.mark.slow
def test_calibration_holds_on_the_calibration_split(exported):
    """Thresholds reach the target on the calibration split (where reachable); test rates are what they say,
    for the logits as the server's detect computes them (backbone.onnx embeddings, float64 head rows)."""
    _, _, bundle, splits = exported
    cal = json.loads((bundle / "calibration.json").read_text())
    b = load_bundle(bundle)
    backbone = session(bundle / "backbone.onnx")
    for split, key in ((splits.calibration, None), (splits.test, "test")):
        x, y = split
        h = backbone.run(None, {"input": np.asarray(x, dtype=np.float32)})[0].astype(np.float64)  # [N, d]
        z = np.stack([h @ np.asarray(b.weight[j], np.float64) + float(b.bias[j]) for j in range(10)], axis=1)  # detect's
        positive = y[:, None] == np.arange(10)
        rates = rates_at(z, positive, b.thresholds.astype(np.float64))
        for e in cal["per_class"]:
            j = e["class_id"]
            stated = e if key is None else e[key]
            assert rates["precision"][j] == pytest.approx(stated["precision"], abs=1e-9)
            assert rates["recall"][j] == pytest.approx(stated["recall"], abs=1e-9)
            if key is None and e["reached"]:
                assert rates["precision"][j] >= 0.95


@pytest.mark.slow
def test_negatives_are_the_calibration_splits_embeddings(exported, tmp_path):
    """calibration_embeddings.npy: backbone.onnx on the calibration split (all of it, digits has fewer
    than 20,000), with its labels; hashed, checked by verify, a wrong label named."""
    _, _, bundle, splits = exported
    x, y = splits.calibration
    h = session(bundle / "backbone.onnx").run(None, {"input": np.asarray(x, dtype=np.float32)})[0]
    np.testing.assert_allclose(np.load(bundle / "calibration_embeddings.npy"), h, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.load(bundle / "calibration_labels.npy"), y)
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["negatives"]["count"] == len(y) and "calibration_labels.npy" in manifest["files"]
    bad = tmp_path / "bad"
    shutil.copytree(bundle, bad)
    np.save(bad / "calibration_labels.npy", np.full(len(y), 10, dtype=np.int64))
    write_manifest(bad, json.loads((bad / "manifest.json").read_text()))
    assert verify_bundle(bad) == ["calibration_labels.npy: labels must be class ids 0..9"]


@pytest.mark.slow
def test_tampering_a_trained_bundle_is_named(exported, tmp_path):
    _, _, bundle, _ = exported
    for name in list(REQUIRED_FILES) + ["manifest.json"]:
        copy = Path(shutil.copytree(bundle, tmp_path / name))
        data = bytearray((copy / name).read_bytes())
        data[len(data) // 2] ^= 0x01
        (copy / name).write_bytes(bytes(data))
        problems = verify_bundle(copy)
        assert any(name in p for p in problems), (name, problems)
    # rows edited and re-hashed: the graphs hold their own copy, so the rows no longer agree with them
    copy = Path(shutil.copytree(bundle, tmp_path / "rows"))
    w = np.load(copy / "head_weight.npy")
    w[3] += 0.5
    np.save(copy / "head_weight.npy", w)
    write_manifest(copy, json.loads((copy / "manifest.json").read_text()))
    assert any(p.startswith("head_weight.npy") for p in verify_bundle(copy))


@pytest.mark.slow
def test_external_data_export(tmp_path, monkeypatch):
    """Heads over the limit go to external data; the bundle stays verifiable (limit lowered to test it)."""
    from trainer.train import TrainConfig, train

    run = train(TrainConfig(dataset="digits", backbone="linear", loss="ce", epochs=1, lr=0.01), tmp_path / "run", progress=False)
    monkeypatch.setattr(export_mod, "EXTERNAL_DATA_BYTES", 0)
    bundle = export_mod.export_bundle(run, tmp_path / "bundle", target_recall=0.9)
    names = {p.name for p in bundle.iterdir()}
    assert {"full.onnx.data", "single.onnx.data"} <= names
    assert verify_bundle(bundle) == []
    assert json.loads((bundle / "calibration.json").read_text())["target"] == {"recall": 0.9}


def test_export_with_head_precision_writes_verified_quantized_heads(tmp_path):
    """--head-precision int8,bf16: the heads quantized from the exported float32 rows, listed in
    the manifest, hashed and checked by verify, and loaded with the bundle."""
    from serving.bundle import load_bundle
    from serving.bundle.quantize import bf16_to_float32
    from trainer.train import TrainConfig, train

    run = train(TrainConfig(dataset="digits", backbone="linear", loss="ce", epochs=1, lr=0.01), tmp_path / "run", progress=False)
    bundle = export_mod.export_bundle(run, tmp_path / "bundle", head_precisions=("int8", "bf16"))
    assert verify_bundle(bundle) == []
    b = load_bundle(bundle)
    w = np.asarray(b.weight, dtype=np.float64)
    q, scale = b.heads["int8"]["weight"], b.heads["int8"]["scale"]
    assert np.all(np.abs(scale[:, None] * q.astype(np.float64) - w) <= scale[:, None] / 2 + 1e-12)
    assert np.allclose(bf16_to_float32(b.heads["bf16"]["weight"]), w, rtol=2.0 ** -8, atol=0)


@pytest.mark.slow
def test_samples_carry_their_true_labels(exported):
    """samples.npz `label` is the dataset's label of each stored input (found by value in the calibration split)."""
    _, _, bundle, splits = exported
    x_cal, y_cal = splits.calibration
    with np.load(bundle / "samples.npz", allow_pickle=False) as s:
        inputs, labels = s["input"], s["label"]
    for x, label in zip(inputs, labels):
        rows = np.flatnonzero((x_cal == x).all(axis=1))
        assert rows.size and int(y_cal[rows[0]]) == int(label)


@pytest.mark.slow
def test_default_model_example_is_an_image_of_its_class(exported, tmp_path):
    from serving.default_model import write_example

    _, _, bundle, splits = exported
    assert write_example(bundle, tmp_path / "ex.json", class_name="7")
    x = np.asarray(json.loads((tmp_path / "ex.json").read_text())["inputs"][0], dtype=np.float32)
    x_cal, y_cal = splits.calibration
    rows = np.flatnonzero((x_cal == x).all(axis=1))
    assert rows.size and splits.classes[int(y_cal[rows[0]])] == "7"
    assert not write_example(bundle, tmp_path / "none.json", class_name="no such class")
    from serving.codecs.images import decode  # the same 7 as a PNG, read back by the server's preprocessing

    back = decode((tmp_path / "ex.png").read_bytes(), b"image/png", load_bundle(bundle).image, (64,))
    np.testing.assert_allclose(back, x, atol=0.5 * 16 / 255 + 1e-6)


def test_an_image_dataset_bundle_records_how_images_become_inputs(exported):
    """The manifest's `image` spec turns the dataset's own images, sent as PNG, back into their
    inputs (digits: 0..16 stored as 0..255 grey, so within half a grey level)."""
    import io

    from PIL import Image

    from serving.codecs.images import decode
    from trainer.data import image_spec

    loss, _, bundle, splits = exported
    b = load_bundle(bundle)
    assert b.image == image_spec("digits")
    # the default threshold method: one global threshold for a PoLS loss (batch_ce), shrink for ce
    assert b.calibration["method"] == ({"name": "global"} if loss == "batch_ce" else {"name": "shrink", "kappa": 4.0})
    assert b.calibration["method"] == default_rule(b.manifest["loss"]["pols"])
    for example in splits.test[0][:10]:  # [64] values 0..16
        buf = io.BytesIO()
        Image.fromarray(np.rint(example.reshape(8, 8) * 255 / 16).astype(np.uint8)).save(buf, format="PNG")
        got = decode(buf.getvalue(), b"image/png", b.image, b.input_shape)
        np.testing.assert_allclose(got, example, atol=0.5 * 16 / 255 + 1e-6)
