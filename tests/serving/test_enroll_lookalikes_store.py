"""The enrolled store keeps each class's look-alikes (the class ids its examples resembled) in
`enrolled_lookalikes`, in the class's own transaction: `changes()` gives them to every replica (and to
`slc bundle fold`), a replacement replaces them, a delete clears them, `kept()` returns them for adding;
a store made by an older slc gains the table when opened; a stored value that cannot be read is the
record's `problem`, never an exception; re-keying an older slc's classes carries them to the class's
slot (an enrolled look-alike renumbered with its class). On SQLite and, where a throwaway server
can be started, on PostgreSQL. Truth: what was put, and the table read with the database's own
driver, not through the store."""
from __future__ import annotations

import json
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from serving.gallery import DB_NAME
from tests.serving.helpers import postgres_missing

pytestmark = pytest.mark.integration  # real files, a real PostgreSQL

KINDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.skipif(postgres_missing() is not None,
                                                                     reason=str(postgres_missing())))]
DIM = 4
ROW = np.arange(DIM, dtype=np.float32) / 10


@pytest.fixture(scope="module")
def postgres_url():
    from tests.serving.helpers import throwaway_postgres

    with throwaway_postgres() as (url, _):
        yield url


class Place:
    """One database (a SQLite data dir or a PostgreSQL url): stores opened on it, raw SQL beside them."""

    def __init__(self, kind: str, data: Path, url=None):
        self.kind, self.data, self.url = kind, data, url
        self.opened = []

    def store(self, key: str):
        from serving.gallery.enrolled import open_enrolled_store

        s = open_enrolled_store(self.url, self.data, key)
        self.opened.append(s)
        return s

    @contextmanager
    def _raw(self):
        if self.kind == "sqlite":
            db = sqlite3.connect(self.data / DB_NAME, isolation_level=None)
            try:
                yield db, "?"
            finally:
                db.close()
        else:
            import psycopg

            with psycopg.connect(self.url, autocommit=True) as db:
                yield db, "%s"

    def sql(self, text: str, params: tuple = ()) -> list[tuple]:
        """`text` (with ? placeholders) run on a connection of its own, outside any store."""
        with self._raw() as (db, mark):
            cur = db.execute(text.replace("?", mark), params)
            return cur.fetchall() if cur.description else []

    def lookalike_rows(self, key: str) -> dict[int, list]:
        return {int(s): json.loads(ids) for s, ids in
                self.sql("SELECT slot, ids FROM enrolled_lookalikes WHERE digest = ?", (key,))}

    def close(self):
        for s in self.opened:
            s.close()


@pytest.fixture(params=KINDS)
def place(request, tmp_path):
    if request.param == "postgres":
        url = request.getfixturevalue("postgres_url")
        p = Place("postgres", tmp_path, url)
        p.sql("DROP TABLE IF EXISTS enrolled_classes, enrolled_examples, enrolled_lookalikes, enrolled_state, "
              "enrolled_models")
    else:
        p = Place("sqlite", tmp_path / "data")
    yield p
    p.close()


def _put(store, name: str, lookalikes=(), **kw):
    return store.put(name, ROW, 0.25, 1.5, 2.0, -0.5, 3, "imprint+global", 100, lookalikes=lookalikes, **kw)


def _live(store, since: int = 0) -> dict[str, tuple]:
    """The last record of each name after `since`: (slot, deleted, lookalikes, problem)."""
    return {r.name: (r.slot, r.deleted, r.lookalikes, r.problem) for r in store.changes(since)}


