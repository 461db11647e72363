"""Look-alikes (docs/api.md "Look-alikes") in every route that answers `match`, against the rule written
out offline (tests/serving/test_enroll.py `Extended.matches`: float64 logits of an independent
onnxruntime session, the enrolled row by the documented imprinting rule, the look-alikes by the
documented enrollment rule):

detect, set detect, top-k (exact and index), KServe `<name>`, `<name>-full` (every logit's match and
Triton's classification), gallery class search; a second server on the same store (a replica) answers
the same; SLC_LOOKALIKES=off answers the plain rule. The probes are chosen so that the rule changes
answers: every check fails under the plain rule."""
from __future__ import annotations

import numpy as np
import pytest

from tests.serving.helpers import D, INPUT_DIM
from tests.serving.test_enroll import Extended, enroll, enrolled_lookalikes_truth, imprint, lookalikes_truth
from tests.serving.test_open_set import calibrated


@pytest.fixture
def claimed(offline, bundle):
    """(examples, probes): 4 inputs a trained class claims (the new class's examples), and 24 probes:
    the inputs the trained classes claim most (where a new class from those examples matches too), and
    unclaimed ones."""
    pool = np.random.default_rng(23).standard_normal((4000, INPUT_DIM)).astype(np.float32)
    margin = (offline.logits(pool) - calibrated(bundle)).max(axis=1)
    order = np.argsort(margin)
    return pool[order[-4:]], np.concatenate([pool[order[-20:]], pool[order[:4]]])


def made(client, offline, bundle, x: np.ndarray) -> tuple[Extended, np.ndarray, int]:
    """Enroll 'kappa' from x: (the offline truth with its look-alikes, thresholds [D + 1], its id)."""
    got = enroll(client, "kappa", x)
    assert got.status_code == 201, got.text
    got = got.json()
    thr = calibrated(bundle)
    want = lookalikes_truth(offline.embed(x).astype(np.float64) @ offline.W.T + offline.b, thr)
    assert got["lookalikes"] == sorted(want) and want
    ext = Extended(offline, [(got["class_id"], *imprint(offline, x))], {got["class_id"]: want})
    return ext, np.concatenate([thr, [bundle.global_threshold]]), got["class_id"]


def answers(client, bundle, x: np.ndarray, ids: list[int], threshold=None) -> dict[str, np.ndarray]:
    """Each route's `match` for inputs x [n] and classes ids, as [n, len(ids)] bool."""
    extra = {} if threshold is None else {"threshold": threshold}
    enrolled = sorted(c["class_id"] for c in client.get("/v1/classes").json()["classes"])  # served, in id order
    n, k, trained = len(x), bundle.num_classes + len(enrolled), bundle.num_classes
    column = [j if j < trained else trained + enrolled.index(j) for j in ids]  # <name>-full's: trained, then enrolled
    out = {"detect": np.array([[r["match"] for r in client.post(f"/v1/classes/{j}/detect", json={
        "inputs": x.tolist(), **extra}).json()["results"]] for j in ids]).T}
    got = client.post("/v1/detect", json={"inputs": x.tolist(), "classes": ids, **extra}).json()
    out["set detect"] = np.array([[e["match"] for e in row] for row in got["results"]])
    for mode in ("exact", "index"):
        rows = client.post("/v1/topk", json={"inputs": x.tolist(), "k": k, "mode": mode, **extra}).json()["results"]
        out[f"topk {mode}"] = np.array([[{e["class_id"]: e["match"] for e in row}[j] for j in ids] for row in rows])
    params = {"parameters": extra} if extra else {}
    single = np.zeros((n, len(ids)), bool)
    for c, j in enumerate(ids):
        body = {"inputs": [{"name": "input", "shape": [n, INPUT_DIM], "datatype": "FP32", "data": x.ravel().tolist()},
                           {"name": "class_id", "shape": [n], "datatype": "INT64", "data": [j] * n}], **params}
        r = client.post(f"/v2/models/{bundle.name}/infer", json=body).json()
        single[:, c] = {o["name"]: o for o in r["outputs"]}["match"]["data"]
    out["kserve single"] = single
    body = {"inputs": [{"name": "input", "shape": [n, INPUT_DIM], "datatype": "FP32", "data": x.ravel().tolist()}],
            "outputs": [{"name": "match"}], **params}
    r = client.post(f"/v2/models/{bundle.name}-full/infer", json=body).json()
    full = np.array(r["outputs"][0]["data"], dtype=bool).reshape(n, k)
    out["kserve full"] = full[:, column]
    body["outputs"] = [{"name": "logits", "parameters": {"classification": k}}, {"name": "match"}]
    r = {o["name"]: o for o in client.post(f"/v2/models/{bundle.name}-full/infer", json=body).json()["outputs"]}
    labels = np.array(r["logits"]["data"]).reshape(n, k)
    matches = np.array(r["match"]["data"], dtype=bool).reshape(n, k)
    out["kserve classification"] = np.array([[dict(zip((int(s.split(":")[1]) for s in lr), mr))[j] for j in ids]
                                             for lr, mr in zip(labels, matches)])
    return out


