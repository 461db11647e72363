"""Dynamic batching: coalescing, limits, overload (429) and deadlines (504), unit and over HTTP."""
from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from serving.core.batcher import Batcher
from serving.errors import DeadlineExceeded, Kind, Overloaded
from tests.serving.helpers import assert_envelope


class Recorder:
    """compute(): returns each job's rows times 2 (or reduce of them), remembers batch sizes."""

    def __init__(self, sleep: float = 0.0):
        self.batches: list[list[int]] = []
        self.sleep = sleep

    def __call__(self, jobs, shared=False):
        import time

        if self.sleep:
            time.sleep(self.sleep)
        self.batches.append([j.n for j in jobs])
        return [j.reduce(j.x * 2) if j.reduce else j.x * 2 for j in jobs]


def run(coro):
    return asyncio.run(coro)


def test_concurrent_requests_coalesce_and_get_their_own_rows():
    async def main():
        rec = Recorder()
        b = Batcher(rec, max_batch=64, max_delay_ms=50, queue_size=1000)
        b.start()
        xs = [np.full((i % 3 + 1, 2), float(i)) for i in range(20)]
        outs = await asyncio.gather(*(b.submit(x) for x in xs))
        await b.stop()
        return rec, xs, outs

    rec, xs, outs = run(main())
    for x, out in zip(xs, outs):
        np.testing.assert_array_equal(out, x * 2)
    assert sum(map(sum, rec.batches)) == sum(len(x) for x in xs)
    assert len(rec.batches) < len(xs)  # coalesced: fewer compute calls than requests


def test_max_batch_is_respected_and_big_jobs_go_alone():
    async def main():
        rec = Recorder()
        b = Batcher(rec, max_batch=8, max_delay_ms=20, queue_size=1000)
        b.start()
        small = [b.submit(np.ones((3, 1))) for _ in range(6)]
        big = b.submit(np.ones((20, 1)))
        await asyncio.gather(*small, big)
        await b.stop()
        return rec

    rec = run(main())
    for sizes in rec.batches:
        assert sum(sizes) <= 8 or sizes == [20]
    assert [20] in rec.batches


def test_full_queue_raises_overloaded_then_recovers():
    async def main():
        rec = Recorder()
        b = Batcher(rec, max_batch=64, max_delay_ms=200, queue_size=4)
        b.start()
        tasks = [asyncio.ensure_future(b.submit(np.ones((1, 1)))) for _ in range(10)]
        done = await asyncio.gather(*tasks, return_exceptions=True)
        after = await b.submit(np.ones((1, 1)))
        await b.stop()
        return done, after

    done, after = run(main())
    overloaded = [d for d in done if isinstance(d, Overloaded)]
    ok = [d for d in done if isinstance(d, np.ndarray)]
    assert len(ok) == 4 and len(overloaded) == 6
    assert all(e.kind is Kind.OVERLOADED and e.retry_after >= 1 for e in overloaded)
    np.testing.assert_array_equal(after, [[2.0]])


def test_empty_queue_admits_a_request_bigger_than_the_queue():
    async def main():
        b = Batcher(Recorder(), max_batch=4, max_delay_ms=0, queue_size=2)
        b.start()
        out = await b.submit(np.ones((5, 1)))
        await b.stop()
        return out

    assert run(main()).shape == (5, 1)


def test_expired_requests_are_never_computed():
    async def main():
        rec = Recorder()
        b = Batcher(rec, max_batch=64, max_delay_ms=300, queue_size=100)
        b.start()
        late = asyncio.ensure_future(b.submit(np.ones((2, 1)), timeout=0.02))
        patient = asyncio.ensure_future(b.submit(np.ones((3, 1))))
        results = await asyncio.gather(late, patient, return_exceptions=True)
        await b.stop()
        return rec, results

    rec, (late, patient) = run(main())
    assert isinstance(late, DeadlineExceeded) and late.kind is Kind.DEADLINE
    assert patient.shape == (3, 1)
    assert rec.batches == [[3]]  # the expired request's 2 inputs were dropped, not computed


