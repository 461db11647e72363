"""`slc bench scale` and `slc bench index` (the trainer's `slc bench losses` lives in trainer/cli.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import click

from serving.bundle.cliopts import OUT, POSITIVE, key_values, require


def _classes(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        classes = sorted({int(c) for c in value.split(",") if c.strip()})
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}", ctx, param) from None
    if not classes or classes[0] < 2:
        raise click.BadParameter(f"every D must be >= 2, got {value!r}", ctx, param)
    return classes


@click.command()
@click.option("--classes", default="10,1000,100000,1000000", show_default=True, callback=_classes, help="comma list of D")
@click.option("--dim", type=click.IntRange(min=1), default=256, show_default=True, help="embedding size d")
@click.option("--duration", type=POSITIVE, default=8.0, show_default=True, help="measured seconds per endpoint and D")
@click.option("--concurrency", type=click.IntRange(min=1), default=8, show_default=True, help="closed-loop workers")
@click.option("--peer/--no-peer", default=True, show_default=True, help="also measure the plain torch peer (train extra)")
@click.option("--default-model/--no-default-model", default=True, show_default=True,
              help="also measure detect on the default model")
@click.option("--out", default="docs/results", show_default=True, help="where scale.{json,md,png} go", **OUT)
def scale(classes: list[int], dim: int, duration: float, concurrency: int, peer: bool, default_model: bool,
          out: Path) -> None:
    """Single-logit vs full softmax as D grows: OUT/scale.{json,md,png}."""
    from serving.bench.report import scale_markdown
    from serving.bench.run import run_scale_bench

    require("matplotlib", "bench")  # scale.png, written after the sweep
    res = run_scale_bench(classes=classes, dim=dim, duration=duration, out=out, concurrency=concurrency,
                          with_peer=peer, default_model=default_model)
    click.echo(scale_markdown(res))
    missed = [t["target"] for t in res["targets"] if t["met"] is False]
    click.echo(f"{len(res['rows'])} sizes in {res['elapsed_s']:.0f} s -> {out / 'scale.md'}; "
               f"targets met {sum(t['met'] is True for t in res['targets'])}/{len(res['targets'])}"
               + (f"; missed: {'; '.join(missed)}" if missed else ""))


@click.command()
@click.option("--classes", type=click.IntRange(min=2), default=100_000, show_default=True, help="rows of the synthetic head")
@click.option("--dim", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--rows", type=click.Choice(["gaussian", "clustered"]), default="gaussian", show_default=True)
@click.option("--kind", type=click.Choice(["exact", "flat", "ivf", "hnsw"]), help="[default: the server's choice for this D]")
@click.option("--param", "params", multiple=True, callback=key_values,
              help="k=v build parameter (nlist, rerank, codes, ...), repeatable")
@click.option("--batch", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--work", default="/tmp/slc-index-bench", show_default=True,
              help="where the head and the index cache are kept between runs", **OUT)
def index(classes: int, dim: int, rows: str, kind: Optional[str], params: dict, batch: int, work: Path) -> None:
    """Build time, memory, recall@10 and speed-up vs exact of the top-k index on a synthetic head.
    The first run writes the head; run again for memory figures that exclude writing it."""
    from serving.bench.index import run_index_bench

    report = run_index_bench(classes, dim, rows, work, kind=kind, params=params, batch=batch)
    click.echo(json.dumps(report, indent=1))
    click.echo(f"{report['info'].get('kind')} index over {classes:,} rows: open {report['open_seconds']} s, "
               f"recall@10 {report['near_row']['recall_at_10']} (near-row queries), "
               f"{report['near_row']['speedup_batch']}x exact per batch")