def searched(client, x: np.ndarray, ids: list[int], threshold=None) -> np.ndarray:
    """[n, len(ids)]: whether each gallery item x[i] is found by the class search of ids[c]."""
    items = [{"id": f"p{i}", "input": v.tolist()} for i, v in enumerate(x)]
    assert client.post("/v1/gallery/items", json={"items": items}).status_code == 201
    extra = {} if threshold is None else {"threshold": threshold}
    found = np.zeros((len(x), len(ids)), bool)
    for c, j in enumerate(ids):
        for hit in client.post(f"/v1/classes/{j}/search", json=extra).json()["results"]:
            found[int(hit["id"][1:]), c] = True
    return found


def test_every_route_decides_between_look_alikes_by_margin(client_factory, offline, bundle, claimed):
    """Each route equals the rule; the plain rule (z >= t alone) differs on these probes."""
    x, probes = claimed
    client = client_factory()
    ext, thr, kappa = made(client, offline, bundle, x)
    ids = [*sorted(ext.lookalikes[kappa]), kappa]
    cols = [ext.column(j) for j in ids]
    z = ext.logits(probes)
    for threshold in (None, float(np.median(z[:, cols]))):
        t = thr if threshold is None else np.full(len(thr), threshold)
        want, plain = ext.matches(z, t)[:, cols], (z >= t)[:, cols]
        assert (want != plain).any(), "the probes must be ones the rule decides differently"
        for route, got in answers(client, bundle, probes, ids, threshold).items():
            np.testing.assert_array_equal(got, want, err_msg=f"{route} (threshold {threshold})")
    np.testing.assert_array_equal(searched(client, probes, ids), ext.matches(z, thr)[:, cols], err_msg="search")
    every = ext.matches(z, thr)  # [n, D + 1]
    for mode in ("exact", "index"):  # a partial top-k with matches_only: the k best that match, as the rule says
        got = client.post("/v1/topk", json={"inputs": probes.tolist(), "k": 3, "mode": mode, "matches_only": True})
        for row, zi, mi in zip(got.json()["results"], z, every):
            best = ext.ids[np.argsort(-zi, kind="stable")[:3]]
            assert [e["class_id"] for e in row] == [int(c) for c in best if mi[ext.column(c)]], mode

    replica = client_factory()  # a second server on the same store: the same look-alikes, the same answers
    listed = {c["class_name"]: c for c in replica.get("/v1/classes").json()["classes"]}
    assert listed["kappa"]["lookalikes"] == sorted(ext.lookalikes[kappa])
    for route, got in answers(replica, bundle, probes, ids).items():
        np.testing.assert_array_equal(got, ext.matches(z, thr)[:, cols], err_msg=f"replica: {route}")