def test_stop_drains_the_queue():
    async def main():
        rec = Recorder(sleep=0.01)
        b = Batcher(rec, max_batch=2, max_delay_ms=0, queue_size=100)
        b.start()
        tasks = [asyncio.ensure_future(b.submit(np.full((1, 1), i))) for i in range(7)]
        await asyncio.sleep(0)
        await b.stop()
        return [t.result() for t in tasks]

    outs = run(main())
    assert [float(o[0, 0]) for o in outs] == [2.0 * i for i in range(7)]


def test_adaptive_delay_waits_only_while_others_are_on_the_way():
    async def main():
        rec = Recorder()
        in_flight = {"n": 1}
        b = Batcher(rec, max_batch=64, max_delay_ms=5000, queue_size=100, in_flight=lambda: in_flight["n"])
        b.start()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await b.submit(np.ones((1, 1)))  # alone: goes at once, not after 5 s
        alone = loop.time() - t0
        in_flight["n"] = 3  # two more requests are being parsed
        first = asyncio.ensure_future(b.submit(np.ones((1, 1))))
        await asyncio.sleep(0.05)
        assert not first.done()  # waits for them
        second = asyncio.ensure_future(b.submit(np.ones((1, 1))))
        third = asyncio.ensure_future(b.submit(np.ones((1, 1))))  # all 3 held: go
        await asyncio.gather(first, second, third)
        await b.stop()
        return rec, alone

    rec, alone = run(main())
    assert alone < 4.0
    assert rec.batches == [[1], [1, 1, 1]]


class Lanes:
    """compute() for the lane tests: a batch with a pass blocks until `release` is set; every call
    is recorded as (kinds, sizes, shared) and the most calls seen running at once is kept."""

    def __init__(self):
        import threading

        self.release = threading.Event()
        self.calls: list[tuple[tuple[str, ...], list[int], bool]] = []
        self.running = self.most = 0
        self._lock = threading.Lock()

    def __call__(self, jobs, shared=False):
        with self._lock:
            self.calls.append((tuple(sorted({j.kind for j in jobs})), [j.n for j in jobs], shared))
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            if any(j.kind == "logits" for j in jobs):
                assert self.release.wait(10), "the test never released the pass"
            return [j.x * 2 for j in jobs]
        finally:
            with self._lock:
                self.running -= 1


def test_a_backbone_job_is_answered_while_a_pass_computes_in_the_other_lane():
    async def main():
        lanes = Lanes()
        b = Batcher(lanes, max_batch=8, max_delay_ms=0, lanes=2)
        b.start()
        first_pass = asyncio.ensure_future(b.submit(np.ones((1, 1)), "logits"))
        await asyncio.sleep(0.05)  # computing (blocked) in lane 0
        second_pass = asyncio.ensure_future(b.submit(np.ones((1, 1)), "logits"))  # queued ahead of the detect
        embed = await asyncio.wait_for(b.submit(np.full((1, 1), 3.0), "embed"), 5)
        passes_done = first_pass.done() or second_pass.done()
        lanes.release.set()
        await asyncio.gather(first_pass, second_pass)
        await b.stop()
        return lanes, embed, passes_done

    lanes, embed, passes_done = run(main())
    assert float(embed[0, 0]) == 6.0 and not passes_done
    # the detect went beside the running pass (one thread), the second pass waited for a free lane
    assert lanes.calls == [(("logits",), [1], False), (("embed",), [1], True), (("logits",), [1], False)]


def test_with_one_lane_a_backbone_job_waits_for_the_pass_ahead_of_it():
    async def main():
        lanes = Lanes()
        b = Batcher(lanes, max_batch=8, max_delay_ms=0, lanes=1)
        b.start()
        first_pass = asyncio.ensure_future(b.submit(np.ones((1, 1)), "logits"))
        await asyncio.sleep(0.05)
        embed = asyncio.ensure_future(b.submit(np.ones((1, 1)), "embed"))
        await asyncio.sleep(0.1)
        waited = not embed.done()
        lanes.release.set()
        await asyncio.gather(first_pass, embed)
        await b.stop()
        return lanes, waited

    lanes, waited = run(main())
    assert waited and all(not shared for _, _, shared in lanes.calls)