def test_a_second_replica_reads_the_lookalikes_a_put_stored_replaced_emptied_and_deleted(place):
    a, b = place.store("k"), place.store("k")  # two replicas' connections
    w = _put(a, "x", (7, 2, 7, np.int64(11)))  # kept distinct and sorted
    [r] = b.changes(0)
    assert (r.name, r.slot, r.seq, r.lookalikes, r.problem) == ("x", w.slot, w.seq, (2, 7, 11), None)
    np.testing.assert_array_equal(r.row, ROW)
    assert place.lookalike_rows("k") == {w.slot: [2, 7, 11]}
    assert a.kept("x").lookalikes == b.kept("x").lookalikes == (2, 7, 11)

    since = b.seq()
    _put(a, "other", (5,))
    w2 = _put(a, "x", (3,))  # a replacement: same slot, the new look-alikes only
    assert w2.slot == w.slot and not w2.created
    assert _live(b, since) == {"other": (1, False, (5,), None), "x": (w.slot, False, (3,), None)}
    assert b.kept("x").lookalikes == (3,)

    since = b.seq()
    _put(a, "x")  # replaced without look-alikes: none stored any more
    assert _live(b, since) == {"x": (w.slot, False, (), None)}
    assert place.lookalike_rows("k") == {1: [5]} and b.kept("x").lookalikes == ()

    _put(a, "x", (4, 0))
    since = b.seq()
    assert a.delete("x").slot == w.slot
    [tomb] = b.changes(since)
    assert (tomb.name, tomb.deleted, tomb.row, tomb.lookalikes, tomb.problem) == ("x", True, None, (), None)
    assert place.lookalike_rows("k") == {1: [5]} and b.kept("x") is None
    assert a.delete_slot(1).slot == 1 and place.lookalike_rows("k") == {}
    assert [(r.name, r.deleted, r.lookalikes) for r in b.changes(0)] == [("x", True, ()), ("other", True, ())]


def test_lookalikes_are_kept_per_model_key(place):
    a, other = place.store("k"), place.store("k2")
    _put(a, "x", (1,))
    _put(other, "x", (9,))
    assert _live(a)["x"][2] == (1,) and _live(other)["x"][2] == (9,)
    other.delete("x")
    assert _live(a)["x"][2] == (1,) and a.kept("x").lookalikes == (1,)


@pytest.mark.parametrize("bad", [[-1], [1.5], ["3"], [True], [None], "12", [1, -5]])
def test_lookalikes_that_are_no_trained_ids_are_refused_before_anything_is_written(place, bad):
    s = place.store("k")
    _put(s, "x", (1,))
    seq = s.seq()
    for name in ("x", "new"):
        with pytest.raises(ValueError):
            _put(s, name, bad)
    assert s.seq() == seq and s.kept("new") is None
    assert _live(s)["x"][2] == (1,) and place.lookalike_rows("k") == {0: [1]}


def test_the_lookalikes_are_written_in_the_class_transaction(place):
    """A write of the look-alikes that fails undoes the class row's write too (and a refused write
    leaves them as they were)."""
    from serving.gallery.enrolled import Changed, LimitReached

    s = place.store("k")
    w = _put(s, "x", (1,))
    with pytest.raises(Changed):
        _put(s, "x", (2,), expect_seq=w.seq - 1)
    with pytest.raises(LimitReached):
        s.put("y", ROW, 0.0, 1.0, 1.0, 0.0, 3, "imprint+global", 1, lookalikes=(2,))
    if place.kind == "sqlite":
        place.sql("""CREATE TRIGGER refuse_ins BEFORE INSERT ON enrolled_lookalikes WHEN NEW.ids = '[666]'
                     BEGIN SELECT RAISE(ABORT, 'refused'); END""")
        place.sql("""CREATE TRIGGER refuse_del BEFORE DELETE ON enrolled_lookalikes WHEN OLD.ids = '[1]'
                     BEGIN SELECT RAISE(ABORT, 'refused'); END""")
    else:
        place.sql("""CREATE OR REPLACE FUNCTION refuse() RETURNS trigger AS $$
                     BEGIN RAISE EXCEPTION 'refused'; END $$ LANGUAGE plpgsql""")
        place.sql("""CREATE TRIGGER refuse_ins BEFORE INSERT ON enrolled_lookalikes FOR EACH ROW
                     WHEN (NEW.ids = '[666]') EXECUTE FUNCTION refuse()""")
        place.sql("""CREATE TRIGGER refuse_del BEFORE DELETE ON enrolled_lookalikes FOR EACH ROW
                     WHEN (OLD.ids = '[1]') EXECUTE FUNCTION refuse()""")
    with pytest.raises(Exception, match="refused"):
        s.put("x", ROW * 2, 9.0, 1.0, 1.0, 0.0, 3, "imprint+global", 100, lookalikes=(666,))
    with pytest.raises(Exception, match="refused"):
        s.delete("x")
    [r] = place.store("k").changes(0)
    assert (r.seq, r.bias, r.deleted, r.lookalikes) == (w.seq, 0.25, False, (1,))
    np.testing.assert_array_equal(r.row, ROW)
    assert s.seq() == w.seq


