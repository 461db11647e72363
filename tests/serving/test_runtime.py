"""The backbone's sessions: the one-thread session for small batches answers as the pool session does."""
from __future__ import annotations

import numpy as np

from serving.core.sessions import Runtime
from tests.serving.helpers import INPUT_DIM


def _timer_where_one_thread_wins_up_to(limit: int):
    """A stand-in for the stopwatch: the one-thread session is faster for batches of up to `limit`."""
    def timer(session, output, feed):
        n = next(iter(feed.values())).shape[0]
        one_thread = session.get_session_options().intra_op_num_threads == 1
        return 1.0 if one_thread == (n <= limit) else 2.0
    return timer


def test_small_batches_run_on_a_one_thread_session_with_the_same_answers(bundle, offline):
    rt = Runtime(bundle, "cpu", threads=2)
    assert rt.choose_small_batches(timer=_timer_where_one_thread_wins_up_to(4)) == 4
    assert rt.small_batch_max == 4
    rng = np.random.default_rng(0)
    for n in (1, 3, 4, 5, 9):
        x = rng.standard_normal((n, INPUT_DIM)).astype(np.float32)
        np.testing.assert_allclose(rt.embed(x), offline.embed(x), rtol=1e-5, atol=1e-6)


def test_where_the_pool_is_faster_even_for_one_input_the_one_thread_session_serves_only_batches_beside_a_pass(
        bundle, offline):
    rt = Runtime(bundle, "cpu", threads=2)
    assert rt.choose_small_batches(timer=_timer_where_one_thread_wins_up_to(0)) == 0
    x = np.random.default_rng(1).standard_normal((3, INPUT_DIM)).astype(np.float32)
    assert rt.small_batch_max == 0 and rt._small is not None
    np.testing.assert_allclose(rt.embed(x, one_thread=True), offline.embed(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rt.embed(x), offline.embed(x), rtol=1e-5, atol=1e-6)


def test_a_one_thread_runtime_keeps_one_session(bundle):
    rt = Runtime(bundle, "cpu", threads=1)
    assert rt.choose_small_batches(timer=_timer_where_one_thread_wins_up_to(64)) == 0
    assert rt._small is None


def _no_timer(session, output, feed):
    raise AssertionError("a pinned range must not be timed")


def test_a_pinned_range_is_taken_untimed_and_answers_as_the_pool_does(bundle, offline):
    rt = Runtime(bundle, "cpu", threads=2)
    assert rt.choose_small_batches(timer=_no_timer, pinned=16) == 16 and rt.small_batch_max == 16
    x = np.random.default_rng(2).standard_normal((16, INPUT_DIM)).astype(np.float32)
    np.testing.assert_allclose(rt.embed(x), offline.embed(x), rtol=1e-5, atol=1e-6)


def test_a_pinned_range_does_not_apply_where_there_is_one_thread(bundle):
    rt = Runtime(bundle, "cpu", threads=1)
    assert rt.choose_small_batches(timer=_no_timer, pinned=16) == 0 and rt._small is None


def test_the_server_shows_the_pinned_range_it_serves_with(client_factory):
    """SLC_ONE_THREAD_MAX_BATCH reaches the runtime through warm-up, and GET /v1/model reports it."""
    client = client_factory(intra_op_threads=2, one_thread_max_batch=8)
    assert client.get("/v1/model").json()["batching"]["one_thread_backbone_max_batch"] == 8


def test_one_thread_max_batch_takes_auto_or_a_count_from_the_environment(monkeypatch, tmp_path):
    import pytest
    from pydantic import ValidationError

    from serving.settings import Settings

    for raw, want in (("auto", "auto"), ("12", 12), ("0", 0)):
        monkeypatch.setenv("SLC_ONE_THREAD_MAX_BATCH", raw)
        assert Settings(data_dir=tmp_path).one_thread_max_batch == want
    for raw in ("-1", "5000", "many"):
        monkeypatch.setenv("SLC_ONE_THREAD_MAX_BATCH", raw)
        with pytest.raises(ValidationError, match="one_thread_max_batch"):
            Settings(data_dir=tmp_path)


def _timer_where_the_pool_is_faster_by(share: float):
    def timer(session, output, feed):
        one_thread = session.get_session_options().intra_op_num_threads == 1
        return 1.0 if one_thread else 1.0 / (1 + share)
    return timer


def test_a_near_tie_goes_to_the_one_thread_session(bundle):
    """Sizes where the two sessions tie used to be decided by noise (the range flipped between 0 and
    32 from start to start); within SMALL_BATCH_TIE the one thread keeps the size."""
    from serving.core.sessions import SMALL_BATCH_TIE

    rt = Runtime(bundle, "cpu", threads=2)
    assert rt.choose_small_batches(timer=_timer_where_the_pool_is_faster_by(SMALL_BATCH_TIE / 2)) == 32
    assert rt.choose_small_batches(timer=_timer_where_the_pool_is_faster_by(SMALL_BATCH_TIE * 2)) == 0
