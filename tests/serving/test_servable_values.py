"""Issue 48, part 4: every name and number the server keeps is one it can serve, by one rule shared by
the server and `slc bundle fold` (serving/bundle/names.py, serving/bundle/calibration.py).

The truth each test holds the answers to is outside the code under test: Unicode's own categories
(unicodedata) for the refused characters, the bytes of the request path for UTF-8, numpy's float32 for
what overflows, the offline logits (tests/serving/helpers.py Offline) for what detect must still
answer after a refused reload, and the file system for what fold must not have written."""
from __future__ import annotations

import json
import shutil
import sqlite3
import unicodedata
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest

from tests.serving.helpers import D, INPUT_DIM, assert_envelope, make_settings, slc

KEY = "admin-key"
AUTH = {"x-api-key": KEY}
X = np.random.default_rng(3).standard_normal((2, INPUT_DIM)).astype(np.float32).tolist()

# (character, what Unicode calls it): C0, DEL, C1 (U+0085 NEL among them), the separators, a bidi override
REFUSED = ["\x00", "\x1f", "\x7f", "\x85", "\x9f", "\u2028", "\u2029", "\u202e", "\u2066"]
ALLOWED = ["\u00e9", "\u00a0", "\u200d", "\ufffd", "\u4e2d"]  # é, NBSP, ZWJ, a real U+FFFD, a CJK character


def _path(name: str) -> str:
    """The name's UTF-8 bytes percent-encoded into a path segment (as a client must send it)."""
    return quote(name.encode("utf-8"), safe="")


def _class_routes(client, segment: str) -> list:
    """Every route that takes a class in its path, with a valid body each."""
    return [client.post(f"/v1/classes/{segment}/detect", json={"inputs": X}),
            client.post(f"/v1/classes/{segment}/softmax", json={"inputs": X}),
            client.post(f"/v1/classes/{segment}/search", json={}),
            client.delete(f"/v1/classes/{segment}")]


@pytest.mark.parametrize("ch", REFUSED, ids=[f"U+{ord(c):04X}" for c in REFUSED])
def test_a_name_with_a_control_or_separator_character_is_422_on_put_and_on_every_class_route(client, ch):
    assert unicodedata.category(ch) in ("Cc", "Zl", "Zp", "Cf")  # the truth: Unicode's category
    segment = _path(f"a{ch}b")
    body = assert_envelope(client.put(f"/v1/classes/{segment}", json={"inputs": X}), 422, "invalid_class_name")
    assert f"U+{ord(ch):04X}" in body["error"]["message"]
    for r in _class_routes(client, segment):
        assert_envelope(r, 422, "invalid_class_name")
    assert client.get("/v1/classes").json()["count"] == 0  # nothing kept


def test_names_the_rule_allows_are_enrolled_and_answer(client):
    for i, ch in enumerate(ALLOWED):
        name = f"n{i}{ch}x"
        r = client.put(f"/v1/classes/{_path(name)}", json={"inputs": X})
        assert r.status_code == 201, r.text
        assert r.json()["class_name"] == name
        assert client.post(f"/v1/classes/{_path(name)}/detect", json={"inputs": X}).json()["class_name"] == name


def test_invalid_utf8_is_422_and_never_the_same_class_as_another(client):
    """a%FFb and a%FEb both decode to "a\\ufffdb" with errors='replace': without the raw path, two
    names (and a real U+FFFD) would be one class."""
    for raw in (b"a\xffb", b"a\xfeb"):
        with pytest.raises(UnicodeDecodeError):
            raw.decode("utf-8")  # the truth: these bytes are not UTF-8
    assert_envelope(client.put("/v1/classes/a%FFb", json={"inputs": X}), 422, "invalid_class_name")
    assert_envelope(client.put("/v1/classes/a%FEb", json={"inputs": X}), 422, "invalid_class_name")
    assert client.get("/v1/classes").json()["count"] == 0
    real = client.put(f"/v1/classes/{_path('a' + chr(0xFFFD) + 'b')}", json={"inputs": X})  # %EF%BF%BD: valid
    assert real.status_code == 201 and real.json()["class_name"] == "a\ufffdb"
    for segment in ("a%FFb", "a%FEb"):  # never answered as the U+FFFD class
        for r in _class_routes(client, segment):
            assert_envelope(r, 422, "invalid_class_name")
    assert [c["class_name"] for c in client.get("/v1/classes").json()["classes"]] == ["a\ufffdb"]