@pytest.mark.parametrize("value", ["not json", '{"a": 1}', "[1, -2]", "[1.5]", "[true]", '"[1]"', "[NaN]",
                                   "[[1]]", "[" * 100_000 + "]" * 100_000, "[" + "9" * 5000 + "]"],
                         ids=lambda v: v if len(v) < 20 else f"{v[:4]}...{len(v)}")
def test_a_stored_value_that_cannot_be_read_is_the_records_problem_never_an_exception(place, value):
    s = place.store("k")
    _put(s, "bad", (1,))
    _put(s, "good", (2,))
    _put(s, "gone", (3,))
    s.delete("gone")
    place.sql("UPDATE enrolled_lookalikes SET ids = ? WHERE digest = ? AND slot = 0", (value, "k"))
    place.sql("INSERT INTO enrolled_lookalikes (digest, slot, ids) VALUES (?, 2, 'junk')", ("k",))  # a tombstone's
    records = {r.name: r for r in place.store("k").changes(0)}
    bad = records["bad"]
    assert bad.problem and bad.problem.startswith("the stored look-alikes cannot be read") and "\n" not in bad.problem
    assert bad.lookalikes == () and len(bad.problem) < 200
    np.testing.assert_array_equal(bad.row, ROW)  # the rest of the record is read as ever
    assert bad.unservable(DIM, lambda name: False) == bad.problem  # so a reader skips it, and names why
    assert (records["good"].problem, records["good"].lookalikes) == (None, (2,))
    assert records["good"].unservable(DIM, lambda name: False) is None
    assert (records["gone"].deleted, records["gone"].problem, records["gone"].lookalikes) == (True, None, ())
    assert s.kept("bad").lookalikes == () and s.kept("bad").seq == records["bad"].seq
    _put(s, "bad", (4,))  # written again: readable again
    assert _live(s)["bad"][2:] == ((4,), None)


def test_a_sqlite_blob_that_is_no_text_is_a_problem_too(tmp_path):
    from serving.gallery.enrolled import SqliteEnrolledStore

    s = SqliteEnrolledStore(tmp_path, "k")
    _put(s, "bad", (1,))
    db = sqlite3.connect(tmp_path / DB_NAME, isolation_level=None)
    db.execute("UPDATE enrolled_lookalikes SET ids = ?", (b"\xff\xfe[1]",))
    db.close()
    [r] = s.changes(0)
    assert r.problem.startswith("the stored look-alikes cannot be read") and r.lookalikes == ()
    s.close()


