"""Enrolled classes belong to the model, not to one calibration (issue 48 part 2): keyed by the backbone,
the trained rows and the class names, they survive a recalibration in place, its reload and a restart
(same ids, the logits of the offline rule), and `slc bundle fold` finds them; a store an older slc keyed
by manifest digests is re-keyed where the digest ties to the model; new head rows make the server name
the classes that no longer apply, in GET /v1/classes and at WARNING. Truth: the offline imprinting rule
over an independent onnxruntime session (tests/serving/test_enroll.py imprint)."""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from serving.bundle.recalibration import write_recalibrated
from tests.serving.helpers import D, Offline, make_settings, postgres_missing, slc, wait_ready
from tests.serving.test_enroll import enroll, examples, imprint

pytestmark = pytest.mark.integration  # bundle folders rewritten, servers restarted on one data dir


@pytest.fixture
def folder(bundle_path, tmp_path) -> Path:
    """A copy of the synthetic bundle, recalibrated in place by the tests."""
    return Path(shutil.copytree(bundle_path, tmp_path / "served"))


def _client(bundle_path: Path, tmp_path: Path):
    """A server (in-process, lifespan running) on `bundle_path` with its data dir tmp_path/data."""
    from fastapi.testclient import TestClient

    from serving.main import build

    client = TestClient(build(make_settings(bundle_path, tmp_path))[0], raise_server_exceptions=False)
    client.__enter__()
    wait_ready(client.get)
    return client


def _recalibrate(folder: Path, shift: float = 0.25, head=None) -> None:
    """Every threshold moved by `shift` (and new head rows when given), written in place as slc calibrate does."""
    cal = json.loads((folder / "calibration.json").read_text())
    cal["global"]["threshold"] += shift
    for e in cal["per_class"]:
        e["threshold"] += shift
    write_recalibrated(folder, cal, folder, {"by": "test", "shift": shift}, head=head)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _logits(client, name: str, x: np.ndarray) -> list[float]:
    r = client.post(f"/v1/classes/{name}/detect", json={"inputs": x.tolist()})
    assert r.status_code == 200, r.text
    return [res["logit"] for res in r.json()["results"]]


def _truth(offline: Offline, seed: int, x: np.ndarray) -> np.ndarray:
    row, b = imprint(offline, examples(seed))
    return offline.embed(x).astype(np.float64) @ row + b


def test_recalibration_reload_and_restart_keep_enrolled_classes_and_fold_finds_them(folder, tmp_path, offline, inputs):
    seeds = {"ka": 11, "kb": 12}
    server = _client(folder, tmp_path)
    try:
        ids = {name: enroll(server, name, examples(seed)).json()["class_id"] for name, seed in seeds.items()}
        before = {name: _logits(server, name, inputs) for name in seeds}
        digest = _sha(folder / "manifest.json")
        _recalibrate(folder)
        assert _sha(folder / "manifest.json") != digest
        reloaded = server.post("/v1/admin/reload-calibration")
        assert reloaded.status_code == 200 and reloaded.json()["reloaded"] is True, reloaded.text
        assert {name: _logits(server, name, inputs) for name in seeds} == before
    finally:
        server.__exit__(None, None, None)
    server = _client(folder, tmp_path)  # a restart on the recalibrated folder
    try:
        listing = server.get("/v1/classes").json()
        assert [(c["class_id"], c["class_name"]) for c in listing["classes"]] == sorted((i, n) for n, i in ids.items())
        assert listing["not_served"] == []
        for name, seed in seeds.items():
            assert _logits(server, name, inputs) == before[name]
            np.testing.assert_allclose(before[name], _truth(offline, seed, inputs), rtol=1e-5, atol=1e-5)
    finally:
        server.__exit__(None, None, None)
    out = tmp_path / "folded"
    assert slc("bundle", "fold", folder, "--from", tmp_path / "data", "--out", out) == 0
    from serving.bundle import load_bundle

    folded = load_bundle(out)
    assert list(folded.classes[D:]) == sorted(seeds, key=ids.get)
    np.testing.assert_allclose(Offline(folded).logits(inputs)[:, D:],
                               np.stack([_truth(offline, seeds[n], inputs) for n in sorted(seeds, key=ids.get)], 1),
                               rtol=1e-5, atol=1e-5)
    server = _client(out, tmp_path)  # the folded bundle on the same data dir: a new model, its rows trained now
    try:
        listing = server.get("/v1/classes").json()
        assert listing["count"] == 0 and [(g["reason"], g["count"]) for g in listing["not_served"]] == [("folded", 2)]
    finally:
        server.__exit__(None, None, None)


def _legacy_put(store, bundle, offline, name: str, seed: int) -> None:
    """A class as an older slc stored it (under whatever key `store` has), by the imprinting rule."""
    row, b = imprint(offline, examples(seed))
    store.put(name, row.astype(np.float32), b, bundle.global_threshold, float(np.median(bundle.platt_a)),
              float(np.median(bundle.platt_b)), 3, "imprint+global", 100)