@pytest.mark.parametrize("method, path", [("PUT", "/v1/classes/"), ("DELETE", "/v1/classes/"),
                                          ("POST", "/v1/classes//detect"), ("POST", "/v1/classes//softmax"),
                                          ("POST", "/v1/classes//search")])
def test_an_empty_name_is_the_envelope_never_a_redirect(client, method, path):
    r = client.request(method, path, json={"inputs": X}, follow_redirects=False)
    assert "location" not in r.headers
    assert "empty" in assert_envelope(r, 422, "invalid_class_name")["error"]["message"]


def test_a_trailing_slash_is_404_not_a_redirect_to_the_host_header(client):
    r = client.get("/v1/model/", headers={"host": "evil.example"}, follow_redirects=False)
    assert "location" not in r.headers
    assert_envelope(r, 404, "not_found")


def test_under_uvicorn_the_raw_path_tells_invalid_utf8_and_empty_names(live_server):
    """The same over a real socket: uvicorn's scope carries raw_path, and no route redirects."""
    import httpx

    url = live_server()
    with httpx.Client(base_url=url, timeout=30) as c:
        assert_envelope(c.put("/v1/classes/a%FFb", json={"inputs": X}), 422, "invalid_class_name")
        assert_envelope(c.post("/v1/classes/a%C2%85b/detect", json={"inputs": X}), 422, "invalid_class_name")
        r = c.put("/v1/classes/", json={"inputs": X}, headers={"host": "evil.example"})
        assert "location" not in r.headers
        assert_envelope(r, 422, "invalid_class_name")


# ------------------------------------------------------------------ numbers: calibration reload
def _write_calibration(folder: Path, cal: dict) -> None:
    """calibration.json and a manifest that lists it, written without any check (as a hand edit or
    another tool would): the server's reload is what must refuse it."""
    from serving.bundle.format import write_manifest

    (folder / "calibration.json").write_text(json.dumps(cal))
    write_manifest(folder, json.loads((folder / "manifest.json").read_text()))


@pytest.mark.parametrize("field, value, says", [
    ("threshold", 1e300, "per_class[7]: threshold 1e+300"), ("threshold", -3.5e38, "per_class[7]: threshold"),
    ("threshold", 3.4028236e38, "per_class[7]: threshold"),  # just past float32's largest: rounds to inf
    ("a", 1e39, "per_class[7]: platt a"), ("b", -1e308, "per_class[7]: platt b"),
    ("global", 1e300, "'global'")])
def test_a_reloaded_number_beyond_float32_is_409_and_the_old_thresholds_still_answer(
        bundle_path, tmp_path, client_factory, offline, inputs, field, value, says):
    folder = Path(shutil.copytree(bundle_path, tmp_path / "served"))
    with np.errstate(over="ignore"):
        assert np.isinf(np.float32(value))  # the truth: numpy's float32 of it
    client = client_factory(bundle=folder, api_key=KEY)
    before = client.post("/v1/classes/7/detect", json={"inputs": inputs.tolist()}).json()
    served_sha = client.get("/v1/model").json()["calibration"]["sha256"]
    cal = json.loads((folder / "calibration.json").read_text())
    for e in cal["per_class"]:
        e["threshold"] -= 1.0  # a change every class would see, were it swapped in
    if field == "global":
        cal["global"]["threshold"] = value
    elif field == "threshold":
        cal["per_class"][7]["threshold"] = value
    else:
        cal["per_class"][7]["platt"][field] = value
    _write_calibration(folder, cal)
    body = assert_envelope(client.post("/v1/admin/reload-calibration", headers=AUTH), 409, "calibration_invalid")
    assert says in body["error"]["message"] and "float32" in body["error"]["message"], body
    assert client.get("/v1/model").json()["calibration"]["sha256"] == served_sha
    after = client.post("/v1/classes/7/detect", json={"inputs": inputs.tolist()}).json()
    assert after == before
    z = offline.logits(inputs)[:, 7]
    assert [r["match"] for r in after["results"]] == (z >= after["threshold"]).tolist()
    for j in (0, D - 1):  # the other classes kept their thresholds too
        got = client.post(f"/v1/classes/{j}/detect", json={"inputs": inputs.tolist()}).json()["threshold"]
        assert got == pytest.approx(float(np.float32(json.loads((bundle_path / "calibration.json").read_text())
                                                      ["per_class"][j]["threshold"])))