def _one_then_three(lanes: Lanes, kind: str, first_value: float = 1.0, **batcher) -> Lanes:
    """Two lanes: one job of `kind` computes (blocked) while three more arrive, then all are answered."""
    async def main():
        b = Batcher(lanes, max_batch=64, max_delay_ms=0, lanes=2, **batcher)
        b.start()
        first = asyncio.ensure_future(b.submit(np.full((1, 1), first_value), kind))
        await asyncio.sleep(0.05)
        later = [asyncio.ensure_future(b.submit(np.ones((1, 1)), kind)) for _ in range(3)]
        await asyncio.sleep(0.1)
        lanes.release.set()
        await asyncio.gather(first, *later)
        await b.stop()

    run(main())
    return lanes


def test_a_backbone_job_does_not_start_beside_another_backbone_batch_but_joins_the_next():
    class SlowFirst(Lanes):
        def __call__(self, jobs, shared=False):
            if float(jobs[0].x[0, 0]) == 99.0:  # the first batch stands for a slow backbone batch
                assert self.release.wait(10)
            return super().__call__(jobs, shared)

    lanes = _one_then_three(SlowFirst(), "embed", first_value=99.0)
    assert lanes.calls == [(("embed",), [1], False), (("embed",), [1, 1, 1], False)]


def test_a_pass_never_starts_beside_another_but_waits_to_join_the_next_batch():
    lanes = _one_then_three(Lanes(), "logits", in_flight=lambda: 8)
    assert [sizes for _, sizes, _ in lanes.calls] == [[1], [1, 1, 1]] and lanes.most == 1


@pytest.mark.parametrize("lanes", [1, 2])
def test_the_next_batch_reaches_the_worker_before_the_last_one_is_answered(lanes):
    """A full queue after a batch: the worker gets the next batch before the loop answers the last one
    (answering 64 requests takes the loop milliseconds the worker would otherwise sit idle)."""
    async def main():
        lanes_ = Lanes()
        b = Batcher(lanes_, max_batch=2, max_delay_ms=0, lanes=lanes)
        events: list[str] = []
        for worker in b._workers:
            handed = worker.run

            def run_and_note(fn, *args, handed=handed):
                events.append("handed")
                return handed(fn, *args)
            worker.run = run_and_note
        b.start()

        async def request(i: int):
            out = await b.submit(np.full((1, 1), float(i)), "logits")
            events.append(f"answered {i}")
            return out

        tasks = [asyncio.ensure_future(request(i)) for i in range(4)]
        await asyncio.sleep(0.05)  # the first batch computes (blocked), the second waits in the queue
        lanes_.release.set()
        outs = await asyncio.gather(*tasks)
        await b.stop()
        return events, outs

    events, outs = run(main())
    assert [float(o[0, 0]) for o in outs] == [0.0, 2.0, 4.0, 6.0]
    assert events[:3] == ["handed", "handed", "answered 0"]


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_full_batch_waiting_behind_a_pass_starts_when_it_ends_without_the_loop(lanes):
    """While a pass computes, a full batch of passes waiting is queued in the same worker: it starts
    the moment the pass ends, even while the event loop is busy (here: blocked outright)."""
    import threading

    class Passes(Lanes):
        def __init__(self):
            super().__init__()
            self.second_started = threading.Event()

        def __call__(self, jobs, shared=False):
            if len(self.calls) == 1:  # the second batch: noted before it computes
                self.second_started.set()
            return super().__call__(jobs, shared)

    async def main():
        passes = Passes()
        b = Batcher(passes, max_batch=2, max_delay_ms=0, lanes=lanes)
        b.start()
        tasks = [asyncio.ensure_future(b.submit(np.full((1, 1), float(i)), "logits")) for i in range(4)]
        await asyncio.sleep(0.05)  # the first batch computes (blocked), the second fills the queue
        staged = b.pending_inputs == 0
        passes.release.set()
        started_with_loop_blocked = passes.second_started.wait(10)  # the loop runs nothing meanwhile
        outs = await asyncio.gather(*tasks)
        await b.stop()
        return staged, started_with_loop_blocked, outs, passes.most

    staged, started, outs, most = run(main())
    assert staged and started and most == 1
    assert [float(o[0, 0]) for o in outs] == [0.0, 2.0, 4.0, 6.0]


