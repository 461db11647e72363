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