def test_enrolled_classes_are_look_alikes_of_each_other(client_factory, offline, bundle, claimed):
    """A second class enrolled from inputs close to the first's examples names the first (and its
    closest trained classes); between the two, every route answers by margin, a replica too. Deleting
    the first leaves the second with its trained look-alikes only."""
    x, probes = claimed
    client = client_factory()
    ext, thr, kappa = made(client, offline, bundle, x)
    y = x + 0.25 * np.random.default_rng(5).standard_normal(x.shape).astype(np.float32)
    got = enroll(client, "lam", y)
    assert got.status_code == 201, got.text
    got = got.json()
    lam = got["class_id"]
    want = enrolled_lookalikes_truth(ext.logits(y), thr, ext.ids, own=lam)
    assert kappa in want and got["lookalikes"] == sorted(want)
    assert kappa in {e["class_id"] for e in got["matched_by"]}  # kappa says yes to some of lam's examples
    names = [str(bundle.classes[j]) if j < len(bundle.classes) else "kappa" for j in got["lookalikes"]]
    assert got["lookalike_names"] == names  # each look-alike by name, trained or enrolled
    both = Extended(offline, [(kappa, *imprint(offline, x)), (lam, *imprint(offline, y))],
                    {kappa: ext.lookalikes[kappa], lam: want})
    thr2 = np.concatenate([thr, [bundle.global_threshold]])
    near = np.concatenate([x, y, x + 0.25 * np.random.default_rng(6).standard_normal(x.shape).astype(np.float32),
                           probes])
    z = both.logits(near)
    ids = sorted({*want, *ext.lookalikes[kappa], kappa, lam})
    cols = [both.column(j) for j in ids]
    pair = [both.column(kappa), both.column(lam)]
    assert (both.matches(z, thr2)[:, pair] != (z >= thr2)[:, pair]).any(), "the pair must change answers"
    for server in (client, client_factory()):  # the second: a replica on the same store
        for route, answer in answers(server, bundle, near, ids).items():
            np.testing.assert_array_equal(answer, both.matches(z, thr2)[:, cols], err_msg=route)
        np.testing.assert_array_equal(searched(server, near, ids), both.matches(z, thr2)[:, cols], err_msg="search")
        server.delete("/v1/gallery/items")  # the next search starts empty
    listed = {c["class_name"]: c["lookalikes"] for c in client.get("/v1/classes").json()["classes"]}
    assert listed == {"kappa": sorted({*ext.lookalikes[kappa], lam}), "lam": sorted(want)}  # symmetric
    assert client.delete(f"/v1/classes/{kappa}").status_code == 204
    listed = {c["class_name"]: c for c in client.get("/v1/classes").json()["classes"]}
    assert listed["lam"]["lookalikes"] == sorted(want - {kappa})
    alone = Extended(offline, [(lam, *imprint(offline, y))], {lam: want - {kappa}})
    ids = sorted({*want - {kappa}, lam})
    truth = alone.matches(alone.logits(near), thr)[:, [alone.column(j) for j in ids]]  # thr [D + 1]: lam's last
    for route, answer in answers(client, bundle, near, ids).items():
        np.testing.assert_array_equal(answer, truth, err_msg=f"after the delete: {route}")


def test_trained_pairs_only_leave_two_enrolled_classes_to_their_own_thresholds(client_factory, offline, bundle,
                                                                               claimed):
    """SLC_LOOKALIKES=trained: the enrolled pair is stored and listed, and every route decides it by each
    class's own threshold; the pairs with trained classes still decide by margin."""
    x, probes = claimed
    client = client_factory(lookalikes="trained")
    ext, thr, kappa = made(client, offline, bundle, x)
    y = x + 0.25 * np.random.default_rng(5).standard_normal(x.shape).astype(np.float32)
    got = enroll(client, "lam", y).json()
    lam = got["class_id"]
    want = enrolled_lookalikes_truth(ext.logits(y), thr, ext.ids, own=lam)
    assert kappa in want and got["lookalikes"] == sorted(want)
    rows = [(kappa, *imprint(offline, x)), (lam, *imprint(offline, y))]
    served = Extended(offline, rows, {kappa: ext.lookalikes[kappa], lam: want - {kappa}})
    paired = Extended(offline, rows, {kappa: ext.lookalikes[kappa], lam: want})
    thr2 = np.concatenate([thr, [bundle.global_threshold]])
    near = np.concatenate([x, y, probes])
    z = served.logits(near)
    ids = sorted({*want, *ext.lookalikes[kappa], kappa, lam})
    cols = [served.column(j) for j in ids]
    assert (served.matches(z, thr2)[:, cols] != paired.matches(z, thr2)[:, cols]).any()
    for route, answer in answers(client, bundle, near, ids).items():
        np.testing.assert_array_equal(answer, served.matches(z, thr2)[:, cols], err_msg=route)


def test_off_answers_the_plain_rule(client_factory, offline, bundle, claimed):
    """SLC_LOOKALIKES=off: the look-alikes are stored and listed, every route answers z >= t alone."""
    x, probes = claimed
    client = client_factory(lookalikes="off")
    ext, thr, kappa = made(client, offline, bundle, x)
    ids = [*sorted(ext.lookalikes[kappa]), kappa]
    cols = [ext.column(j) for j in ids]
    z = ext.logits(probes)
    plain = (z >= thr)[:, cols]
    assert (ext.matches(z, thr)[:, cols] != plain).any()
    for route, got in answers(client, bundle, probes, ids).items():
        np.testing.assert_array_equal(got, plain, err_msg=route)
    np.testing.assert_array_equal(searched(client, probes, ids), plain, err_msg="search")


def test_adding_examples_keeps_the_look_alikes_and_adds_the_new_ones(client, offline, bundle, claimed):
    """POST .../examples: the stored look-alikes are the union of the first examples' and the added ones'."""
    x, probes = claimed
    ext, _, kappa = made(client, offline, bundle, x[:2])
    more = probes[-4:]  # unclaimed inputs: their closest trained classes are look-alikes all the same
    r = client.post("/v1/classes/kappa/examples", json={"inputs": more.tolist()})
    assert r.status_code == 200, r.text
    added = lookalikes_truth(offline.embed(more).astype(np.float64) @ offline.W.T + offline.b, calibrated(bundle))
    assert r.json()["lookalikes"] == sorted(ext.lookalikes[kappa] | added)
    assert r.json()["lookalike_names"] == [str(bundle.classes[j]) for j in r.json()["lookalikes"]]
    assert added - ext.lookalikes[kappa], "the added examples must bring a look-alike of their own"