def test_a_batch_short_of_full_is_not_staged_behind_a_pass():
    async def main():
        lanes = Lanes()
        b = Batcher(lanes, max_batch=4, max_delay_ms=0, lanes=2, in_flight=lambda: 8)
        b.start()
        first = asyncio.ensure_future(b.submit(np.ones((1, 1)), "logits"))
        await asyncio.sleep(0.05)  # computing (blocked)
        later = [asyncio.ensure_future(b.submit(np.ones((1, 1)), "logits")) for _ in range(3)]
        await asyncio.sleep(0.05)
        waiting = b.pending_inputs  # three of four: they wait for the pass to end, and for mates
        more = asyncio.ensure_future(b.submit(np.ones((1, 1)), "logits"))
        await asyncio.sleep(0.05)
        lanes.release.set()
        await asyncio.gather(first, *later, more)
        await b.stop()
        return waiting, lanes

    waiting, lanes = run(main())
    assert waiting == 3
    assert [sizes for _, sizes, _ in lanes.calls] == [[1], [1, 1, 1, 1]] and lanes.most == 1


def test_a_request_that_gives_up_leaves_the_queue_at_once():
    async def main():
        lanes = Lanes()
        b = Batcher(lanes, max_batch=8, max_delay_ms=0, lanes=1)
        b.start()
        running = asyncio.ensure_future(b.submit(np.ones((1, 1)), "logits"))
        await asyncio.sleep(0.05)  # computing (blocked): the next ones wait in the queue
        given_up = asyncio.ensure_future(b.submit(np.ones((3, 1)), "logits"))
        kept = asyncio.ensure_future(b.submit(np.ones((2, 1)), "logits"))
        await asyncio.sleep(0)
        queued_before = b.pending_inputs
        given_up.cancel()
        await asyncio.sleep(0)
        queued_after = b.pending_inputs
        lanes.release.set()
        await asyncio.gather(running, kept)
        await b.stop()
        return lanes, queued_before, queued_after, b.pending_inputs

    lanes, before, after, end = run(main())
    assert (before, after, end) == (5, 2, 0)
    assert [sizes for _, sizes, _ in lanes.calls] == [[1], [2]]  # the cancelled request was never computed


async def _refused_behind_a_stall(b: Batcher, hold, queued_inputs: list) -> Overloaded:
    """The refusal of one more input while a pass stalls on an input of 9.0 (until `hold` is set) and
    `queued_inputs` wait behind it; then the stall is released, everything answered and `b` stopped."""
    blocker = asyncio.ensure_future(b.submit(np.full((1, 1), 9.0), "logits"))
    await asyncio.sleep(0.05)
    queued = [asyncio.ensure_future(b.submit(x, "logits")) for x in queued_inputs]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded) as refused:
        await b.submit(np.ones((1, 1)), "logits")
    hold.set()
    await asyncio.gather(blocker, *queued)
    await b.stop()
    return refused.value


def test_retry_after_counts_each_kind_at_its_own_rate():
    """Queued passes are worked off at the pass rate, however fast the backbone batches in between were."""
    import threading
    import time

    hold = threading.Event()

    def compute(jobs, shared=False):
        if jobs[0].kind == "logits":
            if float(jobs[0].x[0, 0]) == 9.0:
                assert hold.wait(10)
            else:
                time.sleep(0.3)  # a pass: at most 1 / 0.3 inputs/s
        return [j.x for j in jobs]

    async def main():
        b = Batcher(compute, max_batch=1, max_delay_ms=0, queue_size=6, lanes=1)
        b.start()
        await b.submit(np.ones((1, 1)), "logits")
        for _ in range(5):
            await b.submit(np.ones((1, 1)), "embed")  # fast batches after it
        return await _refused_behind_a_stall(b, hold, [np.ones((1, 1))] * 6)

    refused = run(main())
    assert refused.retry_after >= 2  # 6 queued passes at <= 3.3 inputs/s: at least 1.8 s


