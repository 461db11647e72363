"""The commands of the experiments and training benchmarks: `slc experiment table1 / glyphs /
calibration`, `slc bench losses / head`. Composed into `slc` by slc/cli.py (imported only when one
of them runs); above trainer/ (it imports the trainer's option checks), never imported by it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import click

from serving.bundle.cliopts import OUT, POSITIVE, guarded
from tools.report import write_result
from trainer.augment import AUGMENTS
from trainer.cli import DATASET
from trainer.losses import list_losses
from trainer.sharded_head import sharded_losses


@click.group(no_args_is_help=True)
def experiment() -> None:
    """Paper experiments."""


def _floats(ctx: click.Context, param: click.Parameter, value: str) -> list[float]:
    try:
        return [float(x) for x in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {value!r}", ctx, param) from None


def _losses(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    names = [x for x in value.split(",") if x]
    if bad := [x for x in names if x not in list_losses()]:
        raise click.BadParameter(f"unknown loss {bad[0]!r}; choose from {', '.join(list_losses())}", ctx, param)
    return names


@experiment.command("glyphs")
@click.option("--dataset", default="glyphs3755", show_default=True, **DATASET)
@click.option("--seeds", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--epochs", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--lr", type=POSITIVE, default=3e-3, show_default=True, help="Adam learning rate of every row when --lrs is empty")
@click.option("--width", type=click.IntRange(min=1), default=16, show_default=True, help="resnet_glyph width")
@click.option("--lrs", default="0.001,0.003,0.01", show_default=True,
              help="the paper's protocol: a comma grid of learning rates, each row's chosen by calibration-face "
              "accuracy after --search-steps (empty: --lr for every row)")
@click.option("--search-steps", type=click.IntRange(min=1), default=250, show_default=True)
@click.option("--precision", type=click.Choice(("fp32", "bf16")), default="bf16", show_default=True)
@click.option("--patience", type=click.IntRange(min=0), default=0, show_default=True,
              help="full runs stop after N epochs without a better calibration accuracy")
@click.option("--augment", type=click.Choice(AUGMENTS), default="none", show_default=True)
@click.option("--runs", "runs_dir", type=click.Path(path_type=Path), default=None,
              help="run cache [default: $SLC_HOME/runs/glyphs]")
@click.option("--report-only", is_flag=True, help="write the table from the cached runs; train nothing")
@click.option("--evaluate/--no-evaluate", default=True, show_default=True,
              help="evaluate finished runs not yet evaluated (test face as users send it, detect; minutes a run), "
              "or report only the evaluations already made")
@click.option("--out", default="docs/results", show_default=True, **OUT)
@guarded("report folder")
def glyphs(dataset: str, seeds: int, epochs: int, lr: float, width: int, lrs: str, search_steps: int, patience: int,
           augment: str, precision: str, runs_dir: Optional[Path], report_only: bool, evaluate: bool, out: Path) -> None:
    """ce, max_margin, the five PoLS losses and two sampled heads on held-out typefaces (hours; resumable)."""
    import sys

    from serving.bundle import slc_home
    from tools.experiments.glyphs import GlyphPlan, glyph_experiment

    grid = tuple(_floats(None, None, lrs)) if lrs else ()
    plan = GlyphPlan(dataset=dataset, seeds=tuple(range(seeds)), epochs=epochs, lr=lr, width=width, lrs=grid,
                     search_steps=search_steps, patience=patience, augment=augment, precision=precision)
    command = (f"slc experiment glyphs --dataset {dataset} --seeds {seeds} --epochs {epochs} --lr {lr:g} --width {width}"
               + (f" --lrs {lrs} --search-steps {search_steps}" if grid else "")
               + (f" --patience {patience}" if patience else "") + (f" --augment {augment}" if augment != "none" else "")
               + (f" --precision {precision}" if precision != "bf16" else ""))
    res = glyph_experiment(plan, out, runs_dir or slc_home() / "runs" / "glyphs", command, progress=sys.stderr.isatty(),
                           train_missing=not report_only, evaluate_missing=evaluate)
    t = res["timing"]
    click.echo(f"glyphs: {len(res['rows']['test'])} rows, {t['runs_trained_now']} runs trained now "
               f"({t['elapsed_seconds'] / 60:.1f} min) -> {out / (dataset + '.md')}")


@experiment.command("calibration")
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", default="docs/results", show_default=True, **OUT)
@guarded("report folder", inputs=('runs',))
def calibration_experiment(runs: tuple[Path, ...], out: Path) -> None:
    """Per-class vs global vs shrunk thresholds, chosen on calibration, judged on the test faces."""
    from tools.experiments.calibration_study import study, write

    results = []
    for run in runs:
        if not (run / "checkpoint.pt").is_file():
            raise click.BadParameter(f"{run} is not a run directory (no checkpoint.pt)", param_hint="RUNS")
        results.append(study(run))
        click.echo(f"{run.name}: {len(results[-1]['rows'])} method x target rows", err=True)
    path = write(results, out, "slc experiment calibration " + " ".join(str(r) for r in runs))
    click.echo(f"calibration study of {len(runs)} run(s) -> {path}")


@experiment.command("thresholds")
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--target-precision", type=click.FloatRange(0.0, 1.0, min_open=True), default=0.99, show_default=True)
@click.option("--name", default="threshold-transfer", show_default=True, help="OUT/NAME.{json,md}")
@click.option("--out", default="docs/results", show_default=True, **OUT)
@guarded("report folder", inputs=('runs',))
def thresholds_experiment(runs: tuple[Path, ...], target_precision: float, name: str, out: Path) -> None:
    """Threshold rules fitted on one calibration face and judged on the other (and on the test face)."""
    from tools.experiments.threshold_transfer import study, write

    results = []
    for run in runs:
        if not (run / "checkpoint.pt").is_file():
            raise click.BadParameter(f"{run} is not a run directory (no checkpoint.pt)", param_hint="RUNS")
        results.append(study(run, target_precision))
        click.echo(f"{run.name}: {len(results[-1]['rows'])} rows", err=True)
    command = "slc experiment thresholds " + " ".join(str(r) for r in runs) + f" --target-precision {target_precision:g}"
    click.echo(f"threshold transfer of {len(runs)} run(s) -> {write(results, out, command, name)}")


@experiment.command("detect-table")
@click.argument("studies", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--name", default="detect-per-loss", show_default=True, help="OUT/NAME.{json,md}")
@click.option("--out", default="docs/results", show_default=True, **OUT)
@guarded("report folder", inputs=('studies',))
def detect_table_experiment(studies: tuple[Path, ...], name: str, out: Path) -> None:
    """Per loss and augmentation, over seeds: detect at the default threshold rule, from the JSON files of
    slc experiment thresholds."""
    from tools.experiments.detect_table import summarise, write

    results = []
    for path in studies:
        try:
            data = json.loads(path.read_text())
            results += data if isinstance(data, list) else [data]
        except (ValueError, OSError) as exc:
            raise click.BadParameter(f"{path}: not the JSON of slc experiment thresholds ({exc})", param_hint="STUDIES")
    try:
        entries = summarise(results)
    except (KeyError, ValueError, OSError) as exc:
        raise click.ClickException(f"cannot summarise these studies: {exc}")
    command = "slc experiment detect-table " + " ".join(str(p) for p in studies) + f" --name {name}"
    click.echo(f"{len(entries)} row(s) from {len(results)} run(s) -> {write(entries, out, command, name)}")


@experiment.command("user-calibration")
@click.argument("run", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--work", type=click.Path(file_okay=False, path_type=Path), help="where the bundles and PNGs go [temp]")
@click.option("--name", default="user-calibration", show_default=True, help="OUT/NAME.{json,md}")
@click.option("--out", default="docs/results", show_default=True, **OUT)
@click.option("--adapt-rows", is_flag=True, help="recalibrate with slc calibrate --adapt-rows")
@guarded("report folder", inputs=('run',))
def user_calibration_experiment(run: Path, work: Optional[Path], name: str, out: Path, adapt_rows: bool) -> None:
    """Detect on the test face over HTTP with PNG bodies, before and after slc calibrate on 2 images per class."""
    from tools.experiments.user_calibration import markdown, study
    from tools.report import write_result

    if not (run / "checkpoint.pt").is_file():
        raise click.BadParameter(f"{run} is not a run directory (no checkpoint.pt)", param_hint="RUN")
    r = study(run, work, ["--adapt-rows"] if adapt_rows else [])
    command = f"slc experiment user-calibration {run}" + (f" --work {work}" if work else "") + (
        f" --name {name}" if name != "user-calibration" else "") + (" --adapt-rows" if adapt_rows else "")
    path = write_result(out, name, lambda: markdown(r, command), r)[0]
    click.echo(f"recall {r['before']['recall']:.3f} -> {r['after']['recall']:.3f}, precision "
               f"{r['before']['precision']:.3f} -> {r['after']['precision']:.3f} -> {path}")


@experiment.command("adapt-no-forget")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--seeds", default="0,1,2", show_default=True, help="which 2 images per class of the test face are the user's")
@click.option("--cache", type=click.Path(file_okay=False, path_type=Path), help="keep the held-out faces' renderings here")
@click.option("--name", default="adapt-no-forget", show_default=True, help="OUT/NAME.{json,md}")
@click.option("--out", default="docs/results", show_default=True, **OUT)
@guarded("report folder", inputs=('bundle',))
def adapt_no_forget_experiment(bundle: Path, seeds: str, cache: Optional[Path], name: str, out: Path) -> None:
    """Per face of glyphs3755: detect as exported, and after recalibrating on 2 images per class of the test face."""
    from tools.experiments.adapt_no_forget import markdown, study
    from tools.report import write_result

    chosen = tuple(int(s) for s in seeds.split(","))
    r = study(bundle, chosen, cache=cache, partial=None if cache is None else cache / f"{name}.partial.json")
    command = f"slc experiment adapt-no-forget {bundle}" + (f" --seeds {seeds}" if seeds != "0,1,2" else "") + (
        f" --name {name}" if name != "adapt-no-forget" else "")
    click.echo(f"-> {write_result(out, name, lambda: markdown(r, command), r)[0]}")


@experiment.command("enroll")
@click.argument("run", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--work", type=click.Path(file_okay=False, path_type=Path), required=True, help="where the bundle goes")
@click.option("--name", default="enroll-glyphs3755", show_default=True, help="OUT/NAME.{json,md}")
@click.option("--out", default="docs/results", show_default=True, **OUT)
@guarded("report folder", inputs=('run',))
def enroll_experiment(run: Path, work: Path, name: str, out: Path) -> None:
    """GB2312's 3,008 level-2 characters enrolled from 1, 2 and 5 renderings, measured on the test face."""
    from tools.experiments.enroll_glyphs import markdown, study
    from tools.report import write_result

    if not (run / "checkpoint.pt").is_file():
        raise click.BadParameter(f"{run} is not a run directory (no checkpoint.pt)", param_hint="RUN")
    r = study(run, work)
    path = write_result(out, name, lambda: markdown(r, f"slc experiment enroll {run} --work {work}"), r)[0]
    five = r["after"]["5"]
    click.echo(f"5-shot: enrolled recall {five['enrolled']['recall']:.3f} (trained {five['trained']['recall']:.3f}), "
               f"pooled precision {five['enrolled']['pooled_precision']:.3f} -> {path}")


