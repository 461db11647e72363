"""The `slc` command line (DESIGN.md §8).

Each command imports its module lazily, so `slc serve` works in an image without torch.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Single-logit classification: train, export, serve, measure.")
experiment_app = typer.Typer(no_args_is_help=True, help="Paper experiments.")
bundle_app = typer.Typer(no_args_is_help=True, help="Bundles that need no training.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks written to docs/results.")
app.add_typer(experiment_app, name="experiment")
app.add_typer(bundle_app, name="bundle")
app.add_typer(bench_app, name="bench")


def _parse_params(items: list[str]) -> dict:
    """k=v pairs; values parsed as JSON when they can be (numbers, lists), else strings."""
    import json

    out = {}
    for item in items:
        if "=" not in item:
            raise typer.BadParameter(f"expected k=v, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


@app.command()
def train(
    dataset: str = typer.Option(..., help="digits | mnist5k | synthetic[:C=..,d=..,sep=..] | npz:PATH"),
    backbone: str = typer.Option("mlp"),
    loss: str = typer.Option("batch_ce"),
    loss_param: List[str] = typer.Option([], "--loss-param", help="k=v, repeatable"),
    backbone_param: List[str] = typer.Option([], "--backbone-param", help="k=v, repeatable"),
    epochs: int = typer.Option(20),
    lr: float = typer.Option(0.01),
    batch_size: int = typer.Option(128),
    optimizer: str = typer.Option("adam", help="adam | sgd"),
    schedule: str = typer.Option("cosine", help="cosine | constant"),
    weight_decay: float = typer.Option(0.0),
    seed: int = typer.Option(0),
    out: Path = typer.Option(..., help="run directory"),
):
    """Fit a backbone + class head with a loss; writes config, checkpoint and metrics to OUT."""
    from trainer.train import TrainConfig, train as run_train

    cfg = TrainConfig(
        dataset=dataset, backbone=backbone, backbone_params=_parse_params(backbone_param), loss=loss,
        loss_params=_parse_params(loss_param), epochs=epochs, lr=lr, batch_size=batch_size,
        optimizer=optimizer, schedule=schedule, weight_decay=weight_decay, seed=seed,
    )
    run_train(cfg, out)


@app.command()
def evaluate(run: Path, split: str = typer.Option("test", help="calibration | test")):
    """Single-logit metrics of a trained run on a split."""
    from trainer.train import evaluate_run

    evaluate_run(run, split=split, print_table=True)


@experiment_app.command("table1")
def table1(
    dataset: str = typer.Option("mnist5k"),
    seeds: int = typer.Option(3),
    epochs: int = typer.Option(30),
    lrs: str = typer.Option("1,0.1,0.01,0.001", help="learning rates searched per loss on the calibration split"),
    losses: str = typer.Option("", help="comma list; default every registered loss"),
    out: Path = typer.Option(...),
):
    """The PoLS paper's Table 1: every loss, raw single logits, plus the normalized-CE row."""
    from trainer.experiments import table1 as run_table1

    run_table1(dataset=dataset, seeds=seeds, epochs=epochs, lrs=[float(x) for x in lrs.split(",")],
               losses=[x for x in losses.split(",") if x] or None, out=out)


@app.command("export")
def export(
    run: Path,
    out: Path = typer.Option(...),
    target_precision: Optional[float] = typer.Option(None),
    target_recall: Optional[float] = typer.Option(None),
):
    """Write the ONNX bundle (DESIGN.md §6) of a trained run, calibrated on the calibration split."""
    from trainer.export import export_bundle

    export_bundle(run, out, target_precision=target_precision, target_recall=target_recall)


@app.command()
def verify(bundle: Path):
    """Re-check hashes, graphs, samples and calibration of a bundle; non-zero exit on any mismatch."""
    from serving.bundle import verify_bundle

    problems = verify_bundle(bundle)
    if problems:
        for p in problems:
            typer.echo(f"FAIL {p}", err=True)
        raise typer.Exit(1)
    typer.echo(f"OK {bundle}")


@bundle_app.command("synthetic")
def bundle_synthetic(
    classes: int = typer.Option(..., help="D"),
    dim: int = typer.Option(256, help="d"),
    input_dim: int = typer.Option(64),
    seed: int = typer.Option(0),
    rows: str = typer.Option("clustered", help="clustered (rows share directions, like trained heads) | gaussian (i.i.d., worst case for an index)"),
    out: Path = typer.Option(...),
):
    """A bundle with a random backbone and D random class rows, for scale work."""
    from trainer.synthetic import build_synthetic_bundle

    build_synthetic_bundle(classes=classes, dim=dim, input_dim=input_dim, seed=seed, out=out, rows=rows)


@app.command()
def serve(
    bundle: Optional[Path] = typer.Argument(None, help="bundle directory; default: the embedded model"),
    host: Optional[str] = typer.Option(None),
    port: Optional[int] = typer.Option(None),
    data_dir: Optional[Path] = typer.Option(None),
    max_batch: Optional[int] = typer.Option(None),
    max_delay_ms: Optional[float] = typer.Option(None),
    queue_size: Optional[int] = typer.Option(None),
    device: Optional[str] = typer.Option(None, help="auto | cpu | cuda"),
):
    """Serve a bundle over HTTP (DESIGN.md §7). Flags override SLC_* environment variables."""
    from serving.main import run_server

    overrides = dict(bundle=bundle, host=host, port=port, data_dir=data_dir, max_batch=max_batch,
                     max_delay_ms=max_delay_ms, queue_size=queue_size, device=device)
    run_server({k: v for k, v in overrides.items() if v is not None})


@app.command()
def loadtest(
    url: str = typer.Option(...),
    endpoint: str = typer.Option("detect", help="detect | softmax | topk, comma list to interleave"),
    class_: Optional[str] = typer.Option(None, "--class"),
    concurrency: Optional[int] = typer.Option(None),
    rate: Optional[float] = typer.Option(None),
    duration: float = typer.Option(10.0),
    warmup: float = typer.Option(2.0),
    max_requests: Optional[int] = typer.Option(None),
    batch: int = typer.Option(1, help="inputs per request"),
    allow_remote: bool = typer.Option(False),
    out: Path = typer.Option(...),
):
    """Load a running server; writes report.json, report.md, latency.png to OUT."""
    from serving.loadtest import run_loadtest_cli

    run_loadtest_cli(url=url, endpoints=endpoint.split(","), class_=class_, concurrency=concurrency, rate=rate,
                     duration=duration, warmup=warmup, max_requests=max_requests, batch=batch,
                     allow_remote=allow_remote, out=out)


@bench_app.command("scale")
def bench_scale(
    classes: str = typer.Option("10,1000,100000,1000000"),
    dim: int = typer.Option(256),
    duration: float = typer.Option(8.0),
    out: Path = typer.Option(Path("docs/results")),
):
    """Single-logit vs full softmax as D grows: docs/results/scale.{json,md,png}."""
    from serving.bench import run_scale_bench

    run_scale_bench(classes=[int(c) for c in classes.split(",")], dim=dim, duration=duration, out=out)


@bench_app.command("losses")
def bench_losses(out: Path = typer.Option(Path("docs/results"))):
    """Forward+backward time of smooth_topk against ce (C=1000, k=5, B=256)."""
    from trainer.losses.bench import run_loss_bench

    run_loss_bench(out=out)


if __name__ == "__main__":
    app()