def test_retry_after_counts_a_pass_per_batch_not_per_input():
    """Passes measured on one input each (a lone client) do not make a queue of full batches look
    64 times longer: a pass costs about the same for 1 input or 64."""
    import threading
    import time

    hold = threading.Event()

    def compute(jobs, shared=False):
        if float(jobs[0].x[0, 0]) == 9.0:
            assert hold.wait(10)
        else:
            time.sleep(0.1)
        return [j.x for j in jobs]

    async def main():
        b = Batcher(compute, max_batch=64, max_delay_ms=0, queue_size=256, lanes=1)
        b.start()
        for _ in range(3):
            await b.submit(np.ones((1, 1)), "logits")  # 1-input passes of ~0.1 s
        return await _refused_behind_a_stall(b, hold, [np.ones((64, 1))] * 4)

    refused = run(main())
    assert refused.retry_after <= 2  # 4 full batches of ~0.1 s (per input, it would have read 26 s)


def test_compute_failure_fails_the_batch_and_keeps_serving():
    calls = []

    def compute(jobs, shared=False):
        calls.append(len(jobs))
        if len(calls) == 1:
            raise RuntimeError("boom")
        return [j.x for j in jobs]

    async def main():
        b = Batcher(compute, max_batch=8, max_delay_ms=0, queue_size=100)
        b.start()
        with pytest.raises(RuntimeError):
            await b.submit(np.ones((1, 1)))
        out = await b.submit(np.ones((1, 1)))
        await b.stop()
        return out

    assert run(main()).shape == (1, 1)


# ------------------------------------------------------------------- over HTTP, in-process


async def _with_app(app, fn):
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            for _ in range(500):
                if (await c.get("/v1/health/ready")).status_code == 200:
                    break
                await asyncio.sleep(0.01)
            return await fn(c)


def test_http_flood_gets_429_with_retry_after_then_recovers(app_factory, offline):
    app = app_factory(queue_size=4, max_delay_ms=300, max_batch=64, adaptive_delay=False)
    x = np.random.default_rng(0).standard_normal((1, 12)).astype(np.float32)

    async def flood(c):
        rs = await asyncio.gather(*(c.post("/v1/classes/2/detect", json={"inputs": x.tolist()}) for _ in range(12)))
        after = await c.post("/v1/classes/2/detect", json={"inputs": x.tolist()})
        metrics = (await c.get("/metrics")).text
        return rs, after, metrics

    rs, after, metrics = asyncio.run(_with_app(app, flood))
    codes = sorted(r.status_code for r in rs)
    assert codes.count(200) == 4 and codes.count(429) == 8, codes
    for r in rs:
        if r.status_code == 429:
            assert_envelope(r, 429, "overloaded")
            assert int(r.headers["retry-after"]) >= 1
        else:
            assert r.json()["results"][0]["logit"] == pytest.approx(offline.logits(x)[0, 2], abs=1e-4)
    assert after.status_code == 200
    assert 'slc_rejections_total{reason="overloaded"} 8.0' in metrics
    assert 'slc_batch_size_inputs_sum 5.0' in metrics  # 4 coalesced + 1 after


def test_http_deadline_gives_504(app_factory):
    app = app_factory(request_timeout_s=0.05, max_delay_ms=400, adaptive_delay=False)

    async def call(c):
        return await c.post("/v1/classes/2/detect", json={"inputs": [[0.0] * 12]})

    assert_envelope(asyncio.run(_with_app(app, call)), 504, "deadline_exceeded")


@pytest.mark.parametrize("patience,in_server,batches", [
    (0.0, 2, [[1], [1]]),  # no patience: max_delay (0) decides
    (5.0, 2, [[1, 1]]),  # two requests were in the server at once: the batch waits for the second
    (5.0, 1, [[1], [1]]),  # a lone client: no wait at all
])
def test_a_patient_job_waits_for_as_many_requests_as_were_in_the_server(patience, in_server, batches):
    async def main():
        rec = Recorder()
        b = Batcher(rec, max_batch=8, max_delay_ms=0, in_flight=lambda: in_server)
        b.start()
        first = asyncio.ensure_future(b.submit(np.ones((1, 2)), patience=patience))
        await asyncio.sleep(0.05)  # far past max_delay: only patience keeps the batch open
        second = await b.submit(np.ones((1, 2)))
        await first
        await b.stop()
        return rec.batches, second

    got, second = run(main())
    assert got == batches and second.tolist() == [[2.0, 2.0]]


