"""The look-alike relation (serving/core/lookalikes.py) against brute force: a snapshot's view of the
append-only PairIndex equals the relation built from its own pairs, at every snapshot size (an older
snapshot never sees a later class's pairs); a union equals the relation of both sets of pairs; and
`exclude` equals the rule written out entry by entry."""
from __future__ import annotations

import numpy as np
import pytest

from serving.core.lookalikes import EnrolledPairs, Lookalikes, PairIndex, exclude

D = 12


def _index(seed: int, n: int = 9):
    """(PairIndex, slots [n] ascending with gaps, lists as stored: some ids not of this model)."""
    rng = np.random.default_rng(seed)
    slots = np.sort(rng.choice(40, size=n, replace=False)).astype(np.int64)
    lists = [tuple(rng.integers(-2, D + 3, size=rng.integers(0, 4)).tolist()) for _ in range(n)]
    index = PairIndex(D)
    for ts in lists:
        index.append(ts)
    return index, slots, lists


def _truth(slots: np.ndarray, lists: list, n: int) -> Lookalikes:
    return Lookalikes((D + int(slots[p]), t) for p in range(n) for t in lists[p] if 0 <= t < D)


@pytest.mark.parametrize("seed", range(5))
def test_every_snapshot_size_sees_exactly_its_own_pairs(seed):
    index, slots, lists = _index(seed)
    every = np.arange(-1, D + 45)
    for n in range(len(slots) + 1):
        view, truth = EnrolledPairs(index, n, slots[:n]), _truth(slots, lists, n)
        assert bool(view) == bool(truth)
        for j in every.tolist():
            assert view.of(j).tolist() == truth.of(j).tolist(), (n, j)
        has = view.has(every)
        want = np.array([len(truth.of(j)) > 0 for j in every.tolist()])
        assert (has | ~want).all()  # every class with a look-alike is flagged
        enrolled = every >= D
        np.testing.assert_array_equal(has[enrolled], want[enrolled])  # exactly, for enrolled ids


def test_a_union_is_the_relation_of_both_pairs():
    index, slots, lists = _index(7)
    bundle_pairs = [(0, 3), (3, 5), (11, 2)]
    view = EnrolledPairs(index, len(slots), slots)
    union = Lookalikes(bundle_pairs).merged(view)
    truth = Lookalikes([*bundle_pairs, *map(tuple, _truth(slots, lists, len(slots)).pairs())])
    for j in range(-1, D + 45):
        assert union.of(j).tolist() == truth.of(j).tolist()
    assert Lookalikes().merged(view) is view and Lookalikes(bundle_pairs).merged(Lookalikes()).pairs() == \
        Lookalikes(bundle_pairs).pairs()


@pytest.mark.parametrize("seed", range(4))
def test_exclude_is_the_rule_entry_by_entry(seed):
    """Random margins over every class, random top-k-like entries (ids, -1 for none): an entry keeps its
    match unless a look-alike's margin is strictly larger; ties keep both."""
    rng = np.random.default_rng(seed)
    index, slots, lists = _index(seed + 10)
    n_e = len(slots)
    view = EnrolledPairs(index, n_e, slots)
    truth = _truth(slots, lists, n_e)
    ids_all = np.concatenate([np.arange(D), D + slots])
    z = rng.integers(-3, 4, size=(6, len(ids_all))).astype(np.float64)  # integers: ties happen
    t = rng.integers(-1, 2, size=len(ids_all)).astype(np.float64)
    col = {int(c): i for i, c in enumerate(ids_all)}
    entries = np.array([rng.permutation(ids_all)[:7] for _ in range(6)])
    entries[0, -1] = -1
    zz = np.array([[z[i, col[c]] if c >= 0 else -np.inf for c in row] for i, row in enumerate(entries)])
    tt = np.array([[t[col[c]] if c >= 0 else np.inf for c in row] for row in entries])
    got = exclude(zz >= tt, entries, view,
                  lambda classes: np.stack([z[:, col[int(r)]] - t[col[int(r)]] for r in classes], axis=1))
    for i, row in enumerate(entries):
        for e, c in enumerate(row.tolist()):
            if c < 0:
                assert not got[i, e]
                continue
            m = z[i, col[c]] - t[col[c]]
            beaten = any(z[i, col[int(r)]] - t[col[int(r)]] > m for r in truth.of(c))
            assert got[i, e] == (m >= 0 and not beaten), (i, c)
    assert (got != (zz >= tt)).any() or not truth  # the rule changed something on these draws


