"""Many class-sets on one server (issue 51): two bundles with one shared backbone answering their own
classes, checked against each bundle's own offline math; the KServe v2 repository extension loading
and unloading a bundle under a running load with no failed request; a bundle that fails verification
refused in one line while the others are served."""
from __future__ import annotations

import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.serving.helpers import DIM, INPUT_DIM, Offline, assert_envelope, make_settings, uvicorn_in_thread, wait_ready

SHARED_BACKBONE = 9  # backbone seed of the bundles that share one backbone graph


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict[str, Path]:
    """alpha (D=40) and beta (D=30): one backbone graph, heads of their own; gamma: another backbone."""
    from serving.bundle.synthetic import build_synthetic_bundle

    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, classes, seed, backbone in (("alpha", 40, 1, SHARED_BACKBONE), ("beta", 30, 2, SHARED_BACKBONE),
                                          ("gamma", 20, 3, None)):
        out[name] = build_synthetic_bundle(classes=classes, dim=DIM, input_dim=INPUT_DIM, seed=seed,
                                           out=root / name, backbone_seed=backbone)
    return out


@pytest.fixture(scope="module")
def offline(bundles) -> dict[str, Offline]:
    from serving.bundle import load_bundle

    return {name: Offline(load_bundle(path)) for name, path in bundles.items()}


def _x(n: int = 4, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, INPUT_DIM)).astype(np.float32)


def _check_detect(answer: dict, truth: Offline, j: int, x: np.ndarray) -> None:
    z = truth.logits(x)[:, j]
    thr = answer["threshold"]
    got = np.array([r["logit"] for r in answer["results"]])
    np.testing.assert_allclose(got, z, rtol=1e-4, atol=1e-4)
    assert [r["match"] for r in answer["results"]] == [bool(v >= thr) for v in got]


def test_two_bundles_with_one_shared_backbone_answer_their_own_classes(bundles, offline, tmp_path):
    from fastapi.testclient import TestClient

    from serving.main import build

    app = build(make_settings(bundles["alpha"], tmp_path, bundles=[f"beta={bundles['beta']}"]))[0]
    x = _x()
    with TestClient(app, raise_server_exceptions=False) as client:
        wait_ready(client.get)
        listing = client.get("/v1/models").json()
        alpha_name = offline["alpha"].bundle.name
        assert listing["default"] == alpha_name
        by_name = {m["name"]: m for m in listing["models"]}
        assert set(by_name) == {alpha_name, "beta"}
        assert by_name["beta"]["classes"]["trained"] == 30 and by_name[alpha_name]["classes"]["trained"] == 40
        assert by_name["beta"]["backbone"]["sha256"] == by_name[alpha_name]["backbone"]["sha256"]
        assert by_name["beta"]["backbone"]["shared_with"] == [alpha_name]
        assert by_name["beta"]["memory"]["head_bytes"] == 30 * (DIM + 1) * 4
        assert len(app.state.slc.models.groups) == 1  # one backbone session and batch lane for both

        # today's routes: the default model; /v1/models/beta/…: beta's head, classes and thresholds
        _check_detect(client.post("/v1/classes/7/detect", json={"inputs": x.tolist()}).json(), offline["alpha"], 7, x)
        _check_detect(client.post("/v1/models/beta/classes/7/detect", json={"inputs": x.tolist()}).json(),
                      offline["beta"], 7, x)
        _check_detect(client.post(f"/v1/models/{alpha_name}/classes/35/detect", json={"inputs": x.tolist()}).json(),
                      offline["alpha"], 35, x)
        assert_envelope(client.post("/v1/models/beta/classes/35/detect", json={"inputs": x.tolist()}), 404,
                        "unknown_class")  # beta has 30 classes
        for name, truth in (("beta", offline["beta"]), (alpha_name, offline["alpha"])):
            top = client.post(f"/v1/models/{name}/topk", json={"inputs": x.tolist(), "k": 3}).json()
            want = np.argsort(-truth.logits(x), axis=1, kind="stable")[:, :3]
            assert [[e["class_id"] for e in row] for row in top["results"]] == want.tolist()
        # KServe v2: each model under its name, its single logit per (input, class id)
        ids = np.array([0, 5, 29, 3])
        body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()},
                           {"name": "class_id", "shape": [4], "datatype": "INT64", "data": ids.tolist()}]}
        out = client.post("/v2/models/beta/infer", json=body).json()["outputs"]
        logit = next(o for o in out if o["name"] == "logit")["data"]
        np.testing.assert_allclose(logit, offline["beta"].logits(x)[np.arange(4), ids], rtol=1e-4, atol=1e-4)
        assert client.get("/v1/models/beta/model").json()["num_classes"] == 30
        assert_envelope(client.post("/v1/models/nope/topk", json={"inputs": x.tolist()}), 404, "unknown_model")
        # enrolled classes are each model's own: one enrolled into beta is not alpha's
        r = client.put("/v1/models/beta/classes/newcomer", json={"inputs": _x(2, seed=3).tolist()})
        assert r.status_code == 201, r.text
        assert r.json()["class_id"] == 30  # beta's D + slot 0
        assert [c["class_name"] for c in client.get("/v1/models/beta/classes").json()["classes"]] == ["newcomer"]
        assert client.get("/v1/classes").json()["count"] == 0
        assert_envelope(client.post("/v1/classes/newcomer/detect", json={"inputs": x.tolist()}), 404, "unknown_class")
        assert client.post("/v1/models/beta/classes/newcomer/detect", json={"inputs": x.tolist()}).status_code == 200
        metrics = client.get("/metrics").text
        assert 'slc_model_requests_total{endpoint="/v1/classes/{class}/detect",model="beta",status="200"} 2.0' in metrics
        assert 'slc_model_loaded{model="beta"} 1.0' in metrics


