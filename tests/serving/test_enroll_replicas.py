"""Replicas that agree (issue 48 part 3): a write answers from what it committed even when another
replica deletes the class before the read-back; a DELETE by a retired id is 404 on a replica whose
snapshot still shows it, and the new class of that name survives; concurrent PUT/DELETE of the same
names on two server processes never give a 5xx; a stored row that cannot be served is skipped and
named, never a refused start or a stuck follower; a store that refuses writes is 503
`store_unavailable` with Retry-After while reads go on. Truth: the offline imprinting rule
(tests/serving/test_enroll.py imprint) over an independent onnxruntime session."""
from __future__ import annotations

import logging
import random
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.serving.helpers import D, assert_envelope, make_settings, wait_ready
from tests.serving.test_enroll import enroll, examples, imprint
from tests.serving.test_enroll_durability import _start, _stop, _wait_for

SEEDS = range(70, 76)  # the examples concurrent writers send; each answer is checked against its own seed


def _server(bundle_path: Path, tmp_path: Path, **overrides):
    """(client, state) of an in-process server on tmp_path/data."""
    from fastapi.testclient import TestClient

    from serving.main import build

    app, lifecycle = build(make_settings(bundle_path, tmp_path, **overrides))
    client = TestClient(app, raise_server_exceptions=False)
    client.__enter__()
    wait_ready(client.get)
    return client, lifecycle.state


def _close(*clients) -> None:
    for c in clients:
        c.__exit__(None, None, None)


def _matches_rule(answer: dict, offline, seed: int) -> bool:
    row, b = imprint(offline, examples(seed))
    return bool(np.isclose(answer["norm"], np.linalg.norm(row), rtol=1e-5) and np.isclose(answer["bias"], b, atol=1e-6))


def test_a_put_answers_from_what_it_committed_when_another_replica_deletes_it_first(bundle, tmp_path, offline,
                                                                                    monkeypatch):
    from serving.core.enrolled import EnrolledClasses
    from serving.gallery.enrolled import SqliteEnrolledStore

    settings = make_settings(bundle.path, tmp_path)
    a = EnrolledClasses(SqliteEnrolledStore(tmp_path, "k"), bundle, settings)
    b = EnrolledClasses(SqliteEnrolledStore(tmp_path, "k"), bundle, settings)
    try:
        committed = a.store.put

        def put_then_raced(name, *args, **kwargs):  # the other replica deletes it between commit and read-back
            written = committed(name, *args, **kwargs)
            assert b.delete(name) == D + written.slot
            return written

        monkeypatch.setattr(a.store, "put", put_then_raced)
        answer, created = a.put("raced", a.compute(offline.embed(examples(60))))
        assert created and answer["class_id"] == D and answer["class_name"] == "raced"
        assert _matches_rule(answer, offline, 60)
        assert a.snapshot.find("raced") is None and a.skipped == {}  # the store's truth: deleted since
    finally:
        a.close()
        b.close()


def test_a_delete_by_a_retired_id_is_404_and_the_new_class_of_that_name_survives(bundle_path, tmp_path, offline,
                                                                                  inputs):
    first, _ = _server(bundle_path, tmp_path)
    stale, _ = _server(bundle_path, tmp_path, enrolled_sync_s=60)  # its snapshot is not refreshed by polling
    try:
        old = enroll(first, "x", examples(61)).json()["class_id"]
        assert enroll(stale, "y", examples(68)).status_code == 201  # its own write: its snapshot now shows x
        assert {c["class_name"]: c["class_id"] for c in stale.get("/v1/classes").json()["classes"]}["x"] == old
        assert first.delete("/v1/classes/x").status_code == 204
        new = enroll(first, "x", examples(62)).json()["class_id"]
        assert new > old
        for client in (stale, first):  # the stale snapshot still maps `old` to "x": the store decides
            assert_envelope(client.delete(f"/v1/classes/{old}"), 404, "unknown_class")
        assert {c["class_name"]: c["class_id"] for c in first.get("/v1/classes").json()["classes"]}["x"] == new
        row, b = imprint(offline, examples(62))
        got = first.post("/v1/classes/x/detect", json={"inputs": inputs.tolist()}).json()["results"]
        np.testing.assert_allclose([r["logit"] for r in got], offline.embed(inputs).astype(np.float64) @ row + b,
                                   rtol=1e-5, atol=1e-5)
        assert stale.delete(f"/v1/classes/{new}").status_code == 204  # an id the stale replica never saw
        assert _wait_for(lambda: "x" not in {c["class_name"] for c in first.get("/v1/classes").json()["classes"]})
    finally:
        _close(first, stale)


