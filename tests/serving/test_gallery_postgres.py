"""The gallery shared through PostgreSQL (serving/gallery/postgres.py), against a real throwaway
PostgreSQL: replicas see each other's writes, deletes and replacements; their searches equal a
brute-force search of the table; two `slc serve` processes share one gallery, and an
acknowledged write survives kill -9 of the replica that took it."""
from __future__ import annotations

import json
import signal
import time

import httpx
import numpy as np
import pytest

from serving.gallery import GalleryRecord
from tests.serving.helpers import free_port, postgres_missing, serve_process, throwaway_postgres, wait_http_ready

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(postgres_missing() is not None, reason=str(postgres_missing()))]

DIM = 6


@pytest.fixture(scope="module")
def postgres():
    with throwaway_postgres() as (url, stop):
        yield url


@pytest.fixture
def url(postgres):
    """The shared database, emptied for each test."""
    import psycopg

    with psycopg.connect(postgres, autocommit=True) as db:
        db.execute("DROP TABLE IF EXISTS slc_gallery_items, slc_gallery_tombstones, slc_gallery_pruned")
        db.execute("DROP SEQUENCE IF EXISTS slc_gallery_seq")
    return postgres


def _replica(url, digest="bundle-a"):
    from serving.gallery.postgres import PostgresGallery

    return PostgresGallery(url, digest, DIM, poll_s=0.2)