_OLD_SCHEMA = [  # the tables as slc wrote them before enrolled_lookalikes (serving/gallery/enrolled.py then)
    """CREATE TABLE enrolled_classes (digest TEXT NOT NULL, slot INTEGER NOT NULL, name TEXT NOT NULL, row BLOB,
           bias REAL, threshold REAL, platt_a REAL, platt_b REAL, examples INTEGER, rule TEXT, created REAL NOT NULL,
           seq INTEGER NOT NULL, deleted INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (digest, slot))""",
    "CREATE UNIQUE INDEX enrolled_live_name ON enrolled_classes(digest, name) WHERE deleted = 0",
    "CREATE INDEX enrolled_seq ON enrolled_classes(digest, seq)",
    """CREATE TABLE enrolled_examples (digest TEXT NOT NULL, slot INTEGER NOT NULL, dim INTEGER NOT NULL,
           embeddings BLOB NOT NULL, PRIMARY KEY (digest, slot))""",
    """CREATE TABLE enrolled_state (digest TEXT PRIMARY KEY, next_slot INTEGER NOT NULL, seq INTEGER NOT NULL,
           live INTEGER NOT NULL)""",
    """CREATE TABLE enrolled_models (model_key TEXT PRIMARY KEY, name TEXT NOT NULL, path TEXT NOT NULL,
           digest TEXT NOT NULL, backbone TEXT NOT NULL, head TEXT NOT NULL, classes INTEGER NOT NULL,
           dim INTEGER NOT NULL, seen REAL NOT NULL)""",
]


def test_a_store_an_older_slc_made_gains_the_table_when_opened(tmp_path):
    from serving.gallery.enrolled import SqliteEnrolledStore

    tmp_path.mkdir(exist_ok=True)
    db = sqlite3.connect(tmp_path / DB_NAME, isolation_level=None)
    for statement in _OLD_SCHEMA:
        db.execute(statement)
    db.execute("""INSERT INTO enrolled_classes VALUES ('k', 0, 'old', ?, 0.5, 1.0, 2.0, -1.0, 3, 'imprint+global',
                  ?, 1, 0)""", (ROW.astype("<f4").tobytes(), time.time()))
    db.execute("INSERT INTO enrolled_state VALUES ('k', 1, 1, 1)")
    db.close()

    s = SqliteEnrolledStore(tmp_path, "k")
    [r] = s.changes(0)
    assert (r.name, r.slot, r.seq, r.bias, r.lookalikes, r.problem) == ("old", 0, 1, 0.5, (), None)
    np.testing.assert_array_equal(r.row, ROW)
    assert s.kept("old").lookalikes == () and s.kept("old").embeddings is None
    w = _put(s, "old", (6, 1))
    assert w.slot == 0 and not w.created
    other = SqliteEnrolledStore(tmp_path, "k")  # another replica, opened on the upgraded file
    assert _live(other) == {"old": (0, False, (1, 6), None)}
    db = sqlite3.connect(tmp_path / DB_NAME)
    assert db.execute("SELECT digest, slot, ids FROM enrolled_lookalikes").fetchall() == [("k", 0, "[1,6]")]
    db.close()
    s.close()
    other.close()


@pytest.mark.skipif(postgres_missing() is not None, reason=str(postgres_missing()))
def test_a_postgres_store_an_older_slc_made_gains_the_table_when_opened(postgres_url, tmp_path):
    p = Place("postgres", tmp_path, postgres_url)
    try:
        p.sql("DROP TABLE IF EXISTS enrolled_classes, enrolled_examples, enrolled_lookalikes, enrolled_state, "
              "enrolled_models")
        s = p.store("k")
        _put(s, "old")
        s.close()
        p.sql("DROP TABLE enrolled_lookalikes")  # as the older slc left it
        s = p.store("k")
        assert _live(s) == {"old": (0, False, (), None)}
        _put(s, "old", (2,))
        assert _live(p.store("k")) == {"old": (0, False, (2,), None)}
    finally:
        p.close()


def _model(key: str):
    from serving.gallery.enrolled import ModelRecord

    return ModelRecord(key=key, name="m", path="/m", digest="d" * 64, backbone="b", head="h", classes=10, dim=DIM)