@pytest.mark.integration
def test_a_folded_bundle_answers_as_the_server_did(bundle_path, tmp_path, offline, bundle, claimed):
    """`slc bundle fold` carries the look-alikes into calibration.json: the folded bundle, where kappa is
    trained class D, answers every route as the server with the enrolled kappa did (and a fold that
    dropped the pairs would not: the probes are decided differently by the plain rule)."""
    from tests.serving.helpers import slc
    from tests.serving.test_enroll_fold import _client

    x, probes = claimed
    server = _client(bundle_path, tmp_path / "served")
    try:
        ext, thr, kappa = made(server, offline, bundle, x)
        ids = [*sorted(ext.lookalikes[kappa]), kappa]
        before = answers(server, bundle, probes, ids)
    finally:
        server.__exit__(None, None, None)
    z, cols = ext.logits(probes), [ext.column(j) for j in ids]
    assert (ext.matches(z, thr)[:, cols] != (z >= thr)[:, cols]).any()
    out = tmp_path / "folded"
    assert slc("bundle", "fold", bundle_path, "--from", tmp_path / "served" / "data", "--out", out) == 0
    from serving.bundle import load_bundle

    folded = load_bundle(out)
    assert folded.calibration["lookalikes"]["pairs"] == [[t, D] for t in sorted(ext.lookalikes[kappa])]
    client = _client(out, tmp_path / "fresh")
    try:
        after = answers(client, folded, probes, [*sorted(ext.lookalikes[kappa]), D])
    finally:
        client.__exit__(None, None, None)
    assert after.keys() == before.keys()
    for route in before:  # D + 1 classes either way: kappa enrolled as D there, trained as D here
        np.testing.assert_array_equal(after[route], before[route], err_msg=route)


@pytest.mark.integration
def test_a_near_tie_is_decided_alike_by_every_route(bundle_path, tmp_path, offline, bundle):
    """A pair whose rows differ by one float32 step in each value (a folded class D beside trained class
    3, one threshold for all): their logits tie in float32, not in float64. Every route decides the pair
    as the float64 margins say (the pass's float32 logits never decide it), the gallery search too."""
    from dataclasses import replace as replaced

    from serving.bundle import load_bundle
    from serving.bundle.class_row import ClassRow
    from serving.bundle.fold import fold_bundle
    from tests.serving.test_enroll_fold import _client

    c = 3
    w = np.asarray(bundle.weight[c], dtype=np.float32)
    up = np.arange(len(w)) % 2 == 0  # one step up on half the values, down on the others: either may lead
    twin = np.where(up, np.nextafter(w, np.float32(np.inf)), np.nextafter(w, np.float32(-np.inf))).astype(np.float32)
    row = ClassRow(row=twin, bias=float(bundle.bias[c]), threshold=float(bundle.thresholds[c]),
                   platt_a=1.0, platt_b=0.0, examples=1, rule="test", name="twin", slot=0, lookalikes=(c,))
    folded = load_bundle(fold_bundle(bundle_path, [replaced(row)], tmp_path / "twin"))
    probes = np.random.default_rng(3).standard_normal((40, INPUT_DIM)).astype(np.float32)
    h = offline.embed(probes).astype(np.float64)
    z = h @ np.stack([w, row.row]).astype(np.float64).T + float(bundle.bias[c])  # [n, 2]: c, D
    threshold = float(np.median(z))
    m = z - threshold
    want = np.stack([(m[:, 0] >= 0) & (m[:, 0] >= m[:, 1]), (m[:, 1] >= 0) & (m[:, 1] >= m[:, 0])], axis=1)
    assert want[:, 0].any() and want[:, 1].any() and (m[:, 0] >= 0).sum() > want[:, 0].sum()  # both sides occur
    assert (z[:, 0].astype(np.float32) == z[:, 1].astype(np.float32)).any()  # float32 ties where float64 does not
    client = _client(folded.path, tmp_path / "served")
    try:
        for route, got in answers(client, folded, probes, [c, D], threshold).items():
            np.testing.assert_array_equal(got, want, err_msg=route)
        np.testing.assert_array_equal(searched(client, probes, [c, D], threshold), want, err_msg="search")
    finally:
        client.__exit__(None, None, None)
