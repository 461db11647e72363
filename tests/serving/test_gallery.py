"""Gallery search against brute force (float64 logits of the stored float32 vectors), upserts, deletes, restarts."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from serving.gallery import Gallery, GalleryRecord

DIM = 16


def brute_force(embeddings: dict[str, np.ndarray], w, b, threshold: float) -> list[tuple[str, np.float32]]:
    """Items with float32(exact logit) >= threshold, best first; exact = float64 sum of float32 products."""
    out = []
    for id_, h in embeddings.items():
        exact = float(np.dot(h.astype(np.float64), np.asarray(w, np.float32).astype(np.float64)) + np.float64(np.float32(b)))
        logit = np.float32(exact)
        if float(logit) >= threshold:
            out.append((id_, logit))
    return sorted(out, key=lambda t: -t[1])


def fill(gallery: Gallery, n: int, seed: int = 0, prefix: str = "item") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    emb = {f"{prefix}-{i}": rng.standard_normal(DIM).astype(np.float32) for i in range(n)}
    gallery.upsert([GalleryRecord(k, v, {"n": i}, [float(i)]) for i, (k, v) in enumerate(emb.items())])
    return emb


@pytest.fixture
def gallery(tmp_path):
    g = Gallery(tmp_path / "data", "digest-a", DIM)
    yield g
    g.close()


def test_search_matches_brute_force(gallery):
    emb = fill(gallery, 400)
    rng = np.random.default_rng(1)
    for _ in range(5):
        w, b = rng.standard_normal(DIM).astype(np.float32), float(rng.standard_normal())
        logits = sorted(z for _, z in brute_force(emb, w, b, -np.inf))
        for threshold in (logits[-1], logits[-37], float(np.median(logits)), logits[0], -1e9, 1e9):
            got = gallery.search(w, b, float(threshold), None)
            want = brute_force(emb, w, b, float(threshold))
            assert [g[0] for g in got] == [x[0] for x in want]
            assert [g[1] for g in got] == [float(x[1]) for x in want]
            assert all(g[2] == {"n": int(g[0].split("-")[1])} for g in got)
    assert len(gallery.search(w, b, -1e9, 25)) == 25
    assert gallery.search(w, b, -1e9, 25) == gallery.search(w, b, -1e9, None)[:25]
    assert gallery.search(w, b, -1e9, 0) == []


def test_items_exactly_at_the_threshold_are_kept_and_just_below_dropped(gallery):
    """logit = x exactly in float64, but faiss's float32 sum x + a - a loses x's low bits.

    With a = 3000.123 faiss scores 0.30004883 for x in {t-, t, t+} (a naive radius would keep
    "below"); with a = 1000.3 it scores 0.2999878 < t (a naive radius would drop "at-2").
    """
    t = np.float32(0.3)
    below, above = np.nextafter(t, np.float32(-np.inf)), np.nextafter(t, np.float32(np.inf))
    values = {"at": (t, 3000.123), "at-2": (t, 1000.3), "below": (below, 3000.123), "below-2": (below, 1000.3),
              "above": (above, 1000.3), "far-below": (0.25, 3000.123), "far-above": (1.0, 5000.1)}
    records = []
    for name, (x, a) in values.items():
        h = np.zeros(DIM, np.float32)
        h[:3] = (x, a, a)
        records.append(GalleryRecord(name, h, None, []))
    gallery.upsert(records)
    w = np.zeros(DIM, np.float32)
    w[:3] = (1, 1, -1)
    got = gallery.search(w, 0.0, float(t), None)
    assert [g[0] for g in got] == ["far-above", "above", "at", "at-2"]
    assert [g[1] for g in got] == [1.0, float(above), float(t), float(t)]
    assert [g[0] for g in gallery.search(w, 0.0, float(above), None)] == ["far-above", "above"]
    # the bias counts: b = 0.5 and t + 0.5 are exact in float32
    shifted = float(t) + 0.5
    assert np.float32(shifted) == shifted
    assert [g[0] for g in gallery.search(w, 0.5, shifted, None)] == ["far-above", "above", "at", "at-2"]
    emb = {r.id: r.embedding for r in records}
    for threshold in (float(t), float(below), float(above), shifted, 0.25, 1.0):
        for b in (0.0, 0.5, -0.25):
            want = brute_force(emb, w, b, threshold)
            assert [(g[0], g[1]) for g in gallery.search(w, b, threshold, None)] == [(i, float(z)) for i, z in want]


def test_upsert_replaces_by_id(gallery):
    emb = fill(gallery, 50)
    new = np.full(DIM, 2.0, np.float32)
    gallery.upsert([GalleryRecord("item-3", new, {"v": 2}, [9.0])])
    emb["item-3"] = new
    assert gallery.count() == 50
    assert gallery.get("item-3") == {"id": "item-3", "metadata": {"v": 2}, "input": [9.0]}
    w = np.ones(DIM, np.float32)
    got = gallery.search(w, 0.0, -1e9, None)
    assert [g[0] for g in got] == [x[0] for x in brute_force(emb, w, 0.0, -1e9)]
    assert got[0][0] == "item-3" and got[0][1] == 32.0
    # the same id twice in one call: the last one wins, one row
    gallery.upsert([GalleryRecord("dup", new, {"v": 1}, []), GalleryRecord("dup", -new, {"v": 2}, [])])
    assert gallery.count() == 51 and gallery.get("dup")["metadata"] == {"v": 2}
    assert [g[0] for g in gallery.search(w, 0.0, 31.0, None)] == ["item-3"]


def test_delete(gallery):
    emb = fill(gallery, 30)
    assert gallery.delete("item-7") is True
    assert gallery.delete("item-7") is False
    assert gallery.get("item-7") is None and gallery.count() == 29
    del emb["item-7"]
    w = np.random.default_rng(3).standard_normal(DIM).astype(np.float32)
    assert [g[0] for g in gallery.search(w, 0.1, -1e9, None)] == [x[0] for x in brute_force(emb, w, 0.1, -1e9)]


def test_restart_rebuilds_index_from_sqlite(tmp_path):
    g = Gallery(tmp_path, "digest-a", DIM)
    emb = fill(g, 200)
    g.delete("item-0")
    del emb["item-0"]
    g.close()
    with pytest.raises(RuntimeError):
        g.count()
    g2 = Gallery(tmp_path, "digest-a", DIM)
    assert g2.count() == 199 and g2.get("item-5") == {"id": "item-5", "metadata": {"n": 5}, "input": [5.0]}
    w = np.random.default_rng(4).standard_normal(DIM).astype(np.float32)
    got = g2.search(w, -0.2, 0.5, None)
    assert [(g[0], g[1]) for g in got] == [(i, float(z)) for i, z in brute_force(emb, w, -0.2, 0.5)]
    g2.close()


def test_other_bundle_rows_hidden_until_reembedded(tmp_path):
    g = Gallery(tmp_path, "digest-a", DIM)
    fill(g, 20)
    g.close()
    g = Gallery(tmp_path, "digest-b", DIM)
    assert g.count() == 0 and g.get("item-1") is None and g.stale_count() == 20
    assert g.search(np.ones(DIM, np.float32), 0.0, -1e9, None) == []
    assert g.delete("item-0") is True and g.stale_count() == 19  # delete reaches rows of any bundle
    g.upsert([GalleryRecord("item-1", np.full(DIM, 0.5, np.float32), {"new": True}, [1.0])])  # replaces a stale row
    assert g.count() == 1 and g.stale_count() == 18 and g.get("item-1")["metadata"] == {"new": True}
    # re-embed from the stored inputs ([i]) with "the new backbone": h = i * ones
    assert g.reembed(lambda inputs: np.asarray(inputs, np.float32) * np.ones((1, DIM), np.float32), batch_size=7) == 18
    assert g.count() == 19 and g.stale_count() == 0 and g.get("item-4")["input"] == [4.0]
    got = g.search(np.ones(DIM, np.float32), 0.0, -1e9, None)
    assert got[0] == ("item-19", 19.0 * DIM, {"n": 19}) and got[-1] == ("item-1", 0.5 * DIM, {"new": True})
    assert [i for i, _, _ in got] == [f"item-{n}" for n in range(19, 1, -1)] + ["item-1"]
    g.close()


def test_rejects_bad_records(gallery):
    with pytest.raises(ValueError):
        gallery.upsert([GalleryRecord("x", np.zeros(DIM + 1, np.float32), None, [])])
    with pytest.raises(ValueError):
        gallery.upsert([GalleryRecord("x", np.full(DIM, np.nan, np.float32), None, [])])
    with pytest.raises(ValueError):
        gallery.upsert([GalleryRecord("", np.zeros(DIM, np.float32), None, [])])
    with pytest.raises(ValueError):
        gallery.search(np.zeros(DIM, np.float32), 0.0, float("nan"), None)
    assert gallery.count() == 0


def test_concurrent_upserts_deletes_and_searches(gallery):
    rng = np.random.default_rng(5)
    per_thread, threads = 60, 4
    emb = {f"t{t}-{i}": rng.standard_normal(DIM).astype(np.float32) for t in range(threads) for i in range(per_thread)}
    errors: list[BaseException] = []
    w = rng.standard_normal(DIM).astype(np.float32)

    def writer(t: int) -> None:
        try:
            for i in range(per_thread):
                gallery.upsert([GalleryRecord(f"t{t}-{i}", emb[f"t{t}-{i}"], {"t": t}, [])])
                if i % 10 == 9:
                    assert gallery.delete(f"t{t}-{i - 5}")
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    def reader() -> None:
        try:
            for _ in range(100):
                for id_, logit, _ in gallery.search(w, 0.0, 0.0, None):
                    assert logit >= 0.0 and id_ in emb
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    workers = [threading.Thread(target=writer, args=(t,)) for t in range(threads)] + [threading.Thread(target=reader) for _ in range(2)]
    for th in workers:
        th.start()
    for th in workers:
        th.join()
    assert not errors
    for t in range(threads):
        for i in range(per_thread):
            if i % 10 == 4:
                del emb[f"t{t}-{i}"]
    assert gallery.count() == len(emb)
    got = gallery.search(w, 0.0, -1e9, None)
    assert [(g[0], g[1]) for g in got] == [(i, float(z)) for i, z in brute_force(emb, w, 0.0, -1e9)]


# --- a full disk (a quota on the database: SQLite's max_page_count, no root needed)


def _fill_until_full(gallery_write, big: dict, limit: int = 500) -> int:
    """Write items of `big` metadata until a write fails; the count that succeeded."""
    for n in range(limit):
        if not gallery_write(f"fill-{n}", big):
            return n
    raise AssertionError("the quota was never reached")


def test_a_full_gallery_refuses_a_write_and_keeps_every_earlier_one(tmp_path):
    from serving.gallery import Gallery, GalleryRecord, StorageFull

    g = Gallery(tmp_path, "digest", 4, max_bytes=128 * 1024)
    big = {"blob": "x" * 4000}

    def write(item_id, metadata):
        try:
            g.upsert([GalleryRecord(id=item_id, embedding=np.ones(4, np.float32), metadata=metadata, input=[0] * 4)])
            return True
        except StorageFull:
            return False

    n = _fill_until_full(write, big)
    assert n > 3 and g.count() == n and g.get(f"fill-{n}") is None  # the refused write left nothing behind
    assert all(g.get(f"fill-{i}")["metadata"] == big for i in range(n))
    for i in range(3):
        assert g.delete(f"fill-{i}")
    assert write("after", big) and g.get("after")["metadata"] == big  # space came back: writes work again
    g.close()
    g2 = Gallery(tmp_path, "digest", 4)  # and all of it is on disk
    assert g2.count() == n - 3 + 1
    g2.close()


def test_http_write_on_a_full_gallery_is_507_with_the_cause(client_factory):
    from tests.serving.helpers import assert_envelope

    c = client_factory(gallery_max_bytes=128 * 1024)
    x = [0.5] * 12
    big = {"blob": "y" * 4000}

    def write(item_id, metadata):
        r = c.post("/v1/gallery/items", json={"items": [{"id": item_id, "input": x, "metadata": metadata}]})
        if r.status_code == 507:
            message = assert_envelope(r, 507, "insufficient_storage")["error"]["message"]
            assert "full" in message and "nothing was written" in message
            return False
        assert r.status_code == 201, r.text
        return True

    n = _fill_until_full(write, big)
    assert c.get("/v1/health/ready").status_code == 200  # the server stays up
    assert c.get("/v1/gallery").json()["count"] == n
    for i in range(3):
        assert c.delete(f"/v1/gallery/items/fill-{i}").status_code == 204
    assert write("after", big)