def _record(slot: int, names: tuple[int, ...]):
    from serving.bundle.class_row import ClassRow

    return ClassRow(row=np.zeros(2, np.float32), bias=0.0, threshold=0.0, platt_a=1.0, platt_b=0.0, examples=1,
                    rule="test", name=f"c{slot}", slot=slot, lookalikes=names)


@pytest.mark.parametrize("seed", range(16))
def test_enrolled_classes_that_name_each_other_through_a_rebuild_and_appends(seed):
    """Buffers as the server makes them (serving/core/enrolled.py): a rebuild of the live classes, then
    catch-ups appended, where a class may name any class of its own batch (one of a later slot: it was
    replaced since) or an earlier one, a deleted one, or itself. Every snapshot published answers the
    relation of its own pairs: each class with the trained ids and the live enrolled ids of that
    snapshot it names."""
    from serving.core.enrolled import Enrolled, _snapshot

    rng = np.random.default_rng(seed)
    slots = np.sort(rng.choice(60, size=14, replace=False)).astype(np.int64)
    dead = [s for s in range(60) if s not in set(slots.tolist())]
    m = int(rng.integers(0, 9))  # the rebuild's classes; the others are appended one at a time

    later = np.arange(m, len(slots))
    batches = np.split(later, np.sort(rng.choice(np.arange(1, len(later)), size=2, replace=False)))  # 3 catch-ups

    def names(p: int) -> tuple[int, ...]:
        batch = next(b for b in [np.arange(m), *batches] if p in b)
        live = slots[:batch[-1] + 1]  # a class may name any class of its own catch-up and any earlier one
        picks = [*rng.integers(-2, D + 2, size=rng.integers(0, 3)).tolist(),
                 *(D + rng.choice(live, size=min(len(live), rng.integers(0, 3)), replace=False)).tolist(),
                 D + int(rng.choice(dead)), D + int(slots[p])]  # a deleted class, and itself
        return tuple(int(i) for i in picks)

    records = [_record(int(s), names(p)) for p, s in enumerate(slots)]
    snap = _snapshot(D, 2, {r.slot: r for r in records[:m]}, 0)
    buf = snap._buf
    for batch in batches:  # as EnrolledClasses._apply appends a catch-up's new classes
        buf.extend([records[p] for p in batch[::-1]])
    every = np.arange(-1, D + 62)
    for n in [m, *[int(b[-1]) + 1 for b in batches if len(b)]]:  # the snapshots a server publishes
        view = Enrolled(D, n, 0, buf).lookalikes
        ids = set((D + slots[:n]).tolist())
        truth = Lookalikes((D + int(slots[p]), t) for p in range(n) for t in records[p].lookalikes
                           if 0 <= t < D or (t in ids and t != D + int(slots[p])))
        assert bool(view) == bool(truth), n
        for j in every.tolist():
            assert view.of(j).tolist() == truth.of(j).tolist(), (n, j)
        has = view.has(every)
        assert (has | ~np.array([len(truth.of(j)) > 0 for j in every.tolist()])).all(), n  # every one flagged
        assert not has[(every >= D) & ~np.isin(every, list(ids))].any(), n  # never a class not in the snapshot
        trained = Enrolled(D, n, 0, buf).trained_lookalikes  # SLC_LOOKALIKES=trained: no pair of two enrolled
        only = Lookalikes(p for p in map(tuple, truth.pairs()) if min(p) < D)
        for j in every.tolist():
            assert trained.of(j).tolist() == only.of(j).tolist(), (n, j)
        assert (trained.has(every) | ~np.array([len(only.of(j)) > 0 for j in every.tolist()])).all(), n
