"""Enrolled classes are durable and shared (issue 38): a kill -9 of the real server right after the
201 loses nothing, a restart replays them, a second server process on the same data dir (SQLite) serves
another's enrollment within its sync time, and concurrent PUTs of one name, on both processes at once,
end in one class. Plus the store itself on a throwaway PostgreSQL (two replicas' connections)."""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import numpy as np
import pytest

from tests.serving.helpers import D, Offline, free_port, postgres_missing, serve_process, wait_http_ready
from tests.serving.test_enroll import examples, imprint

pytestmark = pytest.mark.integration  # real processes, sockets or files

SYNC_WAIT_S = 10.0  # the documented time is SLC_ENROLLED_SYNC_S (0.5 s) plus one read: generous on a busy machine


def _start(bundle_path, tmp_path, **env):
    port = free_port()
    proc = serve_process(bundle_path, tmp_path, port, SLC_LOG_LEVEL="warning", **env)
    url = f"http://127.0.0.1:{port}"
    wait_http_ready(url, proc)
    return proc, url


def _stop(proc, sig=signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, sig)
    proc.wait(timeout=30)


def _detect(url: str, name: str, x: np.ndarray) -> httpx.Response:
    return httpx.post(f"{url}/v1/classes/{name}/detect", json={"inputs": x.tolist()}, timeout=30)


def test_kill_9_right_after_201_loses_nothing(bundle_path, tmp_path, offline, inputs):
    proc, url = _start(bundle_path, tmp_path)
    try:
        r = httpx.put(f"{url}/v1/classes/kept", json={"inputs": examples(21).tolist()}, timeout=30)
        assert r.status_code == 201, r.text
        before = _detect(url, "kept", inputs).json()
        os.kill(proc.pid, signal.SIGKILL)  # no shutdown of any kind
        proc.wait(timeout=30)
    finally:
        _stop(proc, signal.SIGKILL)
    proc, url = _start(bundle_path, tmp_path)
    try:
        after = _detect(url, "kept", inputs).json()
        assert after == before
        row, b = imprint(offline, examples(21))
        np.testing.assert_allclose([res["logit"] for res in after["results"]],
                                   offline.embed(inputs).astype(np.float64) @ row + b, rtol=1e-5, atol=1e-5)
    finally:
        _stop(proc)


def test_a_second_process_on_the_same_data_dir_follows_and_concurrent_puts_end_in_one_class(
        bundle_path, tmp_path, offline, inputs):
    first, url_a = _start(bundle_path, tmp_path)
    second, url_b = _start(bundle_path, tmp_path)
    try:
        assert httpx.put(f"{url_a}/v1/classes/shared", json={"inputs": examples(31).tolist()}, timeout=30).status_code == 201
        seen = _wait_for(lambda: _detect(url_b, "shared", inputs).status_code == 200)
        assert seen, "the second process did not serve the class"
        assert _detect(url_b, "shared", inputs).json() == _detect(url_a, "shared", inputs).json()
        assert httpx.delete(f"{url_a}/v1/classes/shared", timeout=30).status_code == 204
        assert _wait_for(lambda: _detect(url_b, "shared", inputs).status_code == 404)

        answers = _concurrent_puts([url_a, url_b], "race", seeds=range(40, 48))
        assert sorted(a.status_code for a in answers).count(201) == 1, [a.text for a in answers]
        assert {a.json()["class_id"] for a in answers} == {D + 1}  # one class, one id (slot 0 was "shared")
        rows = {seed: imprint(offline, examples(seed)) for seed in range(40, 48)}
        h = offline.embed(inputs).astype(np.float64)

        def winner(url):
            got = np.array([res["logit"] for res in _detect(url, "race", inputs).json()["results"]])
            return [s for s, (row, b) in rows.items() if np.allclose(got, h @ row + b, rtol=1e-5, atol=1e-5)]

        assert _wait_for(lambda: winner(url_a) == winner(url_b) and len(winner(url_a)) == 1)
        for url in (url_a, url_b):
            listing = httpx.get(f"{url}/v1/classes", timeout=30).json()
            assert [(c["class_id"], c["class_name"]) for c in listing["classes"]] == [(D + 1, "race")]
    finally:
        _stop(first)
        _stop(second)


def _wait_for(check, timeout: float = SYNC_WAIT_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def _concurrent_puts(urls: list[str], name: str, seeds) -> list[httpx.Response]:
    answers, barrier = [], threading.Barrier(len(list(seeds)))

    def put(url, seed):
        barrier.wait()
        answers.append(httpx.put(f"{url}/v1/classes/{name}", json={"inputs": examples(seed).tolist()}, timeout=60))

    threads = [threading.Thread(target=put, args=(urls[i % len(urls)], s)) for i, s in enumerate(seeds)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


@pytest.mark.skipif(postgres_missing() is not None, reason=str(postgres_missing()))
def test_postgres_store_is_shared_by_replicas(bundle):
    """Two replicas' managers on one PostgreSQL: writes of one reach the other by its catch-up."""
    from serving.core.enrolled import EnrolledClasses
    from serving.gallery.enrolled import LimitReached, PostgresEnrolledStore
    from tests.serving.helpers import make_settings, throwaway_postgres

    settings = make_settings(bundle.path, bundle.path.parent, max_enrolled_classes=2)
    with throwaway_postgres() as (url, _):
        a = EnrolledClasses(PostgresEnrolledStore(url, bundle.digest), bundle, settings)
        b = EnrolledClasses(PostgresEnrolledStore(url, bundle.digest), bundle, settings)
        other = PostgresEnrolledStore(url, "another-digest")
        try:
            h = Offline(bundle).embed(examples(50))
            answer, created = a.put("pg", a.compute(h))
            assert created and answer["class_id"] == D
            assert b.snapshot.n == 0
            b.catch_up()
            assert b.snapshot.n == 1 and b.snapshot.name(0) == "pg"
            np.testing.assert_array_equal(b.snapshot.weight, a.snapshot.weight)
            assert b.put("pg", b.compute(h[:1]))[1] is False  # replaced, same slot
            b.put("pg2", b.compute(h[1:]))
            with pytest.raises(LimitReached):
                a.put("pg3", a.compute(h))
            assert a.delete("pg") == D
            b.catch_up()
            assert [b.snapshot.name(i) for i in range(b.snapshot.n)] == ["pg2"]
            assert other.changes(0) == [] and other.other_bundles() == 1
        finally:
            for m in (a, b):
                m.close()
            other.close()
