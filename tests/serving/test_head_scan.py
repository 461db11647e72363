"""The chunked passes over the head against float64 brute force over the whole [N, D] matrix."""
from __future__ import annotations

import numpy as np
import pytest

from serving.core import head_scan


def _head(D=1000, d=16, n=5, seed=0):
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((D, d)).astype(np.float32)
    b = rng.standard_normal(D).astype(np.float32)
    h = rng.standard_normal((n, d)).astype(np.float32)
    z64 = h.astype(np.float64) @ W.astype(np.float64).T + b  # [n, D] the truth
    return W, b, h, z64


@pytest.fixture(scope="module", params=["numpy", "onnxruntime"])
def logsumexp(request):
    """The chunk's log-sum-exp by numpy and by onnxruntime's LogSoftmax (on every chunk, however
    small): each is held to float64."""
    return head_scan.numpy_logsumexp if request.param == "numpy" else head_scan.OrtLogSumExp(min_values=0)


@pytest.mark.parametrize("rows", [7, 100, 1000, None])
def test_streamed_softmax_equals_the_dense_softmax(rows, logsumexp):
    W, b, h, z64 = _head()
    j = 123
    acc = head_scan.SoftmaxStats(len(h), j, logsumexp)
    head_scan.scan(W, b, h, [(slice(None), acc)], rows)
    p, zj, top1 = acc.result()
    dense = np.exp(z64 - z64.max(1, keepdims=True))
    dense /= dense.sum(1, keepdims=True)
    np.testing.assert_allclose(p, dense[:, j], rtol=1e-5)
    np.testing.assert_allclose(zj, z64[:, j], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(top1, z64.argmax(1) == j)
    assert acc.finite.all()


def test_is_top1_is_true_where_the_class_is_the_argmax():
    W, b, h, z64 = _head()
    j = int(z64[2].argmax())  # row 2's winner: is_top1 there, and only where it wins
    acc = head_scan.SoftmaxStats(len(h), j)
    head_scan.scan(W, b, h, [(slice(None), acc)], 64)
    np.testing.assert_array_equal(acc.result()[2], z64.argmax(1) == j)
    assert acc.result()[2][2]


@pytest.mark.parametrize("k,rows", [(1, 7), (10, 7), (10, 1000), (50, 33), (1000, 64)])
def test_streamed_topk_equals_a_full_sort(k, rows):
    W, b, h, z64 = _head()
    acc = head_scan.TopK(len(h), k)
    head_scan.scan(W, b, h, [(slice(None), acc)], rows)
    scores, ids = acc.result()
    truth = np.argsort(-z64, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(ids, truth)
    np.testing.assert_allclose(scores, np.take_along_axis(z64, truth, 1), rtol=1e-5, atol=1e-5)


def test_topk_orders_equal_logits_by_id():
    rng = np.random.default_rng(3)
    W = rng.integers(0, 3, (3000, 1)).astype(np.float32)  # logits in {0, 1, 2}: ties everywhere
    b = np.zeros(3000, np.float32)
    acc = head_scan.TopK(2, 40)
    head_scan.scan(W, b, np.ones((2, 1), np.float32), [(slice(None), acc)], 500)
    scores, ids = acc.result()
    assert (scores == 2).all() and len(set(ids[0])) == 40 and (W[ids[0], 0] == 2).all()
    np.testing.assert_array_equal(ids, np.sort(ids, axis=1))  # equal logits: smaller id first


@pytest.mark.parametrize("k", [65, 300])
def test_a_large_k_partitions_every_chunk_and_still_equals_a_full_sort(k):
    W, b, h, z64 = _head(D=2000)
    acc = head_scan.TopK(len(h), k)
    head_scan.scan(W, b, h, [(slice(None), acc)], 333)
    np.testing.assert_array_equal(acc.result()[1], np.argsort(-z64, axis=1, kind="stable")[:, :k])


def test_a_minus_infinite_logit_is_not_finite_output(logsumexp):
    z = np.zeros((2, 10), np.float32)
    z[1, 4] = -np.inf
    for acc in (head_scan.SoftmaxStats(2, 0, logsumexp), head_scan.TopK(2, 3), head_scan.AllLogits(2, 10)):
        head_scan.feed(z.copy(), [(slice(None), acc)])
        np.testing.assert_array_equal(acc.finite, [True, False])


def test_all_logits_equal_the_dense_matrix_and_jobs_get_their_own_rows():
    W, b, h, z64 = _head(n=6)
    parts = [(slice(0, 2), head_scan.AllLogits(2, len(W))), (slice(2, 5), head_scan.TopK(3, 4)),
             (slice(5, 6), head_scan.SoftmaxStats(1, 9))]
    head_scan.scan(W, b, h, parts, 97)
    np.testing.assert_allclose(parts[0][1].result(), z64[:2], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(parts[1][1].result()[1], np.argsort(-z64[2:5], axis=1)[:, :4])
    dense = np.exp(z64[5] - z64[5].max())
    np.testing.assert_allclose(parts[2][1].result()[0], dense[9] / dense.sum(), rtol=1e-5)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_embedding_marks_only_its_row(bad, logsumexp):
    W, b, h, _ = _head()
    h[3, 0] = bad
    for acc in (head_scan.SoftmaxStats(len(h), 0, logsumexp), head_scan.TopK(len(h), 5), head_scan.AllLogits(len(h), len(W))):
        head_scan.scan(W, b, h, [(slice(None), acc)], 128)
        np.testing.assert_array_equal(acc.finite, np.arange(len(h)) != 3)


@pytest.mark.parametrize("rows", [64, None])
def test_the_onnxruntime_gemm_gives_the_same_logits_as_float64(rows):
    W, b, h, z64 = _head(n=7)
    acc = head_scan.AllLogits(len(h), len(W))
    head_scan.scan(W, b, h, [(slice(None), acc)], rows, gemm=head_scan.OrtGemm(W.shape[1], threads=2))
    np.testing.assert_allclose(acc.result(), z64, rtol=1e-5, atol=1e-5)


def test_feed_takes_logits_computed_elsewhere_as_one_chunk():
    W, b, h, z64 = _head()
    acc = head_scan.TopK(len(h), 3)
    head_scan.feed(z64.astype(np.float32), [(slice(None), acc)])
    np.testing.assert_array_equal(acc.result()[1], np.argsort(-z64, axis=1)[:, :3])


def test_a_chunk_holds_a_bounded_number_of_logits():
    assert head_scan.chunk_rows(64, 10**6) * 64 <= head_scan.CHUNK_VALUES
    assert head_scan.chunk_rows(1, 10**6) == 10**6  # one input: one chunk of all classes
    assert head_scan.chunk_rows(10**6, 10**6) == head_scan.MIN_CHUNK_ROWS
    assert head_scan.chunk_rows(8, 100) == 100


@pytest.mark.parametrize("sizes", [[1] * 9, [4, 1, 1], [1, 7], [3]])
def test_two_threads_over_the_accumulators_give_every_job_the_dense_answer(sizes):
    """The pass's statistics split over a second thread: each job still gets exactly its own rows."""
    from concurrent.futures import ThreadPoolExecutor

    n = sum(sizes)
    W, b, h, z64 = _head(D=3000, n=n)
    starts = np.cumsum([0] + sizes)
    kinds = [lambda m, i=i: (head_scan.SoftmaxStats(m, 11 * i), head_scan.TopK(m, 5), head_scan.AllLogits(m, len(W)))[i % 3]
             for i in range(len(sizes))]
    parts = [(slice(starts[i], starts[i + 1]), kinds[i](sizes[i])) for i in range(len(sizes))]
    with ThreadPoolExecutor(1) as pool:
        head_scan.scan(W, b, h, parts, 250, pool=pool)
    for i, (sl, acc) in enumerate(parts):
        z = z64[sl]
        if i % 3 == 0:
            e = np.exp(z - z.max(1, keepdims=True))
            np.testing.assert_allclose(acc.result()[0], e[:, 11 * i] / e.sum(1), rtol=1e-5)
        elif i % 3 == 1:
            np.testing.assert_array_equal(acc.result()[1], np.argsort(-z, axis=1)[:, :5])
        else:
            np.testing.assert_allclose(acc.result(), z, rtol=1e-5, atol=1e-5)


def _pair_gemms(kind: str, W: np.ndarray, b: np.ndarray, rows: int):
    """The two chunk GEMMs of a scan_two pass: one onnxruntime Gemm per thread over the rows
    (ort_pair), or one pre-packed session per chunk shared by both threads (packed_pair)."""
    if kind == "ort_pair":
        return tuple(head_scan.over_rows(head_scan.OrtGemm(W.shape[1], threads=1), W, b) for _ in range(2))
    from serving.core.packed_head import PackedHead

    packed = PackedHead(W, b, rows)
    return packed, packed


@pytest.mark.parametrize("kind", ["ort_pair", "packed_pair"])
@pytest.mark.parametrize("sizes", [[1] * 9, [4, 1, 1], [1, 7], [3]])
def test_two_gemms_taking_chunks_in_turn_give_every_job_the_dense_answer(sizes, kind):
    """scan_two: two one-thread GEMMs take class chunks as they finish theirs, in no set order; each
    job still gets exactly the float64 answer for its rows."""
    from concurrent.futures import ThreadPoolExecutor

    n = sum(sizes)
    W, b, h, z64 = _head(D=3001, n=n)
    starts = np.cumsum([0] + sizes)
    kinds = [lambda m, i=i: (head_scan.SoftmaxStats(m, 11 * i), head_scan.TopK(m, 5), head_scan.AllLogits(m, len(W)))[i % 3]
             for i in range(len(sizes))]
    parts = [(slice(starts[i], starts[i + 1]), kinds[i](sizes[i])) for i in range(len(sizes))]
    gemms = _pair_gemms(kind, W, b, rows=97)
    bufs = tuple(np.empty(n * 97, np.float32) for _ in range(2))
    with ThreadPoolExecutor(1) as pool:
        head_scan.scan_two(len(W), h, parts, gemms, bufs, pool, rows=97)
    for i, (sl, acc) in enumerate(parts):
        z = z64[sl]
        if i % 3 == 0:
            e = np.exp(z - z.max(1, keepdims=True))
            np.testing.assert_allclose(acc.result()[0], e[:, 11 * i] / e.sum(1), rtol=1e-5)
            np.testing.assert_array_equal(acc.result()[2], z.argmax(1) == 11 * i)
        elif i % 3 == 1:
            np.testing.assert_array_equal(acc.result()[1], np.argsort(-z, axis=1)[:, :5])
        else:
            np.testing.assert_allclose(acc.result(), z, rtol=1e-5, atol=1e-5)


def test_a_packed_head_refuses_a_class_range_that_is_not_one_of_its_chunks():
    from serving.core.packed_head import PackedHead

    W, b, h, _ = _head(D=300, n=2)
    packed = PackedHead(W, b, rows=100)
    out = np.empty((2, 100), np.float32)
    np.testing.assert_allclose(packed(h, 200, 300, out), h.astype(np.float64) @ W[200:].T.astype(np.float64) + b[200:],
                               rtol=1e-5, atol=1e-5)
    for start, stop in ((50, 150), (100, 150)):
        with pytest.raises(ValueError, match="not one of this head's chunks of 100"):
            packed(h, start, stop, out[:, :stop - start])


@pytest.mark.parametrize("mine", [[0, 1, 2, 3], [], [1, 3], [2]])
def test_softmax_statistics_of_two_threads_combined_equal_one_pass_over_every_chunk(mine):
    """scan_two's threads each keep statistics over the chunks they took (any share, none at all);
    combined they give the float64 answer, and the top class among equal maxima is the smallest id."""
    W, b, h, z64 = _head(D=1000, n=4)
    W[5], W[990] = 100 * h[0], 100 * h[0]  # classes 5 and 990 tie for input 0's top, in two chunks
    b[5] = b[990] = 0.0
    z64 = h.astype(np.float64) @ W.astype(np.float64).T + b
    z = z64.astype(np.float32)
    j = np.array([5, 990, 300, 999])  # one class per row
    first = head_scan.SoftmaxStats(len(h), j)
    second = first.fresh()
    for k, start in enumerate(range(0, 1000, 250)):
        (first if k in mine else second).update(z[:, start:start + 250].copy(), start)
    second.combine(first)
    e = np.exp(z64 - z64.max(1, keepdims=True))
    prob, zj, top1 = second.result()
    np.testing.assert_allclose(prob, e[np.arange(4), j] / e.sum(1), rtol=1e-5)
    np.testing.assert_allclose(zj, z[np.arange(4), j])
    assert top1.tolist() == [True, False, *(z64[2:].argmax(1) == j[2:]).tolist()]


def test_the_top_class_among_equal_maxima_is_the_smallest_id_whatever_the_chunk_order():
    W, b, h, _ = _head(D=1000, n=3)
    W[5], W[900] = 100 * h[0], 100 * h[0]  # classes 5 and 900: the same logit for every input,
    b[5] = b[900] = 0.0  # and the largest for input 0
    z = (h @ W.T + b).astype(np.float32)
    for order in ([0, 500], [500, 0]):  # chunk [500, 1000) first, then [0, 500)
        acc = head_scan.SoftmaxStats(len(h), 5)
        for start in order:
            acc.update(z[:, start:start + 500].copy(), start)
        assert acc.result()[2][0]  # input 0: class 5 is the top-1 (900 ties with it, its id is larger)


def test_the_accumulators_are_cut_in_two_by_rows():
    parts = [(slice(0, 6), "a"), (slice(6, 7), "b"), (slice(7, 8), "c"), (slice(8, 12), "d")]
    first, second = head_scan._halves(parts)
    assert [p[1] for p in first] == ["a"] and [p[1] for p in second] == ["b", "c", "d"]
    assert head_scan._halves(parts[:1]) is None
    first, second = head_scan._halves([(slice(i, i + 1), i) for i in range(5)])
    assert len(first) == 3 and len(second) == 2


@pytest.mark.parametrize("threads", [False, True])
@pytest.mark.parametrize("how", ["scan", "feed"])
def test_adjacent_softmax_requests_share_one_accumulator_and_each_gets_its_rows(threads, how, logsumexp):
    """Runs of one-row softmax requests (the full-softmax load) are accumulated together; every
    request still gets the dense answer for its own class, around requests of other kinds."""
    from concurrent.futures import ThreadPoolExecutor

    sizes = [1] * 5 + [2] + [1] * 4 + [3, 1, 1]
    n = sum(sizes)
    W, b, h, z64 = _head(D=2000, n=n, seed=4)
    starts = np.cumsum([0] + sizes)
    classes = [(37 * i) % 2000 for i in range(len(sizes))]
    classes[3] = int(z64[starts[3]].argmax())  # one request asks for its top-1 class
    parts = [(slice(starts[i], starts[i + 1]),
              head_scan.TopK(sizes[i], 4) if i in (6, 10) else head_scan.SoftmaxStats(sizes[i], classes[i], logsumexp))
             for i in range(len(sizes))]
    with ThreadPoolExecutor(1) as pool:
        p = pool if threads else None
        if how == "scan":
            head_scan.scan(W, b, h, parts, 300, pool=p)
        else:
            head_scan.feed((h.astype(np.float64) @ W.T.astype(np.float64) + b).astype(np.float32), parts, pool=p)
    for i, (sl, acc) in enumerate(parts):
        z = z64[sl]
        if isinstance(acc, head_scan.TopK):
            np.testing.assert_array_equal(acc.result()[1], np.argsort(-z, axis=1)[:, :4])
            continue
        e = np.exp(z - z.max(1, keepdims=True))
        prob, zj, top1 = acc.result()
        assert prob.shape == (sizes[i],)
        np.testing.assert_allclose(prob, e[:, classes[i]] / e.sum(1), rtol=1e-5)
        np.testing.assert_allclose(zj, z[:, classes[i]], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(top1, z.argmax(1) == classes[i])
        assert acc.finite.all()
    assert parts[3][1].result()[2].all()


def test_a_merged_run_keeps_each_requests_non_finite_rows_its_own(logsumexp):
    """Class 17's logit overflows to +inf for input 0 and to -inf for input 1 only."""
    W, b, h, _ = _head(D=500, n=4, seed=5)
    W[17] = 0.0
    W[17, 0] = 3e38
    h[:, 0] = [2.0, -2.0, 0.0, 0.5]
    parts = [(slice(i, i + 1), head_scan.SoftmaxStats(1, 3, logsumexp)) for i in range(4)]
    head_scan.scan(W, b, h, parts, 100)
    assert [bool(acc.finite[0]) for _, acc in parts] == [False, False, True, True]


def test_requests_with_different_logsumexp_kernels_are_not_merged():
    parts = [(slice(0, 1), head_scan.SoftmaxStats(1, 0)), (slice(1, 2), head_scan.SoftmaxStats(1, 0, head_scan.OrtLogSumExp()))]
    merged, _, _ = head_scan._merged(parts, None)
    assert len(merged) == 2