def test_a_batch_waiting_for_a_request_that_gave_up_waits_on_the_next_ones_terms():
    """The first job's patience keeps its batch open; once it gives up, the next job's patience (not
    the cancelled one's) decides, so it does not leave alone at the cancelled job's flush time."""
    async def main():
        rec = Recorder()
        b = Batcher(rec, max_batch=8, max_delay_ms=0, in_flight=lambda: 2)
        b.start()
        first = asyncio.ensure_future(b.submit(np.ones((1, 2)), patience=0.3))
        await asyncio.sleep(0.05)
        first.cancel()
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(b.submit(np.ones((1, 2)), patience=5.0))
        await asyncio.sleep(0.4)  # past the cancelled job's flush time
        third = asyncio.ensure_future(b.submit(np.ones((1, 2))))
        await asyncio.gather(second, third)
        await b.stop()
        return rec.batches

    assert run(main()) == [[1, 1]]


def test_a_patient_batch_goes_as_soon_as_the_expected_requests_are_there():
    async def main():
        rec = Recorder()
        b = Batcher(rec, max_batch=8, max_delay_ms=0, in_flight=lambda: 2)
        b.start()
        t0 = asyncio.get_running_loop().time()
        await asyncio.gather(b.submit(np.ones((1, 2)), patience=30.0), b.submit(np.ones((1, 2))))
        waited = asyncio.get_running_loop().time() - t0
        await b.stop()
        return rec.batches, waited

    got, waited = run(main())
    assert got == [[1, 1]] and waited < 30.0  # both there: no wait for the patience to run out


class ThreadRecorder(Recorder):
    """Recorder that also notes which thread computed each batch."""

    def __init__(self, sleep: float = 0.0):
        super().__init__(sleep)
        self.threads: list[str] = []

    def __call__(self, jobs, shared=False):
        import threading

        self.threads.append(threading.current_thread().name)
        return super().__call__(jobs)


def _one_at_a_time(batcher: Batcher, kind: str, count: int):
    async def main():
        batcher.start()
        outs = [await batcher.submit(np.full((1, 2), float(i)), kind) for i in range(count)]
        await batcher.stop()
        return outs

    return run(main())


def test_a_cheap_backbone_batch_runs_on_the_event_loop_once_measured():
    rec = ThreadRecorder()
    outs = _one_at_a_time(Batcher(rec, max_delay_ms=0, inline_max_s=1.0), "embed", 4)
    assert rec.threads[0] == "slc-batch"  # not measured yet: the worker measures it
    assert rec.threads[1:] == ["MainThread"] * 3
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(out, np.full((1, 2), 2.0 * i))


@pytest.mark.parametrize("kind", ["logits", "index"])
def test_a_pass_over_the_head_or_an_index_search_never_runs_on_the_event_loop(kind):
    rec = ThreadRecorder()
    _one_at_a_time(Batcher(rec, max_delay_ms=0, inline_max_s=1.0), kind, 3)
    assert rec.threads == ["slc-batch"] * 3


def test_a_backbone_batch_costlier_than_the_inline_bound_stays_on_the_worker():
    rec = ThreadRecorder(sleep=0.005)
    _one_at_a_time(Batcher(rec, max_delay_ms=0, inline_max_s=0.001), "embed", 3)
    assert rec.threads == ["slc-batch"] * 3


def test_inline_bound_zero_means_always_the_worker():
    rec = ThreadRecorder()
    _one_at_a_time(Batcher(rec, max_delay_ms=0, inline_max_s=0.0), "embed", 3)
    assert rec.threads == ["slc-batch"] * 3


