"""The warm-up choice of the full-softmax pass: each strategy timed at a few clients' batch and at
the largest, the one of least summed cost per input kept."""
from __future__ import annotations

import pytest

from serving.core import compute


def test_a_strategy_slightly_ahead_at_the_largest_batch_loses_to_one_far_ahead_at_small_batches():
    """The case the choice got wrong: packed_pair 15 % behind onnx at 64 inputs, 1.5x at 8."""
    times = {"onnx": {8: 1.10e-3, 64: 3.84e-3}, "packed_pair": {8: 1.69e-3, 64: 3.27e-3}}
    assert compute.pick_strategy(times) == "onnx"


def test_the_choice_is_the_least_summed_cost_per_input_brute_force():

    import numpy as np

    rng = np.random.default_rng(0)
    names = ["numpy", "ort", "ort_pair", "onnx", "packed_pair"]
    for _ in range(200):
        times = {n: {8: float(rng.uniform(1e-3, 3e-3)), 64: float(rng.uniform(3e-3, 9e-3))} for n in names}
        cost = {n: times[n][8] / 8 + times[n][64] / 64 for n in names}
        chosen = compute.pick_strategy(times)
        best = min(cost.values())
        near = [n for n in names if cost[n] <= max(best * (1 + compute.CHOICE_TIE), best + compute.CHOICE_TIE_S)]
        assert chosen == sorted(near, key=compute.PREFERENCE.index)[0]


def test_a_near_tie_goes_to_the_preferred_strategy_whatever_the_noise():
    """A small head: every strategy within a few percent; the choice must not follow the noise."""
    for numpy_ms in (0.030, 0.031, 0.032):
        times = {"numpy": {8: numpy_ms, 64: 0.05}, "onnx": {8: 0.031, 64: 0.051}, "ort": {8: 0.0305, 64: 0.05}}
        assert compute.pick_strategy({k: {n: v / 1e3 for n, v in t.items()} for k, t in times.items()}) == "onnx"


def test_on_a_tiny_head_a_few_microseconds_per_input_are_a_tie():
    """D = 10: numpy 25 % cheaper than onnx, but by 1 µs per input against ~150 µs a request costs."""
    times = {"numpy": {8: 24e-6, 64: 150e-6}, "onnx": {8: 32e-6, 64: 200e-6}}
    assert compute.pick_strategy(times) == "onnx"
    far = {"numpy": {8: 24e-6, 64: 150e-6}, "onnx": {8: 80e-6, 64: 400e-6}}  # 5 µs per input: not a tie
    assert compute.pick_strategy(far) == "numpy"


def test_one_timed_size_reduces_to_the_fastest():
    assert compute.pick_strategy({"numpy": {4: 2.0}, "onnx": {4: 1.0}}) == "onnx"


def test_a_small_head_gets_the_preferred_strategy_without_a_race(client_factory):
    """D*d under SMALL_HEAD_VALUES (the test bundle): onnx, timed alone (its time sets the patience)."""
    client = client_factory(intra_op_threads=2, max_batch=32)
    model = client.get("/v1/model").json()
    assert model["softmax_impl"] == compute.PREFERENCE[0]
    assert set(model["softmax_timing_ms"]) == {compute.PREFERENCE[0]}
    assert set(model["softmax_timing_ms_by_batch"]) == {"8", "32"}


def test_the_server_serves_with_the_strategy_its_timings_choose(client_factory, monkeypatch):
    """Through the real warm-up with a race (every head counted large): the rule applied to the times
    the warm-up measured names the strategy the server serves with; /v1/model reports those times
    (rounded to µs) and the max_batch column as softmax_timing_ms."""
    monkeypatch.setattr(compute, "SMALL_HEAD_VALUES", 0)
    client = client_factory(intra_op_threads=2, max_batch=32)
    model = client.get("/v1/model").json()
    head_pass = client.app.state.slc.engine.head_pass
    assert set(head_pass.timing_by_batch) == {8, 32} and {"numpy", "ort", "ort_pair"} <= set(head_pass.timing_by_batch[8])
    times = {name: {n: head_pass.timing_by_batch[n][name] for n in (8, 32)} for name in head_pass.timing_by_batch[8]}
    assert model["softmax_impl"] == head_pass.name == compute.pick_strategy(times)
    reported = model["softmax_timing_ms_by_batch"]
    for n, by_name in head_pass.timing_by_batch.items():
        assert reported[str(n)] == pytest.approx({k: v * 1e3 for k, v in by_name.items()}, abs=1e-3)
    assert model["softmax_timing_ms"] == reported["32"]


def _fake_paths(monkeypatch, head_pass, cost: dict[str, float]) -> list[str]:
    """Each path's batch advances a fake clock by cost[name] seconds; returns the log of batches run."""
    from types import SimpleNamespace

    clock, calls = {"t": 0.0}, []
    monkeypatch.setattr(compute, "time", SimpleNamespace(perf_counter=lambda: clock["t"]))

    def strategy(name):
        def run(x, h, parts):
            calls.append(name)
            clock["t"] += cost[name]
        return run

    monkeypatch.setattr(head_pass, "_strategy", strategy)
    return calls


def test_a_path_slower_than_its_bound_is_timed_once_after_its_first_batch(client_factory, monkeypatch):
    import math

    import numpy as np

    head_pass = client_factory(max_batch=8).app.state.slc.engine.head_pass
    calls = _fake_paths(monkeypatch, head_pass, {"fast": 1.0, "slow": 10.0})
    x = np.zeros((2,) + tuple(head_pass.bundle.input_shape), np.float32)
    assert head_pass._time("fast", x) == 1.0 and calls.count("fast") == 4  # warm-up + best of 3
    assert head_pass._time("slow", x, bound=4.0) == 10.0 and calls.count("slow") == 2  # warm-up + 1
    assert head_pass._time("slow", x, bound=math.inf) == 10.0 and calls.count("slow") == 6


def test_on_a_race_the_device_is_timed_first_and_far_slower_paths_stop_early(client_factory, monkeypatch):
    monkeypatch.setattr(compute, "SMALL_HEAD_VALUES", 0)
    head_pass = client_factory(max_batch=16).app.state.slc.engine.head_pass
    cost = {"numpy": 0.5, "ort": 0.03, "device": 0.01}  # ort within PRUNE x of device, numpy not
    calls = _fake_paths(monkeypatch, head_pass, cost)
    monkeypatch.setattr(head_pass, "_candidates", lambda: ["numpy", "ort", "device"])
    monkeypatch.setattr(head_pass, "_drop_unused", lambda: None)
    head_pass.choose()
    assert calls[0] == "device" and head_pass.name == "device"
    sizes = len(head_pass.timing_by_batch)
    assert calls.count("device") == calls.count("ort") == 4 * sizes and calls.count("numpy") == 2 * sizes
    assert head_pass.timing == pytest.approx(cost)
