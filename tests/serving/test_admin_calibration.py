"""POST /v1/admin/reload-calibration (docs/api.md): the calibration a bundle folder holds after a
recalibration in place (serving/bundle/recalibration.py, as `slc calibrate --in-place` writes it) is
checked and swapped in whole. Checked against independent truth: the offline logits of the synthetic
bundle (its own onnxruntime session, the head in float64) against the thresholds read back from the
written calibration.json; the key and body rules give the envelope; a folder whose calibration does
not match its manifest, or that holds another model, is refused and nothing changes; concurrent
detects each decide with one whole calibration, old or new."""
from __future__ import annotations

import hashlib
import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from serving.bundle.recalibration import write_recalibrated
from tests.serving.helpers import INPUT_DIM, D, assert_envelope

KEY = "admin-key"
ROUTE = "/v1/admin/reload-calibration"
AUTH = {"x-api-key": KEY}


@pytest.fixture
def folder(bundle_path, tmp_path) -> Path:
    """A copy of the synthetic bundle, to be recalibrated in place."""
    return Path(shutil.copytree(bundle_path, tmp_path / "served"))


def recalibrated(folder: Path, shift: float, slope: float = 1.0) -> dict:
    """Write the folder's calibration with every threshold moved by `shift` and every Platt slope
    scaled by `slope`, in place (as slc calibrate --in-place); returns what was written."""
    cal = json.loads((folder / "calibration.json").read_text())
    for e in cal["per_class"]:
        e["threshold"] += shift
        e["platt"]["a"] *= slope
    write_recalibrated(folder, cal, folder, {"by": "test", "shift": shift})
    return json.loads((folder / "calibration.json").read_text())


def thresholds(cal: dict) -> np.ndarray:
    """[D] as the server keeps them (float32)."""
    return np.array([e["threshold"] for e in cal["per_class"]], dtype=np.float32)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_folders_calibration_is_swapped_in_and_detect_decides_with_it(folder, client_factory, offline, inputs):
    client = client_factory(bundle=folder, api_key=KEY)
    z = offline.logits(inputs)  # [n, D] float64: the truth, independent of the server
    before = client.post("/v1/classes/7/detect", json={"inputs": inputs.tolist()}).json()
    old_sha = sha(folder / "calibration.json")
    # thresholds that split these inputs: each class's median logit over them
    cal = json.loads((folder / "calibration.json").read_text())
    for j, e in enumerate(cal["per_class"]):
        e["threshold"] = float(np.median(z[:, j]))
    write_recalibrated(folder, cal, folder, {"by": "test"})
    new = thresholds(json.loads((folder / "calibration.json").read_text()))
    assert client.post("/v1/classes/7/detect", json={"inputs": inputs.tolist()}).json() == before  # not yet
    r = client.post(ROUTE, headers=AUTH)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["reloaded"] is True and answer["classes_changed"] == D
    assert answer["calibration_sha256"] == sha(folder / "calibration.json") and answer["previous_sha256"] == old_sha
    assert answer["digest"] == sha(folder / "manifest.json")
    for j in (0, 7, D - 1):
        got = client.post(f"/v1/classes/{j}/detect", json={"inputs": inputs.tolist()}).json()
        assert got["threshold"] == float(new[j])
        assert [res["match"] for res in got["results"]] == (z[:, j] >= float(new[j])).tolist()
    info = client.get("/v1/model").json()
    assert info["digest"] == answer["digest"] and info["calibration"]["sha256"] == answer["calibration_sha256"]
    again = client.post(ROUTE, headers=AUTH, json={"expect_sha256": answer["calibration_sha256"]})
    assert again.status_code == 200 and again.json()["reloaded"] is False


@pytest.mark.parametrize("headers, body, status, code", [
    ({}, None, 401, "unauthorized"),
    ({"x-api-key": "wrong"}, None, 401, "unauthorized"),
    (AUTH, b"{", 400, "malformed_json"),
    (AUTH, b"[1]", 422, "validation_error"),
    (AUTH, b'{"reload": true}', 422, "validation_error"),
    (AUTH, b'{"expect_sha256": "abc"}', 422, "validation_error"),
    (AUTH, b'{"expect_sha256": 5}', 422, "validation_error"),
    ({**AUTH, "content-type": "text/plain"}, b"{}", 415, "unsupported_media_type"),
])
def test_a_refused_reload_is_the_envelope_and_changes_nothing(folder, client_factory, headers, body, status, code):
    client = client_factory(bundle=folder, api_key=KEY)
    recalibrated(folder, shift=1.0)
    kwargs = {} if body is None else {"content": body, "headers": {"content-type": "application/json", **headers}}
    assert_envelope(client.post(ROUTE, **({"headers": headers} if body is None else kwargs)), status, code)
    assert client.get("/v1/model").json()["calibration"]["sha256"] == json.loads(
        (folder / "manifest.json").read_text())["files"]["calibration.previous.json"]["sha256"]