def test_mixed_batches_over_the_shared_backbone_answer_each_model(bundles, offline, tmp_path):
    """Requests to the two models coalesce into batches of one backbone call; each answer is its model's."""
    from serving.main import build

    settings = make_settings(bundles["alpha"], tmp_path, bundles=[f"beta={bundles['beta']}"], max_delay_ms=50,
                             adaptive_delay=False)
    app = build(settings)[0]
    with uvicorn_in_thread(app) as url:
        (group,) = app.state.slc.models.groups.values()
        compute, owners = group.batcher.compute, []

        def recording(jobs, shared=False):  # how many models each batch's one backbone call served
            owners.append(len({id(job.owner) for job in jobs}))
            return compute(jobs, shared)

        group.batcher.compute = recording

        def ask(i: int):
            truth = offline["beta"] if i % 2 else offline["alpha"]
            x = _x(2, seed=i)
            prefix = "/v1/models/beta" if i % 2 else "/v1"
            r = httpx.post(f"{url}{prefix}/classes/{i % 20}/detect", json={"inputs": x.tolist()}, timeout=30)
            assert r.status_code == 200, r.text
            _check_detect(r.json(), truth, i % 20, x)
            return True

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(ask, range(32)))
        assert max(owners) == 2  # batches held requests of both models: one backbone call, each model's head