@pytest.mark.integration
def test_two_server_processes_writing_the_same_names_never_answer_5xx(bundle_path, tmp_path, offline):
    procs = [_start(bundle_path, tmp_path)[0] for _ in range(2)]
    urls = [f"http://127.0.0.1:{p.args[p.args.index('--port') + 1]}" for p in procs]
    answers: list[tuple[str, int, httpx.Response]] = []

    def writer(k: int) -> None:
        rng, client = random.Random(k), httpx.Client(timeout=60)
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            url, name, seed = urls[k % 2], rng.choice(("n0", "n1", "n2")), rng.choice(SEEDS)
            if rng.random() < 0.6:
                answers.append(("put", seed, client.put(f"{url}/v1/classes/{name}", json={"inputs": examples(seed).tolist()})))
            else:
                answers.append(("delete", seed, client.delete(f"{url}/v1/classes/{name}")))
        client.close()

    try:
        threads = [threading.Thread(target=writer, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        statuses = {(kind, r.status_code) for kind, _, r in answers}
        assert statuses <= {("put", 200), ("put", 201), ("delete", 204), ("delete", 404)}, \
            [r.text for _, _, r in answers if r.status_code >= 500][:3]
        puts = [(seed, r.json()) for kind, seed, r in answers if kind == "put"]
        assert puts and all(_matches_rule(a, offline, seed) for seed, a in puts)
        listing = lambda url: [(c["class_id"], c["class_name"], c["bias"], c["norm"])  # noqa: E731
                               for c in httpx.get(f"{url}/v1/classes", timeout=30).json()["classes"]]
        assert _wait_for(lambda: listing(urls[0]) == listing(urls[1]))
    finally:
        for p in procs:
            _stop(p)


def _insert_raw(db_path: Path, key: str, name: str, row: bytes, bias) -> int:
    """A row written straight into the store, as a damaged or foreign writer would leave it; its slot."""
    db = sqlite3.connect(db_path, isolation_level=None)
    try:
        db.execute("BEGIN IMMEDIATE")
        next_slot, seq, live = db.execute("SELECT next_slot, seq, live FROM enrolled_state WHERE digest = ?",
                                          (key,)).fetchone()
        db.execute("""INSERT INTO enrolled_classes (digest, slot, name, row, bias, threshold, platt_a, platt_b,
                      examples, rule, created, seq, deleted) VALUES (?, ?, ?, ?, ?, 0.5, 1.0, 0.0, 3, 'imprint+global',
                      ?, ?, 0)""", (key, next_slot, name, row, bias, time.time(), seq + 1))
        db.execute("UPDATE enrolled_state SET next_slot = ?, seq = ?, live = ? WHERE digest = ?",
                   (next_slot + 1, seq + 1, live + 1, key))
        db.execute("COMMIT")
    finally:
        db.close()
    return int(next_slot)


def test_a_row_that_cannot_be_served_is_skipped_and_named_never_a_refused_start(bundle, bundle_path, tmp_path,
                                                                                 offline, inputs, caplog):
    from serving.gallery import DB_NAME
    from serving.gallery.enrolled import ModelRecord, SqliteEnrolledStore

    key, db_path = ModelRecord.of_bundle(bundle).key, tmp_path / "data" / DB_NAME
    store = SqliteEnrolledStore(tmp_path / "data", key)
    row, b = imprint(offline, examples(63))
    store.put("good", row.astype(np.float32), b, 0.5, 1.0, 0.0, 3, "imprint+global", 100)
    store.close()
    bad = _insert_raw(db_path, key, "bad", row.astype("<f4").tobytes(), float("nan"))  # SQLite keeps NULL
    with caplog.at_level(logging.WARNING, logger="serving.core.enrolled"):
        client, _ = _server(bundle_path, tmp_path)
    try:
        assert any("'bad'" in r.getMessage() and "bias" in r.getMessage() for r in caplog.records), caplog.text
        listing = client.get("/v1/classes").json()
        assert [c["class_name"] for c in listing["classes"]] == ["good"]
        [skipped] = listing["not_served"]
        assert skipped["reason"] == "unservable"
        assert [(c["class_name"], c["class_id"]) for c in skipped["classes"]] == [("bad", D + bad)]
        got = client.post("/v1/classes/good/detect", json={"inputs": inputs.tolist()}).json()["results"]
        np.testing.assert_allclose([r["logit"] for r in got], offline.embed(inputs).astype(np.float64) @ row + b,
                                   rtol=1e-5, atol=1e-5)
        short = _insert_raw(db_path, key, "short", b"\0" * 12, 0.0)  # 3 values, not 16: while serving
        assert _wait_for(lambda: "short" in {c["class_name"] for g in client.get("/v1/classes").json()["not_served"]
                                              for c in g["classes"]})
        assert enroll(client, "later", examples(64)).status_code == 201  # the follower is not stuck on it
        assert client.post("/v1/classes/later/detect", json={"inputs": inputs.tolist()}).status_code == 200
        assert enroll(client, "bad", examples(65)).status_code == 200  # replaced in its slot: served again
        assert client.delete(f"/v1/classes/{D + short}").status_code == 204
        listing = client.get("/v1/classes").json()
        assert [c["class_name"] for c in listing["classes"]] == ["good", "bad", "later"]
        assert listing["not_served"] == []
    finally:
        _close(client)


def test_a_store_that_refuses_writes_is_503_store_unavailable_and_reads_go_on(bundle_path, tmp_path, inputs):
    """The data dir turns read-only while serving: the store's connections reopened read-only (as root
    a chmod would not stop the writes)."""
    from serving.gallery import DB_NAME

    client, state = _server(bundle_path, tmp_path)
    db_path = tmp_path / "data" / DB_NAME
    stores = [state.enrolled.store, state.gallery]
    try:
        assert enroll(client, "kept", examples(66)).status_code == 201
        writable = [s._db for s in stores]
        for s in stores:
            with s._lock:
                s._db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, isolation_level=None,
                                        check_same_thread=False)
        for r in (enroll(client, "refused", examples(67)), client.delete("/v1/classes/kept"),
                  client.post("/v1/gallery/items", json={"items": [{"id": "i", "input": inputs[0].tolist()}]})):
            assert_envelope(r, 503, "store_unavailable")
            assert int(r.headers["retry-after"]) >= 1
        assert [c["class_name"] for c in client.get("/v1/classes").json()["classes"]] == ["kept"]
        assert client.post("/v1/classes/kept/detect", json={"inputs": inputs.tolist()}).status_code == 200
        assert client.get("/v1/health/ready").status_code == 200
        for s, db in zip(stores, writable):
            with s._lock:
                s._db.close()
                s._db = db
        assert enroll(client, "refused", examples(67)).status_code == 201  # writable again: writes go on
    finally:
        _close(client)
