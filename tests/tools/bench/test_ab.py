"""`slc bench ab`: the summary's arithmetic against hand computation, and two real servers of two
checkouts, each answering with its own code."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from slc.cli import main

ROOT = Path(__file__).resolve().parents[3]


def _blocks(rps_by_side: dict, cpu_s: float = 0.5) -> dict:
    """Blocks of 1 s each with the given req/s per round, and cpu_s server seconds per block."""
    return {side: [{"ok": int(r), "errors": 0, "window_s": 1.0, "server_cpu_s": cpu_s} for r in rps]
            for side, rps in rps_by_side.items()}


def test_summary_ratio_is_the_ratio_of_summed_requests_and_cpu_per_request_is_seconds_over_requests():
    from tools.bench.ab import summarize

    s = summarize(_blocks({"base": [100, 200, 300, 400, 500, 600], "head": [110, 190, 300, 420, 480, 600]}))
    assert s["head_over_base"] == pytest.approx(2100 / 2100)
    assert s["base"]["rps"] == pytest.approx(2100 / 6) and s["head"]["requests"] == 2100
    assert s["base"]["server_cpu_us"] == pytest.approx(6 * 0.5 / 2100 * 1e6)
    assert s["head_faster_rounds"] == 2 and s["rounds"] == 6
    lo, hi = s["interval95"]
    assert lo <= 1.0 <= hi and s["verdict"] == "equal within noise"


def test_summary_calls_a_constant_speed_up_faster_and_a_constant_slow_down_slower():
    from tools.bench.ab import summarize

    base = [100, 120, 90, 110, 105, 95, 130, 80]
    up = summarize(_blocks({"base": base, "head": [2 * r for r in base]}))
    assert up["interval95"] == pytest.approx([2.0, 2.0]) and up["verdict"] == "head faster"
    down = summarize(_blocks({"base": base, "head": [r // 2 for r in base]}))
    assert down["interval95"][1] < 1.0 and down["verdict"] == "head slower"


def test_summary_with_too_few_rounds_gives_no_verdict():
    from tools.bench.ab import MIN_ROUNDS, summarize

    s = summarize(_blocks({"base": [100] * (MIN_ROUNDS - 1), "head": [200] * (MIN_ROUNDS - 1)}))
    assert s["head_over_base"] == pytest.approx(2.0) and s["verdict"].startswith("too few rounds")


def test_interval_matches_a_direct_bootstrap_over_paired_rounds():
    """The interval resamples rounds with their pairs: a loop over the same draws gives the same bounds."""
    from tools.bench.ab import BOOTSTRAP, _interval

    rng = np.random.default_rng(7)
    base = rng.uniform(900, 1100, 12)
    head = base * rng.uniform(0.95, 1.05, 12)
    draws = np.random.default_rng(0).integers(0, 12, size=(BOOTSTRAP, 12))
    ratios = [sum(head[i] for i in row) / sum(base[i] for i in row) for row in draws]
    assert _interval(base, head) == pytest.approx(tuple(np.percentile(ratios, [2.5, 97.5])))


def test_a_directory_that_is_not_a_checkout_is_refused_before_any_server_starts(tmp_path, capsys):
    try:
        main(["bench", "ab", "--base", str(tmp_path), "--out", str(tmp_path / "out")])
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and "is not an slc checkout" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.integration
def test_each_side_is_served_by_its_own_checkout(bundle_path, tmp_path):
    """A copy of this checkout whose detect answers 409 as base: every base block fails, every head
    block succeeds, so the two servers really run two trees."""
    from tools.bench.ab import ab_markdown, run_ab

    base = tmp_path / "base"
    for pkg in ("slc", "serving"):
        shutil.copytree(ROOT / pkg, base / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    v1 = base / "serving" / "http" / "v1.py"
    line = '    return 200, await engine.detect(cls, x, p["threshold"])'
    assert line in v1.read_text()
    v1.write_text(v1.read_text().replace(line, '    return 409, {"error": {"code": "base_copy", "message": "base"}}'))
    work = tmp_path / "work"
    work.mkdir()
    r = run_ab(base, ROOT, {50: bundle_path}, work, ["detect"], rounds=2, block=0.3)
    s = r["sizes"]["50"]["detect"]
    assert s["base"]["requests"] == 0 and s["base"]["errors"] > 0
    assert s["head"]["requests"] > 0 and s["head"]["errors"] == 0
    assert s["verdict"] == "base answered nothing" and r["base"]["tree"] == str(base.resolve())
    assert "base answered nothing" in ab_markdown(r, "slc bench ab")
    w = r["warm_up"]["50"]
    assert w["starts"]["base"] >= 1 and w["starts"]["head"] >= 1 and isinstance(w["base"]["softmax_impl"], str)
    assert w["matched"] == (w["base"] == w["head"])


class _FakeServer:
    def __init__(self, tag: str, choices: dict):
        self.tag, self.choices, self.stopped = tag, choices, False

    def wait_ready(self, timeout: float) -> float:
        return 0.0

    def stop(self) -> None:
        self.stopped = True


def test_head_and_base_are_restarted_in_turn_until_their_warm_up_choices_agree(monkeypatch, tmp_path):
    """Warm-up timings choose the softmax pass and the one-thread batch range. A base that chose the
    odd pass is restarted too: head, base, head ... until both chose alike; the others are stopped."""
    from tools.bench import ab

    common, odd = {"softmax_impl": "onnx"}, {"softmax_impl": "packed_pair"}
    draws = {"base": iter([odd, common]), "head": iter([common, common])}
    started = []

    def fake_server(tree, bundle, work, tag, grpc):
        srv = _FakeServer(tag, next(draws[tag.rstrip("0123456789")]))
        started.append(srv)
        return srv

    monkeypatch.setattr(ab, "checkout_server", fake_server)
    monkeypatch.setattr(ab, "warm_up_choices", lambda srv: srv.choices)
    servers, info = ab._start_matched({"base": tmp_path, "head": tmp_path}, tmp_path, tmp_path, False, tries=6)
    assert [s.tag for s in started] == ["base1", "head1", "head2", "base2"]
    assert [s.stopped for s in started] == [True, True, False, False]
    assert servers == {"head": started[2], "base": started[3]}
    assert info == {"base": common, "head": common, "starts": {"base": 2, "head": 2}, "matched": True}


def test_after_the_last_try_a_mismatch_is_kept_and_reported(monkeypatch, tmp_path):
    from tools.bench import ab

    monkeypatch.setattr(ab, "checkout_server",
                        lambda tree, bundle, work, tag, grpc: _FakeServer(tag, {"softmax_impl": tag[:4]}))
    monkeypatch.setattr(ab, "warm_up_choices", lambda srv: srv.choices)
    servers, info = ab._start_matched({"base": tmp_path, "head": tmp_path}, tmp_path, tmp_path, False, tries=3)
    assert info["starts"] == {"base": 2, "head": 3} and not info["matched"]
    assert not servers["head"].stopped and not servers["base"].stopped
    assert "still different after 2 start(s) of the base, 3 of the head" in ab._choices_line(info)


def test_warm_up_choices_are_counted_per_checkout_and_size_and_every_server_stopped(monkeypatch, tmp_path):
    from tools.bench import warm_up_choices as wc

    draws = iter([{"softmax_impl": "onnx", "one_thread_backbone_max_batch": 32},
                  {"softmax_impl": "numpy", "one_thread_backbone_max_batch": 0}] * 6)
    started = []

    def fake_server(tree, bundle, work, tag, grpc):
        srv = _FakeServer(tag, next(draws))
        started.append(srv)
        return srv

    monkeypatch.setattr(wc, "checkout_server", fake_server)
    monkeypatch.setattr(wc, "warm_up_choices", lambda srv: srv.choices)
    monkeypatch.setattr(wc, "cached_bundle", lambda D, dim: tmp_path / f"D{D}")
    counts = wc.count_choices({"head": tmp_path, "base": tmp_path}, [10, 1000], starts=3)
    assert counts["head"][10] == {("onnx", 32): 3} and counts["base"][1000] == {("numpy", 0): 3}
    assert len(started) == 12 and all(s.stopped for s in started)
    md = wc.choices_markdown(counts, {"head": tmp_path, "base": tmp_path}, 3, "cmd")
    assert "onnx / 32: 3" in md and "numpy / 0: 3" in md
