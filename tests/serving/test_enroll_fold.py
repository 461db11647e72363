"""`slc bundle fold` (issue 38): the enrolled classes as ordinary rows of a new bundle that `slc verify`
accepts and that answers detect, softmax and top-k as the enrolled server did; and the snapshot the
engine reads (copy-on-write: a request's snapshot never changes under it)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.serving.helpers import D, assert_envelope, make_settings, slc, wait_ready
from tests.serving.test_enroll import enroll, examples


def _client(bundle_path, tmp_path):
    from fastapi.testclient import TestClient

    from serving.main import build

    client = TestClient(build(make_settings(bundle_path, tmp_path, intra_op_threads=1))[0], raise_server_exceptions=False)
    client.__enter__()
    wait_ready(client.get)
    return client


def _answers(client, names: list[str], x: np.ndarray) -> dict:
    out = {}
    for name in names:
        det = client.post(f"/v1/classes/{name}/detect", json={"inputs": x.tolist()}).json()
        sm = client.post(f"/v1/classes/{name}/softmax", json={"inputs": x.tolist()}).json()
        out[name] = ([r["logit"] for r in det["results"]], [r["match"] for r in det["results"]], det["threshold"],
                     [r["probability"] for r in sm["results"]], [r["is_top1"] for r in sm["results"]])
    top = client.post("/v1/topk", json={"inputs": x.tolist(), "k": 5}).json()["results"]
    out["top"] = [[(e["class_name"], e["logit"]) for e in row] for row in top]
    return out


@pytest.mark.integration
def test_fold_gives_a_verified_bundle_that_answers_like_the_enrolled_server(bundle_path, tmp_path, inputs):
    data = tmp_path / "served"
    server = _client(bundle_path, data)
    try:
        for seed, name in ((1, "fa"), (2, "fb"), (3, "fc")):
            assert enroll(server, name, examples(seed, n=seed)).status_code == 201
        assert server.delete("/v1/classes/fb").status_code == 204  # ids D, D + 2 on the server
        queries = np.concatenate([inputs, examples(1, n=1), examples(3, n=1)])  # two that match their class
        want = _answers(server, ["fa", "fc", "7"], queries)
    finally:
        server.__exit__(None, None, None)
    out = tmp_path / "folded"
    assert slc("bundle", "fold", bundle_path, "--from", data / "data", "--out", out) == 0
    assert slc("verify", out) == 0
    from serving.bundle import load_bundle

    folded = load_bundle(out)
    assert folded.num_classes == D + 2 and list(folded.classes[D:]) == ["fa", "fc"]
    assert [e["enrolled_id"] for e in folded.manifest["folded"]["enrolled"]] == [D, D + 2]
    assert (out / "calibration_embeddings.npy").exists() is (bundle_path / "calibration_embeddings.npy").exists()
    client = _client(out, tmp_path / "fresh")
    try:
        got = _answers(client, ["fa", "fc", "7"], queries)
    finally:
        client.__exit__(None, None, None)
    for name in ("fa", "fc", "7"):
        np.testing.assert_allclose(got[name][0], want[name][0], rtol=1e-5, atol=1e-6)
        assert got[name][1] == want[name][1]
        assert got[name][2] == pytest.approx(want[name][2], rel=1e-6)  # float32 in calibration arrays
        np.testing.assert_allclose(got[name][3], want[name][3], rtol=1e-4, atol=1e-7)
        assert got[name][4] == want[name][4]
    for row_got, row_want in zip(got["top"], want["top"]):
        assert [n for n, _ in row_got] == [n for n, _ in row_want]
        np.testing.assert_allclose([z for _, z in row_got], [z for _, z in row_want], rtol=1e-5, atol=1e-6)


def test_fold_refuses_what_it_cannot_do(bundle_path, tmp_path):
    assert slc("bundle", "fold", bundle_path, "--from", tmp_path / "nowhere", "--out", tmp_path / "o") == 2
    from serving.gallery.enrolled import SqliteEnrolledStore

    SqliteEnrolledStore(tmp_path / "empty", "no-such-digest").close()  # a store with nothing of this bundle
    assert slc("bundle", "fold", bundle_path, "--from", tmp_path / "empty", "--out", tmp_path / "o") == 1
    assert not (tmp_path / "o").exists()


def test_a_snapshot_never_changes_under_a_request(bundle, tmp_path):
    """Copy-on-write: appends extend shared buffers beyond old views, replacements and deletions
    rebuild; every snapshot taken before a write answers as it did."""
    from serving.core.enrolled import EnrolledClasses
    from serving.gallery.enrolled import SqliteEnrolledStore
    from tests.serving.helpers import Offline

    settings = make_settings(bundle.path, tmp_path)
    manager = EnrolledClasses(SqliteEnrolledStore(tmp_path, bundle.digest), bundle, settings)
    h = Offline(bundle).embed(examples(60, n=40))
    taken = []
    try:
        for i in range(20):  # past the buffers' first capacity (16)
            manager.put(f"c{i}", manager.compute(h[i:i + 2]))
            taken.append((manager.snapshot, manager.snapshot.weight.copy(), manager.snapshot.ids.copy()))
        manager.put("c3", manager.compute(h[30:33]))  # a replacement
        manager.delete("c5")
        taken.append((manager.snapshot, manager.snapshot.weight.copy(), manager.snapshot.ids.copy()))
        manager.put("c20", manager.compute(h[35:37]))
        for snap, weight, ids in taken:
            np.testing.assert_array_equal(snap.weight, weight)
            np.testing.assert_array_equal(snap.ids, ids)
        last = manager.snapshot
        assert last.n == 20 and last.find("c5") is None and last.position_of_id(D + 5) is None
        assert last.ids.tolist() == [D + s for s in range(21) if s != 5]
        assert taken[2][0].find("c3") is None and taken[3][0].find("c3") == 3  # names past a view are not in it
    finally:
        manager.close()


def test_enroll_takes_an_image_body(tmp_path):
    """An image body is one example, through the server's own preprocessing: the class it makes is
    the class its tensor makes as JSON."""
    from serving.bundle.synthetic import build_synthetic_bundle
    from serving.codecs.images import decode
    from tests.serving.test_images import IMAGE, _digit, _png

    path = build_synthetic_bundle(classes=D, dim=8, input_dim=64, seed=1, out=tmp_path / "img", image=IMAGE)
    client = _client(path, tmp_path)
    try:
        png = _png(_digit())
        tensor = decode(png, b"image/png", IMAGE, (64,))
        r = client.put("/v1/classes/pic", content=png, headers={"Content-Type": "image/png"})
        assert r.status_code == 201, r.text
        by_json = client.put("/v1/classes/pic_json", json={"inputs": [tensor.tolist()]}).json()
        own = ("class_id", "class_name", "created", "matched_by", "matched_by_complete", "lookalikes", "lookalike_names")
        assert {k: v for k, v in r.json().items() if k not in own} == {k: v for k, v in by_json.items() if k not in own}
        # the same example's look-alikes, and the first class: the second's closest enrolled class
        assert by_json["lookalikes"] == sorted({*r.json()["lookalikes"], r.json()["class_id"]})
        # the same image a second time: the first class says yes to it exactly when it says yes to its own example
        first = client.post("/v1/classes/pic/detect", json={"inputs": [tensor.tolist()]}).json()["results"][0]["match"]
        assert [(m["class_name"], m["examples"]) for m in by_json["matched_by"]] == ([("pic", 1)] if first else [])
        logits = [client.post(f"/v1/classes/{n}/detect", json={"inputs": [tensor.tolist()]}).json()["results"][0]["logit"]
                  for n in ("pic", "pic_json")]
        assert logits[0] == logits[1]
        assert_envelope(client.put("/v1/classes/pic2", content=b"not an image", headers={"Content-Type": "image/png"}),
                        422)
    finally:
        client.__exit__(None, None, None)