def _corrupt(folder: Path) -> None:
    """A bundle whose head no longer matches its manifest's hash (slc verify fails)."""
    with open(folder / "head_bias.npy", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x00\x00\x80\x7f")


def _repository_server(bundles: dict, tmp_path: Path):
    """(a model repository holding alpha and beta, a server app over it with an API key, the key's header)."""
    from serving.main import build

    repo = tmp_path / "repository"
    repo.mkdir()
    for name in ("alpha", "beta"):
        shutil.copytree(bundles[name], repo / name)
    app = build(make_settings(None, tmp_path, model_repository=repo, api_key="k" * 32))[0]
    return repo, app, {"Authorization": "Bearer " + "k" * 32}


def test_load_and_unload_under_a_running_load_test_with_no_failed_request(bundles, offline, tmp_path):
    repo, app, key = _repository_server(bundles, tmp_path)
    with uvicorn_in_thread(app) as url:
        assert {m["name"] for m in httpx.get(f"{url}/v1/models").json()["models"]} == {"alpha", "beta"}
        stop, failures, answered = threading.Event(), [], [0]

        def judge(truth: Offline):
            def check(x: np.ndarray, j: int, answer: dict) -> None:
                _check_detect(answer, truth, j, x)
                answered[0] += 1
            return check

        workers = [threading.Thread(target=_load_test, args=(url, prefix, seed, stop, failures, judge(truth)),
                                    daemon=True) for prefix, truth, seed in
                   (("/v1", offline["alpha"], 0), ("/v1/models/beta", offline["beta"], 10_000),
                    ("/v1/models/alpha", offline["alpha"], 20_000), ("/v1/models/beta", offline["beta"], 30_000))]
        for w in workers:
            w.start()
        try:
            _repository_calls(url, key, repo, bundles, offline)
        finally:
            stop.set()
            for w in workers:
                w.join(timeout=30)
        assert failures == [] and answered[0] > 0


def _load_test(url: str, prefix: str, seed: int, stop: threading.Event, failures: list, check) -> None:
    """One client asking `prefix`'s detect of class i % 20 for a new input until `stop`: every answer
    not 200 into `failures`, every 200 to check(x, class, answer)."""
    with httpx.Client(base_url=url, timeout=30) as c:
        i = 0
        while not stop.is_set():
            x = _x(1, seed=seed + i)
            r = c.post(f"{prefix}/classes/{i % 20}/detect", json={"inputs": x.tolist()})
            if r.status_code != 200:
                failures.append((prefix, r.status_code, r.text))
            else:
                check(x, i % 20, r.json())
            i += 1


def _repository_calls(url: str, key: dict, repo: Path, bundles: dict, offline: dict) -> None:
    """While the load test runs: a write without the key refused; gamma (another backbone) loaded, asked,
    unloaded after its requests drain; a bundle failing verification refused in one line."""
    assert_envelope(httpx.post(f"{url}/v2/repository/models/gamma/load"), 401, "unauthorized")
    shutil.copytree(bundles["gamma"], repo / "gamma")
    index = {m["name"]: m["state"] for m in httpx.post(f"{url}/v2/repository/index").json()}
    assert index == {"alpha": "READY", "beta": "READY", "gamma": "UNAVAILABLE"}
    r = httpx.post(f"{url}/v2/repository/models/gamma/load", headers=key, timeout=60)
    assert r.status_code == 200, r.text
    x = _x(3, seed=5)
    with ThreadPoolExecutor(4) as pool:  # gamma's requests on their way while it is unloaded: each answered
        asks = [pool.submit(httpx.post, f"{url}/v1/models/gamma/classes/{j}/detect",
                            json={"inputs": x.tolist()}, timeout=30) for j in range(8)]
        time.sleep(0.05)
        first = [a.result() for a in asks[:2]]
        unload = httpx.post(f"{url}/v2/repository/models/gamma/unload", headers=key, timeout=60)
        rest = [a.result() for a in asks[2:]]
    assert unload.status_code == 200, unload.text
    for j, r in enumerate(first + rest):
        if r.status_code == 200:
            _check_detect(r.json(), offline["gamma"], j, x)
        else:  # asked after the unload began: no such model any more
            assert_envelope(r, 404, "unknown_model")
    assert_envelope(httpx.post(f"{url}/v1/models/gamma/classes/0/detect", json={"inputs": x.tolist()}), 404,
                    "unknown_model")
    shutil.copytree(bundles["gamma"], repo / "broken")
    _corrupt(repo / "broken")
    bad = assert_envelope(httpx.post(f"{url}/v2/repository/models/broken/load", headers=key, timeout=60), 422,
                          "invalid_bundle")
    assert "\n" not in bad["error"]["message"] and "broken" in bad["error"]["message"]
    listing = httpx.get(f"{url}/v1/models").json()
    assert {m["name"] for m in listing["models"]} == {"alpha", "beta"}
    assert [f["name"] for f in listing["failed"]] == ["broken"]
    assert_envelope(httpx.post(f"{url}/v2/repository/models/alpha/unload", headers=key), 409, "default_model")
    metrics = httpx.get(f"{url}/metrics").text
    assert 'model="gamma"' not in metrics and 'slc_model_loaded{model="beta"} 1.0' in metrics


def test_a_bundle_failing_verification_at_start_is_refused_and_the_others_served(bundles, tmp_path):
    from fastapi.testclient import TestClient

    from serving.main import build

    broken = tmp_path / "broken"
    shutil.copytree(bundles["beta"], broken)
    _corrupt(broken)
    app = build(make_settings(bundles["alpha"], tmp_path, bundles=[f"bad={broken}", f"gamma={bundles['gamma']}"]))[0]
    with TestClient(app, raise_server_exceptions=False) as client:
        wait_ready(client.get)
        listing = client.get("/v1/models").json()
        assert [m["name"] for m in listing["models"]][1:] == ["gamma"]
        assert [f["name"] for f in listing["failed"]] == ["bad"] and "\n" not in listing["failed"][0]["reason"]
        assert len(app.state.slc.models.groups) == 2  # gamma's backbone is another graph
        assert client.post("/v1/models/gamma/classes/3/detect", json={"inputs": _x().tolist()}).status_code == 200


def test_one_bundle_serves_as_before(bundles, offline, tmp_path):
    """One bundle: one model, the default, listed; its answers as ever (tests/test_answers_fixed.py: exactly)."""
    from fastapi.testclient import TestClient

    from serving.main import build

    with TestClient(build(make_settings(bundles["gamma"], tmp_path))[0]) as client:
        wait_ready(client.get)
        listing = client.get("/v1/models").json()
        assert [m["name"] for m in listing["models"]] == [offline["gamma"].bundle.name]
        assert json.loads(client.post("/v2/repository/index").text)[0]["state"] == "READY"


def test_each_model_over_grpc(bundles, offline, tmp_path):
    """KServe v2 over gRPC: each model under its name (and `-full`), its own head; per-model metrics."""
    grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[grpc]'")
    from serving.main import build
    from tests.serving.helpers import free_port

    port = free_port()
    app = build(make_settings(bundles["alpha"], tmp_path, bundles=[f"beta={bundles['beta']}"], grpc_port=port))[0]
    with uvicorn_in_thread(app) as url:
        client = grpcclient.InferenceServerClient(url=f"127.0.0.1:{port}")
        try:
            x, ids = _x(3, seed=4), np.array([0, 12, 29], dtype=np.int64)
            tensors = [grpcclient.InferInput("input", list(x.shape), "FP32"),
                       grpcclient.InferInput("class_id", [3], "INT64")]
            tensors[0].set_data_from_numpy(x)
            tensors[1].set_data_from_numpy(ids)
            got = client.infer("beta", tensors).as_numpy("logit")
            np.testing.assert_allclose(got, offline["beta"].logits(x)[np.arange(3), ids], rtol=1e-4, atol=1e-4)
            full = client.infer("beta-full", tensors[:1]).as_numpy("logits")
            np.testing.assert_allclose(full, offline["beta"].logits(x), rtol=1e-4, atol=1e-4)
            assert client.is_model_ready("beta") and client.is_model_ready(offline["alpha"].bundle.name)
            with pytest.raises(Exception, match="unknown_model"):
                client.infer("nope", tensors)
        finally:
            client.close()
        metrics = httpx.get(f"{url}/metrics").text
        assert 'slc_model_requests_total{endpoint="grpc:ModelInfer",model="beta",status="OK"} 2.0' in metrics


def test_a_postgres_gallery_with_several_models_is_refused_in_one_line(bundles, tmp_path, monkeypatch):
    """SLC_GALLERY_URL keeps one model's gallery: with a second bundle or a repository, `slc serve` says so
    in one line (exit 2) before anything loads; one bundle with it is accepted."""
    from click.testing import CliRunner

    from serving.settings import Settings
    from slc.cli import root

    import serving.main

    monkeypatch.setenv("SLC_GALLERY_URL", "postgresql://nobody@127.0.0.1:1/none")
    monkeypatch.setattr(serving.main, "run_server", lambda overrides: pytest.fail("the server was started"))
    for args in ([str(bundles["alpha"]), str(bundles["beta"])], ["--model-repository", str(tmp_path)]):
        result = CliRunner().invoke(root, ["serve", *args, "--port", "0"])  # through the root, as `slc serve`
        assert result.exit_code == 2, result.output
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert "SLC_GALLERY_URL" in lines[-1] and "Traceback" not in result.output
    assert Settings(bundle=bundles["alpha"]).gallery_url  # one bundle: accepted


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a\\b", "a\0b"])
def test_a_model_name_that_is_not_one_folder_is_refused(name, tmp_path):
    """A model's data folder is DATA_DIR/models/NAME: a name that would reach the server's own folder
    (`..`) or another's is refused, a plain one is that folder."""
    from serving.core.models import ModelRepository
    from serving.settings import Settings

    repo = ModelRepository(Settings(data_dir=tmp_path), None, None, None)
    with pytest.raises(ValueError, match="cannot name a folder"):
        repo.data_dir_of(name)
    assert repo.data_dir_of("set-1.v2") == tmp_path / "models" / "set-1.v2"


def test_a_model_flooding_the_shared_lane_leaves_the_other_one_its_reserve(bundles, offline, tmp_path):
    """alpha floods the backbone lane it shares with beta while a batch holds the lane: alpha's overflow
    gets 429 envelopes, beta's requests are still queued (its reserve of the queue) and answered with
    beta's own offline logits."""
    from serving.main import build

    settings = make_settings(bundles["alpha"], tmp_path, bundles=[f"beta={bundles['beta']}"], queue_size=8,
                             max_delay_ms=0, adaptive_delay=False, request_timeout_s=60)
    app = build(settings)[0]
    with uvicorn_in_thread(app) as url:
        (group,) = app.state.slc.models.groups.values()
        batcher, compute = group.batcher, group.batcher.compute
        assert batcher.sharers == 2 and batcher.reserve() == 2
        hold, started = threading.Event(), threading.Event()

        def held(jobs, shared=False):
            started.set()
            assert hold.wait(60)
            return compute(jobs, shared)

        batcher.compute = held

        def ask(model: str, i: int):
            x = _x(1, seed=100 + i)
            prefix = "/v1" if model == "alpha" else f"/v1/models/{model}"
            r = httpx.post(f"{url}{prefix}/classes/{i % 20}/detect", json={"inputs": x.tolist()}, timeout=60)
            return model, i, x, r

        def wait_for(check):
            end = time.monotonic() + 30
            while not check():
                assert time.monotonic() < end, "the server did not get there"
                time.sleep(0.01)

        with ThreadPoolExecutor(16) as pool:
            first = pool.submit(ask, "alpha", 0)
            wait_for(started.is_set)
            flood = [pool.submit(ask, "alpha", i) for i in range(1, 11)]
            wait_for(lambda: batcher.pending_inputs == 6 and sum(f.done() for f in flood) == 4)
            betas = [pool.submit(ask, "beta", i) for i in range(2)]
            wait_for(lambda: batcher.pending_inputs == 8)
            hold.set()
            answers = [f.result() for f in [first, *flood, *betas]]
    refused = [r for model, _, _, r in answers if r.status_code == 429]
    assert len(refused) == 4 and all(model == "alpha" for model, _, _, r in answers if r.status_code == 429)
    for r in refused:
        assert_envelope(r, 429)
    for model, i, x, r in answers:
        if r.status_code != 429:
            assert r.status_code == 200, r.text
            _check_detect(r.json(), offline[model], i % 20, x)


def test_loading_a_served_model_again_reloads_it_with_no_failed_request(bundles, offline, tmp_path):
    """POST …/models/beta/load while beta is served (as KServe v2 and Triton have it): the same bundle
    again keeps its enrolled class; a new bundle under the name serves its own classes after the call;
    requests running through both reloads are each answered by one version or the other, none fails;
    the default model is refused in one line, and a bundle failing verification leaves the old one serving."""
    repo, app, key = _repository_server(bundles, tmp_path)
    with uvicorn_in_thread(app) as url:
        stop, failures, versions = threading.Event(), [], set()

        def either(x: np.ndarray, j: int, answer: dict) -> None:  # beta's logit before the swap, gamma's after
            got = answer["results"][0]["logit"]
            which = [v for v in ("beta", "gamma") if abs(offline[v].logits(x)[0, j] - got) < 1e-3]
            failures.extend([] if which else [("neither version's logit", got)])
            versions.update(which)

        x5 = _x(5, seed=77)
        r = httpx.put(f"{url}/v1/models/beta/classes/newcomer", json={"inputs": x5.tolist()}, headers=key, timeout=30)
        assert r.status_code in (200, 201), r.text
        before = httpx.post(f"{url}/v1/models/beta/classes/newcomer/detect", json={"inputs": x5.tolist()}).json()
        workers = [threading.Thread(target=_load_test, args=(url, "/v1/models/beta", seed, stop, failures, either),
                                    daemon=True) for seed in (0, 50_000)]
        for w in workers:
            w.start()
        try:
            time.sleep(0.3)
            again = httpx.post(f"{url}/v2/repository/models/beta/load", headers=key, timeout=60)
            assert again.status_code == 200, again.text
            after = httpx.post(f"{url}/v1/models/beta/classes/newcomer/detect", json={"inputs": x5.tolist()}).json()
            assert [r["logit"] for r in after["results"]] == [r["logit"] for r in before["results"]]
            shutil.copytree(bundles["beta"], tmp_path / "broken")
            _corrupt(tmp_path / "broken")
            (repo / "beta").rename(tmp_path / "beta-was")
            (tmp_path / "broken").rename(repo / "beta")
            assert_envelope(httpx.post(f"{url}/v2/repository/models/beta/load", headers=key, timeout=60), 422,
                            "invalid_bundle")
            shutil.rmtree(repo / "beta")
            shutil.copytree(bundles["gamma"], repo / "beta")
            swap = httpx.post(f"{url}/v2/repository/models/beta/load", headers=key, timeout=60)
            assert swap.status_code == 200, swap.text
            x = _x(3, seed=4)
            r = httpx.post(f"{url}/v1/models/beta/classes/7/detect", json={"inputs": x.tolist()})
            _check_detect(r.json(), offline["gamma"], 7, x)
            time.sleep(0.3)
        finally:
            stop.set()
            for w in workers:
                w.join(timeout=30)
        assert_envelope(httpx.post(f"{url}/v2/repository/models/alpha/load", headers=key), 409, "default_model")
        listing = {m["name"]: m for m in httpx.get(f"{url}/v1/models").json()["models"]}
        assert listing["beta"]["classes"]["trained"] == 20 and listing["beta"]["state"] == "ready"
    assert failures == [] and versions == {"beta", "gamma"}


def test_the_openapi_schema_lists_every_route_of_a_model_and_each_answers(bundles, offline, tmp_path):
    """Each /v1 route has its /v1/models/{model}/… twin in the schema; every GET twin without another
    path parameter answers for beta as its /v1 route does for the default model, and a model not served
    gets the 404 envelope the schema names."""
    from fastapi.testclient import TestClient

    from serving.main import build

    app = build(make_settings(bundles["alpha"], tmp_path, bundles=[f"beta={bundles['beta']}"]))[0]
    with TestClient(app, raise_server_exceptions=False) as client:
        wait_ready(client.get)
        paths = client.get("/openapi.json").json()["paths"]
        plain = [p for p in paths if p.startswith("/v1/") and not p.startswith("/v1/models")]
        assert plain and all(("/v1/models/{model}" + p[3:] if p != "/v1/model" else "/v1/models/{model}") in paths
                             for p in plain)
        gets = [p for p in paths if p.startswith("/v1/models/{model}") and "get" in paths[p] and p.count("{") == 1]
        assert "/v1/models/{model}" in gets
        for path in gets:
            op = paths[path]["get"]
            assert "404" in op["responses"] and op["parameters"][0]["name"] == "model"
            default = path.replace("/models/{model}", "") or "/v1/model"
            default = "/v1/model" if default == "/v1" else default
            mine = client.get(path.replace("{model}", "beta"))
            assert mine.status_code == client.get(default).status_code, path
            assert_envelope(client.get(path.replace("{model}", "nosuch")), 404, "unknown_model")
        assert client.get("/v1/models/beta").json()["num_classes"] == 30  # beta's own model info, not alpha's
