"""`slc bundle synthetic`: a bundle with random weights, for scale work (no torch)."""
from __future__ import annotations

import time
from pathlib import Path

import click

from serving.bundle.cliopts import OUT, bundle_dir as existing_bundle
from serving.bundle.synthetic import ROW_KINDS


@click.group(no_args_is_help=True)
def bundle() -> None:
    """Bundles without training, and Triton model repositories."""


@bundle.command()
@click.option("--classes", type=click.IntRange(min=1), required=True, help="number of classes D")
@click.option("--dim", type=click.IntRange(min=1), default=256, show_default=True, help="embedding size d")
@click.option("--input-dim", type=click.IntRange(min=1), default=64, show_default=True,
              help="input size of the random backbone")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--rows", type=click.Choice(ROW_KINDS), default="clustered", show_default=True,
              help="clustered: rows share directions, like trained heads; gaussian: i.i.d., the worst case for an index")
@click.option("--out", required=True, help="bundle directory (replaced)", **OUT)
def synthetic(classes: int, dim: int, input_dim: int, seed: int, rows: str, out: Path) -> None:
    """A bundle with a random backbone and D random class rows, for scale work."""
    from serving.bundle.synthetic import build_synthetic_bundle

    t0 = time.perf_counter()
    build_synthetic_bundle(classes=classes, dim=dim, input_dim=input_dim, seed=seed, out=out, rows=rows)
    head_mb = classes * (dim + 1) * 4 / 2**20
    click.echo(f"bundle {out}: {classes:,} {rows} classes, d={dim}, head {head_mb:,.1f} MiB "
               f"({time.perf_counter() - t0:.1f} s)  -> slc verify {out}; slc serve {out}")


@bundle.command()
@click.argument("bundle_dir", metavar="BUNDLE", type=click.Path(path_type=Path), callback=existing_bundle)
@click.option("--out", required=True, help="model repository directory (replaced)", **OUT)
@click.option("--max-batch", type=click.IntRange(min=1), default=64, show_default=True, help="Triton max_batch_size")
@click.option("--delay-us", type=click.IntRange(min=0), default=2000, show_default=True,
              help="dynamic batching: max_queue_delay_microseconds")
def triton(bundle_dir: Path, out: Path, max_batch: int, delay_us: int) -> None:
    """A Triton model repository (onnxruntime backend) serving the bundle's three graphs."""
    from serving.bundle.triton import write_triton_repository

    models = write_triton_repository(bundle_dir, out, max_batch, delay_us)
    click.echo(f"triton repository {out}: {', '.join(models)}  -> tritonserver --model-repository {out}")