@experiment.command("table1")
@click.option("--dataset", default="mnist5k", show_default=True, **DATASET)
@click.option("--seeds", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--epochs", type=click.IntRange(min=1), default=30, show_default=True)
@click.option("--lrs", default="1,0.1,0.01,0.001", show_default=True, callback=_floats,
              help="learning rates searched per loss on the calibration split")
@click.option("--losses", default="", callback=_losses, help=f"comma list [default: all: {', '.join(list_losses())}]")
@click.option("--out", required=True, **OUT)
@guarded("report folder")
def table1(dataset: str, seeds: int, epochs: int, lrs: list[float], losses: list[str], out: Path) -> None:
    """The PoLS paper's Table 1: every loss, raw single logits, plus the normalized-CE row."""
    from tools.experiments.table1 import table1 as run_table1

    command = (f"slc experiment table1 --dataset {dataset} --seeds {seeds} --epochs {epochs} "
               f"--lrs {','.join(f'{x:g}' for x in lrs)}" + (f" --losses {','.join(losses)}" if losses else "")
               + f" --out {out}")
    res = run_table1(dataset=dataset, seeds=seeds, epochs=epochs, lrs=lrs, losses=losses or None, out=out,
                     command=command)
    p = res["protocol"]
    click.echo(f"table1: {len(res['rows'])} rows, {p['runs_trained']} runs trained, {p['runs_reused']} reused "
               f"-> {out / 'table1.md'}")


@click.command("losses")
@click.option("--out", default="docs/results", show_default=True, **OUT)
@guarded("report folder")
def bench_losses(out: Path) -> None:
    """Forward+backward time of smooth_topk against ce (C=1000, k=5, B=256)."""
    from tools.bench.losses import run_loss_bench

    res = run_loss_bench(out=out)
    click.echo((out / "losses-bench.md").read_text())
    st = res["methods"]["smooth_topk"]
    click.echo(f"smooth_topk: {st['median_ms']:.2f} ms per batch, {st['ratio_to_ce']:.1f}x ce -> {out / 'losses-bench.md'}")


@click.command("head")
@click.option("--classes", default="3755,100000,1000000", show_default=True, help="comma list of D")
@click.option("--dim", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--batch", type=click.IntRange(min=2), default=128, show_default=True)
@click.option("--rate", type=click.FloatRange(0.0, 1.0, min_open=True), default=0.1, show_default=True,
              help="R of the sampled head")
@click.option("--loss", "loss_name", type=click.Choice(sharded_losses()), default="ce", show_default=True)
@click.option("--train-classes", default="3755,100000", show_default=True,
              help="comma list of D for whole glyph-network training steps (empty: skip)")
@click.option("--out", default="docs/results", show_default=True, **OUT)
@guarded("report folder")
def bench_head(classes: str, dim: int, batch: int, rate: float, loss_name: str, train_classes: str, out: Path) -> None:
    """Training at many classes: head time per step (full, sampled, 2 shards) as D grows, and glyph-network images/s."""
    from tools.bench.head_train import head_bench_markdown, head_step_times, train_step_rates

    sizes, train_sizes = _ints(classes, "--classes"), _ints(train_classes, "--train-classes")
    rows, train_rows = [], []
    for D in sizes:
        rows.append(head_step_times(D, dim, batch, rate, loss_name))
        r = rows[-1]
        click.echo(f"head D={D:,}: full {r['full_ms']:.1f} ms, sampled {r['sampled_ms']:.1f} ms, "
                   f"{r['shards']} shards {r['sharded_ms']:.1f} ms per step", err=True)
    for D in train_sizes:
        train_rows.append(train_step_rates(D, rate=rate, loss=loss_name))
        r = train_rows[-1]
        click.echo(f"train D={D:,}: full {r['full_images_s']:.0f}, sampled {r['sampled_images_s']:.0f}, "
                   f"sharded {r['sharded_images_s']:.0f} images/s", err=True)
    command = (f"slc bench head --classes {classes} --dim {dim} --batch {batch} --rate {rate:g} --loss {loss_name} "
               f"--train-classes {train_classes}")
    write_result(out, "head-bench", lambda: head_bench_markdown(rows, train_rows, command), {"head": rows, "train": train_rows})
    click.echo(f"head bench: {len(rows)} head sizes, {len(train_rows)} training sizes -> {out / 'head-bench.md'}")


def _ints(value: str, hint: str) -> list[int]:
    try:
        return [int(c) for c in value.split(",") if c]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}", param_hint=hint) from None