def test_without_a_key_on_a_reachable_host_the_reload_is_refused(folder, client_factory):
    client = client_factory(bundle=folder, host="0.0.0.0")
    assert_envelope(client.post(ROUTE), 403, "writes_need_api_key")


def test_a_folder_that_does_not_match_is_refused_and_the_served_calibration_stays(folder, client_factory, inputs):
    client = client_factory(bundle=folder, api_key=KEY)
    served = client.post("/v1/classes/3/detect", json={"inputs": inputs.tolist()}).json()
    recalibrated(folder, shift=2.0)
    assert_envelope(client.post(ROUTE, headers=AUTH, json={"expect_sha256": "0" * 64}), 409, "calibration_unexpected")
    text = (folder / "calibration.json").read_text()
    (folder / "calibration.json").write_text(text.replace('"threshold": ', '"threshold": 1', 1))  # hash now wrong
    assert_envelope(client.post(ROUTE, headers=AUTH), 409, "calibration_invalid")
    from serving.bundle.synthetic import build_synthetic_bundle

    shutil.rmtree(folder)
    build_synthetic_bundle(classes=D, dim=16, input_dim=INPUT_DIM, seed=1, out=folder)  # another model, same shapes
    assert_envelope(client.post(ROUTE, headers=AUTH), 409, "bundle_changed")
    assert client.post("/v1/classes/3/detect", json={"inputs": inputs.tolist()}).json() == served


@pytest.mark.integration
def test_concurrent_detects_each_decide_with_one_whole_calibration(folder, app_factory, offline, inputs):
    """Two calibrations A and B (thresholds and Platt slopes differ) written and reloaded in turn while
    detects run: every answer's threshold, matches and probabilities belong to A alone or B alone."""
    import httpx

    from tests.serving.helpers import uvicorn_in_thread

    cal_a = json.loads((folder / "calibration.json").read_text())
    cal_b = recalibrated(folder, shift=0.5, slope=2.0)
    z = offline.logits(inputs)  # [n, D]
    truth = {name: (thresholds(c), np.array([[e["platt"]["a"], e["platt"]["b"]] for e in c["per_class"]], np.float32))
             for name, c in (("A", cal_a), ("B", cal_b))}
    answers, stop = [], threading.Event()

    def query(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with httpx.Client(base_url=url, timeout=30) as c:
            while not stop.is_set():
                j = int(rng.integers(D))
                answers.append((j, c.post(f"/v1/classes/{j}/detect", json={"inputs": inputs.tolist()}).json()))

    with uvicorn_in_thread(app_factory(bundle=folder, api_key=KEY)) as url:
        readers = [threading.Thread(target=query, args=(s,)) for s in range(3)]
        for t in readers:
            t.start()
        with httpx.Client(base_url=url, timeout=30) as admin:
            for k in range(8):
                write_recalibrated(folder, cal_a if k % 2 == 0 else cal_b, folder, {"by": "test", "turn": k})
                assert admin.post(ROUTE, headers=AUTH).status_code == 200
        stop.set()
        for t in readers:
            t.join()
    assert answers
    for j, got in answers:
        which = [name for name, (t, _) in truth.items() if got["threshold"] == float(t[j])]
        assert len(which) == 1, (j, got["threshold"])
        t, platt = truth[which[0]]
        a, b = (float(v) for v in platt[j])
        for res, zj in zip(got["results"], z[:, j]):
            assert res["match"] == (res["logit"] >= got["threshold"])
            assert res["logit"] == pytest.approx(zj, rel=1e-5, abs=1e-5)
            assert res["probability"] == pytest.approx(1 / (1 + np.exp(-(a * res["logit"] + b))), rel=1e-6, abs=1e-12)