def test_verify_and_recalibration_apply_the_same_rule(bundle_path, tmp_path):
    from serving.bundle.recalibration import RecalibrationError, write_recalibrated
    from serving.bundle.verify import verify_bundle

    folder = Path(shutil.copytree(bundle_path, tmp_path / "b"))
    cal = json.loads((folder / "calibration.json").read_text())
    cal["per_class"][3]["platt"]["a"] = 1e308
    with pytest.raises(RecalibrationError, match=r"per_class\[3\]"):
        write_recalibrated(folder, cal, tmp_path / "out", {"by": "test"})
    assert not (tmp_path / "out").exists()
    _write_calibration(folder, cal)
    assert any("per_class[3]" in p and "float32" in p for p in verify_bundle(folder))


# ------------------------------------------------------------------ fold, and a store a server replays
def _store(tmp_path: Path, bundle, offline, bad: dict) -> Path:
    """A data directory whose store holds `good` (slot 0) and `bad` (slot 1), the latter's columns then
    set to `bad` straight in SQLite (an older writer, a hand edit: nothing the server's PUT lets in)."""
    from serving.gallery import DB_NAME
    from serving.gallery.enrolled import SqliteEnrolledStore

    data = tmp_path / "data"
    store = SqliteEnrolledStore(data, bundle.digest)
    try:
        for i, name in enumerate(("good", "bad")):
            store.put(name, offline.W[i].astype(np.float32), 0.1, 0.5, 2.0, -1.0, 3, "imprint+global", limit=10)
    finally:
        store.close()
    db = sqlite3.connect(data / DB_NAME)
    try:
        with db:
            db.execute(f"UPDATE enrolled_classes SET {', '.join(f'{k} = ?' for k in bad)} WHERE slot = 1",
                       tuple(bad.values()))
    finally:
        db.close()
    return data


BAD_ROWS = [({"name": "a/b"}, "'a/b'", "'/'"), ({"name": "a\x85b"}, "'a\\x85b'", "U+0085"),
            ({"platt_a": 1e308}, "'bad'", "platt_a"), ({"threshold": -1e39}, "'bad'", "threshold"),
            ({"bias": 4e38}, "'bad'", "bias")]


@pytest.mark.parametrize("bad, shown, what", BAD_ROWS, ids=["slash", "nel", "platt_a", "threshold", "bias"])
def test_fold_names_the_row_it_would_not_serve_in_one_line_and_writes_nothing(
        bundle, offline, tmp_path, capsys, bad, shown, what):
    data = _store(tmp_path, bundle, offline, bad)
    out = tmp_path / "folded"
    capsys.readouterr()
    assert slc("bundle", "fold", bundle.path, "--from", data, "--out", out) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert shown in err and what in err and "slot 1" in err
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # no staging folder left either


def test_a_server_replaying_the_store_ignores_a_row_it_could_not_serve(bundle, offline, tmp_path):
    from fastapi.testclient import TestClient

    from serving.main import build
    from tests.serving.helpers import wait_ready

    data = _store(tmp_path, bundle, offline, {"platt_a": 1e308})
    settings = make_settings(bundle.path, tmp_path, data_dir=data)
    with TestClient(build(settings)[0], raise_server_exceptions=False) as client:
        wait_ready(client.get)
        assert [c["class_name"] for c in client.get("/v1/classes").json()["classes"]] == ["good"]
        assert_envelope(client.post("/v1/classes/bad/detect", json={"inputs": X}), 404, "unknown_class")


def test_the_rules_in_one_place():
    """The server's PUT and fold use one function for names and one for numbers."""
    from serving.bundle import fold, names
    from serving.bundle.calibration import float32_finite, is_number
    from serving.core import enrollment

    assert enrollment.class_name_problem is names.class_name_problem
    assert fold.enrolled_class_problem is names.enrolled_class_problem
    f32max = float(np.finfo(np.float32).max)
    assert is_number(f32max) and not is_number(np.nextafter(f32max, np.inf)) and not is_number(True)
    assert float32_finite([1.0, -f32max, 3.5e38, np.nan]).tolist() == [True, True, False, False]