def test_rekeying_into_an_empty_key_moves_the_lookalikes_with_their_classes(place):
    legacy_key, key = "a" * 64, "model-key"
    legacy = place.store(legacy_key)  # as an older slc keyed them (by manifest digest)
    _put(legacy, "p", (3,))
    _put(legacy, "q")
    _put(legacy, "r", (1, 2))
    legacy.delete("r")
    store = place.store(key)
    [adopted] = store.register(_model(key), [legacy_key])
    assert (adopted.moved, adopted.renumbered) == (2, False)
    assert _live(store) == {"p": (0, False, (3,), None), "q": (1, False, (), None), "r": (2, True, (), None)}
    assert store.kept("p").lookalikes == (3,)
    assert place.lookalike_rows(key) == {0: [3]} and place.lookalike_rows(legacy_key) == {}
    assert _live(place.store(key)) == _live(store)  # another replica reads the same


def test_rekeying_into_a_key_with_classes_maps_the_lookalikes_to_the_new_slots(place):
    """Appended classes take new slots (legacy slot 2, 'new', lands on 3, while this key's slot 2 is
    'plain'); of one name the later enrollment stays, with its look-alikes."""
    legacy_key, key = "b" * 64, "model-key"
    legacy, mine = place.store(legacy_key), place.store(key)
    pause = lambda: time.sleep(0.01)  # noqa: E731  (created times strictly ordered)
    _put(legacy, "keepmine", (1,))  # legacy slot 0, older than this key's: dropped
    pause()
    _put(mine, "dup", (9,), embeddings=np.ones((2, DIM), np.float32))  # slot 0
    _put(mine, "keepmine", (8,))  # slot 1
    _put(mine, "plain", (5,))  # slot 2
    pause()
    _put(legacy, "dup", (2, 3))  # legacy slot 1, later than this key's: replaces it
    _put(legacy, "new", (4,))  # legacy slot 2
    _put(legacy, "bare")  # legacy slot 3
    [adopted] = mine.register(_model(key), [legacy_key])
    assert (adopted.moved, adopted.renumbered, adopted.replaced, adopted.dropped) == (2, True, ["dup"], ["keepmine"])
    assert _live(mine) == {"dup": (0, False, (2, 3), None), "keepmine": (1, False, (8,), None),
                           "plain": (2, False, (5,), None), "new": (3, False, (4,), None),
                           "bare": (4, False, (), None)}
    assert mine.kept("dup").lookalikes == (2, 3) and mine.kept("new").lookalikes == (4,)
    assert place.lookalike_rows(key) == {0: [2, 3], 1: [8], 2: [5], 3: [4]}
    assert place.lookalike_rows(legacy_key) == {}


def test_rekeying_renumbers_enrolled_lookalikes_with_their_classes(place):
    """A look-alike that is an enrolled class (id D + slot, D = 10 here) follows its class to the slot
    this key gives it, and is left out with a class that is not carried over; trained ids stay."""
    legacy_key, key, D = "c" * 64, "model-key", 10
    legacy, mine = place.store(legacy_key), place.store(key)
    pause = lambda: time.sleep(0.01)  # noqa: E731  (created times strictly ordered)
    _put(legacy, "keepmine", (1,))  # legacy slot 0, older than this key's: dropped
    pause()
    _put(mine, "dup", (9,))  # slot 0
    _put(mine, "keepmine", (8,))  # slot 1
    pause()
    _put(legacy, "dup", (2, D + 0))  # legacy slot 1: replaces slot 0 here; names the dropped keepmine
    _put(legacy, "new", (4, D + 1, D + 0))  # legacy slot 2 -> slot 2 here; names legacy dup (-> slot 0)
    _put(legacy, "bare", (D + 2,))  # legacy slot 3 -> slot 3 here; names legacy new (-> slot 2)
    [adopted] = mine.register(_model(key), [legacy_key])
    assert (adopted.replaced, adopted.dropped) == (["dup"], ["keepmine"])
    assert _live(mine) == {"dup": (0, False, (2,), None), "keepmine": (1, False, (8,), None),
                           "new": (2, False, (4, D + 0), None), "bare": (3, False, (D + 2,), None)}
    assert place.lookalike_rows(key) == {0: [2], 1: [8], 2: [4, D + 0], 3: [D + 2]}
    assert _live(place.store(key)) == _live(mine)  # another replica reads the same
