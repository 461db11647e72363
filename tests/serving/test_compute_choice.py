"""The warm-up choice of the full-softmax pass: every strategy timed in interleaved rounds, the
fastest kept; a busy moment that hits one strategy in one round does not decide."""
from __future__ import annotations

import pytest

from serving.core import compute


class _Clock:
    """perf_counter that advances only when a batch runs, by the cost the batch is given."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _batches(clock: _Clock, costs: dict[str, list[float]], calls: list[str]) -> dict:
    def make(name):
        seen = iter(costs[name])

        def run():
            calls.append(name)
            clock.now += next(seen)
        return run
    return {name: make(name) for name in costs}


def test_every_strategy_runs_once_per_round_in_rotated_order(monkeypatch):
    clock, calls = _Clock(), []
    monkeypatch.setattr(compute.time, "perf_counter", clock)
    compute._best_interleaved(_batches(clock, {n: [1.0] * 3 for n in "abc"}, calls), rounds=3)
    assert calls == list("abc" "bca" "cab")


def test_a_busy_round_does_not_decide_the_choice(monkeypatch):
    """onnx is the faster strategy but its first round was slowed by a neighbour; the best of the
    rounds still finds it, with the times of the quiet rounds."""
    clock, calls = _Clock(), []
    monkeypatch.setattr(compute.time, "perf_counter", clock)
    costs = {"onnx": [9.0, 3.0, 3.1, 3.2, 3.0], "packed_pair": [4.5, 4.6, 4.4, 4.7, 4.5]}
    best = compute._best_interleaved(_batches(clock, costs, calls), rounds=5)
    assert best == pytest.approx({"onnx": 3.0, "packed_pair": 4.4})
    assert min(best, key=best.get) == "onnx"


def test_the_server_times_every_allowed_strategy_and_keeps_the_fastest(client_factory):
    """Through the real warm-up: /v1/model names the chosen pass and each candidate's time; the
    chosen one has the smallest."""
    model = client_factory(intra_op_threads=2).get("/v1/model").json()
    timing = model["softmax_timing_ms"]
    assert {"numpy", "ort", "ort_pair"} <= set(timing)
    assert model["softmax_impl"] == min(timing, key=timing.get)
