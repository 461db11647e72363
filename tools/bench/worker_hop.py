"""What the hop to the batcher's worker thread costs one request (issue 36: the part of a GPU softmax's
latency that neither detect nor the device pass accounts for). One connection against a small
synthetic bundle: detect with its backbone inline on the event loop (the default for cheap batches)
and through the worker (SLC_INLINE_MAX_MS=0), and softmax (a pass over the head always goes to the
worker), in alternating server starts.

    python -m tools.bench.worker_hop [--rounds 2] [--duration 8]

One JSON line: p50 ms per setting and round, and the median difference worker − inline.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import click
import numpy as np


@click.command()
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True, help="server starts per setting")
@click.option("--duration", type=click.FloatRange(min=1.0), default=8.0, show_default=True, help="measured seconds a start")
def main(rounds: int, duration: float) -> None:
    """detect inline vs through the worker, and softmax, one connection: p50 ms."""
    from tools import loadtest as lt
    from tools.bench.run import cached_bundle
    from tools.bench.server import slc_server
    from tools.loadtest.stats import endpoint_summary

    bundle = cached_bundle(1000, 64)
    out: dict[str, list] = {}
    with tempfile.TemporaryDirectory(prefix="slc-hop-") as tmp:
        for r in range(rounds):
            for tag, env in (("inline", {}), ("worker", {"SLC_INLINE_MAX_MS": "0"})):
                with slc_server(bundle, Path(tmp), f"{tag}{r}", Path(tmp) / f"data-{tag}{r}", env=env) as srv:
                    srv.wait_ready(300)
                    rep = lt.run_loadtest(srv.url, ["detect", "softmax"], concurrency=1, duration=duration,
                                          warmup=1.0, interleave="request").report
                    s = endpoint_summary(rep)
                    out.setdefault(tag, []).append({k: round(s[k]["p50_ms"], 3) for k in ("detect", "softmax")})
    hop = float(np.median([w["detect"] - i["detect"] for w, i in zip(out["worker"], out["inline"])]))
    click.echo(json.dumps({"p50_ms": out, "worker_minus_inline_detect_ms": round(hop, 3)}))


if __name__ == "__main__":
    main()