def _eventually(check, timeout=10.0):
    """Poll `check` until it is true; returns the seconds it took (the caller asserts it happened)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if check():
            return time.monotonic() - t0
        time.sleep(0.02)
    return None


def _ids(gallery, w, b=0.0, threshold=-1e30):
    return [hit[0] for hit in gallery.search(np.asarray(w, np.float32), b, threshold, None)]


def test_a_write_on_one_replica_is_found_by_the_other(url):
    with _replica(url) as a, _replica(url) as b:
        a.upsert([GalleryRecord("x1", np.ones(DIM, np.float32), {"who": "a"}, [1])])
        assert _ids(a, np.ones(DIM)) == ["x1"]  # read-your-writes on the writer
        assert _eventually(lambda: _ids(b, np.ones(DIM)) == ["x1"]) is not None
        assert b.get("x1") == {"id": "x1", "metadata": {"who": "a"}, "input": [1]}


def test_a_delete_on_one_replica_removes_the_item_from_the_other(url):
    with _replica(url) as a, _replica(url) as b:
        a.upsert([GalleryRecord("x1", np.ones(DIM, np.float32)), GalleryRecord("x2", -np.ones(DIM, np.float32))])
        assert _eventually(lambda: b.count() == 2) is not None
        assert b.delete("x1") is True and b.delete("x1") is False
        assert _eventually(lambda: a.count() == 1 and _ids(a, np.ones(DIM)) == ["x2"]) is not None


def test_a_replacement_moves_the_item_in_every_replica(url):
    with _replica(url) as a, _replica(url) as b:
        a.upsert([GalleryRecord("x", np.ones(DIM, np.float32))])
        assert _eventually(lambda: b.count() == 1) is not None
        b.upsert([GalleryRecord("x", -np.ones(DIM, np.float32))])  # now scores -DIM against ones
        assert _eventually(lambda: _ids(a, np.ones(DIM), threshold=0.0) == []) is not None
        assert a.count() == 1 and _ids(a, -np.ones(DIM), threshold=0.0) == ["x"]


def test_replicas_after_interleaved_writes_equal_a_brute_force_search_of_the_table(url):
    import psycopg

    rng = np.random.default_rng(0)
    with _replica(url) as a, _replica(url) as b:
        for step in range(60):
            writer = (a, b)[step % 2]
            item = f"i{rng.integers(0, 25)}"
            if rng.random() < 0.25:
                writer.delete(item)
            else:
                writer.upsert([GalleryRecord(item, rng.normal(size=DIM).astype(np.float32), {"step": step})])
        with psycopg.connect(url) as db:
            rows = db.execute("SELECT id, embedding FROM slc_gallery_items").fetchall()
        w, bias, threshold = rng.normal(size=DIM), 0.3, 0.0
        truth = {i: float(np.frombuffer(e, "<f4").astype(np.float64) @ w + bias) for i, e in rows}
        expected = sorted((i for i, z in truth.items() if z >= threshold), key=lambda i: -truth[i])
        for replica in (a, b):
            assert _eventually(lambda: _ids(replica, w, bias, threshold) == expected) is not None
            assert replica.count() == len(rows)


def test_items_of_another_bundle_stay_invisible(url):
    with _replica(url, "bundle-a") as a, _replica(url, "bundle-b") as other:
        other.upsert([GalleryRecord("theirs", np.ones(DIM, np.float32))])
        a.upsert([GalleryRecord("ours", np.ones(DIM, np.float32))])
        a.catch_up()
        assert _ids(a, np.ones(DIM)) == ["ours"] and a.get("theirs") is None and a.stale_count() == 1


def test_an_unreachable_database_is_one_clear_error():
    from serving.gallery import GalleryUnavailable

    with pytest.raises(GalleryUnavailable, match="cannot reach the gallery database"):
        _replica(f"postgresql://slc@127.0.0.1:{free_port()}/postgres")


# ---------------------------------------------------------------------------------- two servers
def _items(n, start=0):
    rng = np.random.default_rng(start)
    return [{"id": f"item-{start + k}", "input": rng.normal(size=12).round(4).tolist(), "metadata": {"k": start + k}}
            for k in range(n)]


def test_two_servers_share_one_gallery_and_acknowledged_writes_survive_kill_9(url, bundle_path, tmp_path):
    ports = [free_port(), free_port()]
    procs = [serve_process(bundle_path, tmp_path / f"r{i}", port, "--gallery-url", url) for i, port in enumerate(ports)]
    base = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for u, proc in zip(base, procs):
            wait_http_ready(u, proc, timeout=120)
        acked = []
        for n in range(5):  # written through replica 0, each acknowledged
            items = _items(4, start=4 * n)
            r = httpx.post(f"{base[0]}/v1/gallery/items", json={"items": items}, timeout=30)
            assert r.status_code == 201, r.text
            acked += [it["id"] for it in items]
        procs[0].send_signal(signal.SIGKILL)  # no shutdown: only what PostgreSQL committed remains
        procs[0].wait(30)

        def all_found() -> bool:
            return all(httpx.get(f"{base[1]}/v1/gallery/items/{i}", timeout=10).status_code == 200 for i in acked)

        assert _eventually(all_found) is not None
        info = httpx.get(f"{base[1]}/v1/gallery", timeout=10).json()
        assert info["count"] == len(acked)
        search = httpx.post(f"{base[1]}/v1/classes/3/search", json={"threshold": -1e30, "limit": 1000}, timeout=10).json()
        assert sorted(hit["id"] for hit in search["results"]) == sorted(acked)
        got = httpx.get(f"{base[1]}/v1/gallery/items/item-7", timeout=10).json()
        assert got["metadata"] == {"k": 7} and json.dumps(got["input"]) == json.dumps(_items(4, start=4)[3]["input"])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)


def test_a_database_that_goes_away_is_a_503_envelope_and_detect_keeps_answering(bundle_path, tmp_path):
    with throwaway_postgres() as (own_url, stop):
        port = free_port()
        proc = serve_process(bundle_path, tmp_path, port, "--gallery-url", own_url)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_http_ready(base, proc, timeout=120)
            assert httpx.post(f"{base}/v1/gallery/items", json={"items": _items(1)}, timeout=30).status_code == 201
            stop()  # PostgreSQL gone
            r = httpx.get(f"{base}/v1/gallery/items/item-0", timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "gallery_unavailable"
            assert r.headers["retry-after"] == "1"
            w = httpx.post(f"{base}/v1/gallery/items", json={"items": _items(1, start=5)}, timeout=30)
            assert w.status_code == 503 and w.json()["error"]["code"] == "gallery_unavailable"
            detect = httpx.post(f"{base}/v1/classes/1/detect", json={"inputs": [[0.5] * 12]}, timeout=30)
            assert detect.status_code == 200
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def test_the_sync_benchmark_sees_every_change_on_the_other_replica(url, tmp_path):
    from click.testing import CliRunner

    from slc.cli import root

    result = CliRunner().invoke(root, ["bench", "gallery", "--gallery-url", url, "--items", "5", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "shared-gallery.json").read_text())
    assert data["upsert"]["n"] == data["delete"]["n"] == 5 and data["upsert"]["lost"] == data["delete"]["lost"] == 0


def test_replicas_reconnect_after_the_database_restarts_and_see_what_was_written_meanwhile():
    with throwaway_postgres() as (own_url, stop):
        with _replica(own_url) as a, _replica(own_url) as b:
            a.upsert([GalleryRecord("before", np.ones(DIM, np.float32))])
            assert _eventually(lambda: b.count() == 1) is not None
            stop()
            stop.start()
            with _replica(own_url) as c:  # a third replica writes while a and b have dead connections
                c.upsert([GalleryRecord("during", -np.ones(DIM, np.float32))])
            assert _eventually(lambda: _try(lambda: b.count() == 2 and a.get("during") is not None)) is not None
            a.upsert([GalleryRecord("after", np.ones(DIM, np.float32))])
            assert _eventually(lambda: _try(lambda: sorted(_ids(b, np.ones(DIM))) == ["after", "before", "during"]))


def _try(check):
    from serving.gallery import GalleryUnavailable

    try:
        return check()
    except GalleryUnavailable:
        return False


def test_ids_with_nul_are_never_found_rather_than_an_error(url):
    with _replica(url) as a:
        assert a.get("a\x00b") is None and a.delete("a\x00b") is False