def test_a_store_keyed_by_manifest_digests_is_rekeyed_to_the_model(folder, tmp_path, bundle, offline, inputs, caplog):
    """Classes an older slc kept under the manifest digest before a recalibration (A) and after it (B):
    B moves as it is (ids kept), A is appended under new ids, of one name the later enrollment stays;
    a digest that cannot be tied to the model stays where it is and is named."""
    from serving.bundle.recalibration import previous_digests
    from serving.gallery.enrolled import SqliteEnrolledStore

    data = tmp_path / "data"
    first = _sha(folder / "manifest.json")
    for key, classes in ((first, (("old1", 20), ("dup", 21))), (None, (("new1", 22), ("dup", 23))),
                         ("f" * 64, (("stray", 24),))):
        if key is None:
            _recalibrate(folder)
            key = _sha(folder / "manifest.json")
            assert first in previous_digests(folder)
        store = SqliteEnrolledStore(data, key)
        for name, seed in classes:
            _legacy_put(store, bundle, offline, name, seed)
        store.close()
    with caplog.at_level(logging.INFO, logger="serving.core.enrolled_report"):
        server = _client(folder, tmp_path)
    try:
        listing = server.get("/v1/classes").json()
        assert [(c["class_id"], c["class_name"]) for c in listing["classes"]] == [(D, "new1"), (D + 1, "dup"),
                                                                                   (D + 2, "old1")]
        for name, seed in (("new1", 22), ("dup", 23), ("old1", 20)):
            np.testing.assert_allclose(_logits(server, name, inputs), _truth(offline, seed, inputs), rtol=1e-5, atol=1e-5)
        [stray] = listing["not_served"]
        assert stray["reason"] == "unknown_model" and stray["model"] == {"manifest_digest": "f" * 64}
        assert [c["class_name"] for c in stray["classes"]] == ["stray"] and stray["count"] == 1
    finally:
        server.__exit__(None, None, None)
    text = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("'stray'" in t and "f" * 12 in t for t in text), text
    assert any(first[:12] in t and "new ids" in t and "dup" in t for t in text), text


def test_new_head_rows_name_the_classes_that_no_longer_apply(folder, tmp_path, caplog, inputs):
    server = _client(folder, tmp_path)
    try:
        for seed, name in ((31, "ha"), (32, "hb")):
            assert enroll(server, name, examples(seed)).status_code == 201
    finally:
        server.__exit__(None, None, None)
    weight = np.load(folder / "head_weight.npy")
    _recalibrate(folder, head=(weight * 1.5).astype(np.float32))  # slc calibrate --adapt-rows writes new rows
    with caplog.at_level(logging.WARNING, logger="serving.core.enrolled_report"):
        server = _client(folder, tmp_path)
    try:
        listing = server.get("/v1/classes").json()
        assert listing["count"] == 0
        [group] = listing["not_served"]
        assert group["reason"] == "head_changed" and group["count"] == 2
        assert [c["class_name"] for c in group["classes"]] == ["ha", "hb"]
        assert group["model"]["path"] == str(folder.resolve()) and "re-enroll" in group["action"]
        assert "examples" in group["action"]  # the store keeps no examples: said, not hidden
        assert enroll(server, "ha", examples(31)).status_code == 201  # re-enrolled under the new head
        from serving.bundle import load_bundle

        new = Offline(load_bundle(folder))
        np.testing.assert_allclose(_logits(server, "ha", inputs), _truth(new, 31, inputs), rtol=1e-5, atol=1e-5)
        again = server.get("/v1/classes").json()["not_served"][0]["classes"]
        assert [(c["class_name"], c["re_enrolled"]) for c in again] == [("ha", True), ("hb", False)]
    finally:
        server.__exit__(None, None, None)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("'ha'" in t and "'hb'" in t and "head_changed" in t and "re-enroll" in t for t in warned), warned


@pytest.mark.skipif(postgres_missing() is not None, reason=str(postgres_missing()))
def test_the_model_tables_rekeying_and_refusals_on_postgres(bundle, offline):
    """The same statements on PostgreSQL: a legacy digest re-keyed, other keys listed, a delete by slot,
    a read-only transaction a StoreUnavailable (503 store_unavailable), never a driver error."""
    from serving.gallery import StoreUnavailable
    from serving.gallery.enrolled import ModelRecord, PostgresEnrolledStore
    from tests.serving.helpers import throwaway_postgres

    model = ModelRecord.of_bundle(bundle)
    with throwaway_postgres() as (url, _):
        legacy = PostgresEnrolledStore(url, bundle.digest)
        for name, seed in (("p1", 40), ("p2", 41)):
            _legacy_put(legacy, bundle, offline, name, seed)
        legacy.close()
        stray = PostgresEnrolledStore(url, "e" * 64)
        _legacy_put(stray, bundle, offline, "pstray", 42)
        store = PostgresEnrolledStore(url, model.key)
        try:
            [adopted] = store.register(model, [bundle.digest])
            assert (adopted.moved, adopted.renumbered) == (2, False)
            assert [(r.slot, r.name) for r in store.changes(0)] == [(0, "p1"), (1, "p2")]
            assert store.models()[model.key].backbone == model.backbone
            assert store.elsewhere() == {"e" * 64: (1, [(0, "pstray", pytest.approx(time.time(), abs=600))])}
            assert store.delete_slot(0).slot == 0 and store.delete_slot(0) is None
            store._db.execute("SET default_transaction_read_only = on")
            with pytest.raises(StoreUnavailable):
                store.delete("p2")
        finally:
            store.close()
            stray.close()