def test_an_inline_batch_that_fails_fails_its_requests_and_keeps_serving():
    calls = []

    def compute(jobs, shared=False):
        calls.append(len(jobs))
        if len(calls) == 2:  # the second batch, the first one computed inline
            raise RuntimeError("boom")
        return [j.x for j in jobs]

    async def main():
        b = Batcher(compute, max_delay_ms=0, inline_max_s=1.0)
        b.start()
        first = await b.submit(np.ones((1, 1)))
        second = await asyncio.gather(b.submit(np.ones((1, 1))), return_exceptions=True)
        third = await b.submit(np.full((1, 1), 3.0))
        await b.stop()
        return first, second[0], third

    first, second, third = run(main())
    assert first.shape == (1, 1) and isinstance(second, RuntimeError) and float(third[0, 0]) == 3.0


def test_the_worker_passes_results_and_errors_back_in_order():
    from serving.core.batcher import Worker

    async def main():
        w = Worker("test-worker")
        try:
            ok = await asyncio.gather(*(w.run(lambda i=i: i * i) for i in range(20)))
            with pytest.raises(ZeroDivisionError):
                await w.run(lambda: 1 / 0)
            cancelled = w.run(__import__("time").sleep, 0.05)
            cancelled.cancel()  # nobody waits any more: the result is dropped, the worker goes on
            after = await w.run(lambda: "after")
        finally:
            w.shutdown()
        return ok, after

    ok, after = run(main())
    assert ok == [i * i for i in range(20)] and after == "after"


def test_a_size_measured_dear_on_the_worker_is_measured_again_on_the_loop():
    """A cost read high on the worker (the loop busy on the other core) must not keep a cheap batch
    off the loop for good: a batch of that size is probed on the loop and its loop cost rules."""
    import serving.core.batcher as batcher_mod

    calls = []

    class Skewed(ThreadRecorder):
        def __call__(self, jobs, shared=False):  # dear on the worker, cheap on the loop
            import threading
            import time as _time

            calls.append(threading.current_thread().name)
            if threading.current_thread().name != "MainThread":
                _time.sleep(0.003)
            return super().__call__(jobs)

    rec = Skewed()
    count = batcher_mod.INLINE_PROBE_EVERY + 6
    _one_at_a_time(Batcher(rec, max_delay_ms=0, inline_max_s=0.001), "embed", count)
    first_probe = calls.index("MainThread")
    assert calls[:first_probe] == ["slc-batch"] * first_probe and first_probe == batcher_mod.INLINE_PROBE_EVERY  # batch 0 measures; the probe comes INLINE_PROBE_EVERY batches later
    assert calls[first_probe:] == ["MainThread"] * (count - first_probe)  # measured cheap there: stays


def test_a_size_far_above_the_bound_is_never_probed_on_the_loop():
    rec = ThreadRecorder(sleep=0.02)
    import serving.core.batcher as batcher_mod

    _one_at_a_time(Batcher(rec, max_delay_ms=0, inline_max_s=0.001), "embed", batcher_mod.INLINE_PROBE_EVERY + 3)
    assert set(rec.threads) == {"slc-batch"}


def _admitted(queue_size: int, sharers: int, floods: list[tuple[int, int]]) -> list[list[bool]]:
    """Brute force of the rule the lane keeps for several models: each of `sharers` models keeps
    queue_size // (2 * sharers) inputs of the queue for itself; a job joins when the queue holds, after
    it, at most the queue less the other models' unused reserves. floods: (owner, jobs of one input)."""
    reserve = queue_size // (2 * sharers) if sharers > 1 else 0
    queued = [0] * sharers
    out = []
    for owner, count in floods:
        row = []
        for _ in range(count):
            unused = sum(max(0, reserve - q) for o, q in enumerate(queued) if o != owner)
            total = sum(queued)
            ok = total == 0 or total + 1 <= queue_size - unused
            queued[owner] += ok
            row.append(ok)
        out.append(row)
    return out


