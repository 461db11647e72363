"""tools/bench/cpu.py: where the CPU goes under load, and the softmax ceiling it implies."""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from tools.bench import cpu


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds  # CPU time of the process: busy, whatever the machine's load
    while time.process_time() < end:
        sum(range(1000))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_cpu_of_another_thread_counts_as_workers_and_the_main_threads_as_loop():
    burnt, leave = threading.Event(), threading.Event()

    def work():  # a thread's CPU shows in /proc only while it lives, as the server's workers do
        _burn(0.5)
        burnt.set()
        leave.wait(30)

    worker = threading.Thread(target=work)
    before = cpu.snapshot(os.getpid())
    worker.start()
    assert burnt.wait(30)
    middle = cpu.snapshot(os.getpid())
    _burn(0.5)
    after = cpu.snapshot(os.getpid())
    leave.set()
    worker.join()
    in_thread = {k: middle[k] - before[k] for k in ("loop", "workers")}
    in_main = {k: after[k] - middle[k] for k in ("loop", "workers")}
    assert in_thread["workers"] >= 0.3 and in_thread["loop"] < 0.2
    assert in_main["loop"] >= 0.3 and in_main["workers"] < 0.2


def test_split_gives_cores_and_core_ms_per_request():
    before = {"wall": 10.0, "loop": 1.0, "workers": 2.0, "client": 0.5, "idle": 100, "total": 1000}
    after = {"wall": 14.0, "loop": 2.6, "workers": 7.0, "client": 0.9, "idle": 180, "total": 1800}
    out = cpu.split(before, after, requests_per_s=800.0)
    assert out["cores"] == {"loop": 0.4, "workers": 1.25, "client": 0.1}
    assert out["core_ms_per_request"] == {"loop": 0.5, "workers": 1.5625, "client": 0.125}
    assert out["idle_share"] == 0.1
    assert cpu.split(None, after, 800.0) is None and cpu.split(before, after, 0.0) is None


def test_the_ceiling_adds_the_loop_and_client_work_per_input_to_the_gemms_on_the_same_cores():
    # 2 cores; the bound is 1,000 inputs/s on both, so 2 core-ms of GEMM per input. Loop and
    # client take 1 core-ms per request of one input: 3 core-ms per input on 2 cores = 666.7/s.
    use = {"cpus": 2, "core_ms_per_request": {"loop": 0.8, "client": 0.2, "workers": 9.0}}
    assert cpu.ceiling_over_bound(use, 1000.0) == pytest.approx(666.666 / 1000, rel=1e-4)
    # 8 inputs per request: the per-request work spreads over them (2.125 core-ms per input)
    assert cpu.ceiling_over_bound(use, 1000.0, inputs_per_request=8) == pytest.approx(2 / 2.125 / 1000 * 1000, rel=1e-9)
    assert cpu.ceiling_over_bound(None, 1000.0) is None and cpu.ceiling_over_bound(use, None) is None