@pytest.mark.parametrize("sharers,floods", [
    (1, [(0, 40)]),
    (2, [(0, 40), (1, 40)]),
    (3, [(0, 40), (1, 3), (2, 40), (0, 5)]),
    (4, [(2, 40), (0, 2), (1, 40), (3, 40)]),
])
def test_a_model_flooding_a_shared_lane_leaves_the_others_their_reserve(sharers, floods):
    """Models sharing one backbone lane: while a computing batch holds the lane, each model floods it in
    turn; which jobs are admitted and which get 429 is what the brute-force rule says, every model
    gets its reserve whatever the ones before it did, and every admitted job is answered."""
    import threading

    hold, started = threading.Event(), threading.Event()

    def compute(jobs, shared=False):
        started.set()
        assert hold.wait(10)
        return [j.x * 2 for j in jobs]

    owners = [object() for _ in range(sharers)]

    async def main():
        b = Batcher(compute, max_batch=64, max_delay_ms=0, queue_size=24, lanes=1)
        b.sharers = sharers
        b.start()
        blocker = asyncio.ensure_future(b.submit(np.zeros((1, 1)), owner=owners[0]))
        while not started.is_set():  # the blocker left the queue for the worker, which waits on `hold`
            await asyncio.sleep(0.01)
        seen, futures = [], []
        for owner, count in floods:
            row = []
            for i in range(count):
                try:
                    fut = asyncio.ensure_future(b.submit(np.full((1, 1), float(i)), owner=owners[owner]))
                    await asyncio.sleep(0)  # queued (or refused) before the next one is asked
                    if fut.done() and isinstance(fut.exception(), Overloaded):
                        row.append(False)
                        continue
                    futures.append((fut, float(i)))
                    row.append(True)
                except Overloaded:
                    row.append(False)
            seen.append(row)
        hold.set()
        answers = await asyncio.gather(blocker, *(f for f, _ in futures))
        await b.stop()
        return seen, answers[1:], [v for _, v in futures]

    seen, answers, values = run(main())
    assert seen == _admitted(24, sharers, floods)
    assert [float(a[0, 0]) for a in answers] == [2 * v for v in values]
    if sharers > 1:  # every model's first flood gets at least its reserve, after whatever the others did
        firsts = {}
        for (owner, count), row in zip(floods, seen):
            firsts.setdefault(owner, (count, row))
        assert all(sum(row) >= min(count, 24 // (2 * sharers)) for count, row in firsts.values())


@pytest.mark.parametrize("sharers", [1, 2])
def test_a_shared_lane_takes_the_models_jobs_in_turn(sharers):
    """A flood of model A queued before two jobs of model B, behind a batch holding the lane: with one
    model the next batches are first come, first served; on a lane shared by two models each batch takes
    one job of each model in turn, so B's jobs ride in the first batch after the one that held the lane.
    Each job gets its own rows back."""
    import threading

    hold, started = threading.Event(), threading.Event()
    batches = []

    def compute(jobs, shared=False):
        started.set()
        assert hold.wait(10)
        batches.append([(j.owner, float(j.x[0, 0])) for j in jobs])
        return [j.x * 2 for j in jobs]

    a, b = "A", "B"

    async def main():
        bt = Batcher(compute, max_batch=4, max_delay_ms=0, queue_size=64, lanes=1)
        bt.sharers = sharers
        bt.start()
        blocker = asyncio.ensure_future(bt.submit(np.zeros((1, 1)), owner=a))
        while not started.is_set():
            await asyncio.sleep(0.01)
        jobs = [(a, float(i)) for i in range(1, 9)] + [(b, 100.0), (b, 101.0)]
        futures = []
        for owner, v in jobs:
            futures.append(asyncio.ensure_future(bt.submit(np.full((1, 1), v), owner=owner)))
            await asyncio.sleep(0)
        hold.set()
        answers = await asyncio.gather(blocker, *futures)
        await bt.stop()
        return jobs, answers[1:]

    jobs, answers = run(main())
    assert [float(r[0, 0]) for r in answers] == [2 * v for _, v in jobs]
    # the brute-force order: first come first served, or one job of each model in turn (A's model first)
    if sharers == 1:
        expected = jobs
    else:
        queues = {o: [j for j in jobs if j[0] == o] for o in (a, b)}
        expected = []
        while any(queues.values()):
            for o in (a, b):
                if queues[o]:
                    expected.append(queues[o].pop(0))
    taken = [job for batch in batches[1:] for job in batch]
    assert taken == expected and all(len(batch) <= 4 for batch in batches)
    assert (b, 100.0) in batches[1] if sharers == 2 else (b, 100.0) not in batches[1]
