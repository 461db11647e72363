"""The trainer's commands: train, evaluate, export, data glyphs (experiments and benchmarks: tools/cli.py).

Composed into `slc` by slc/cli.py, which imports this module only when one of these runs
(it imports torch through the registries, whose names are the choices). Choices are checked
before any work starts: a bad dataset, loss, backbone, optimizer or schedule, an unwritable
--out or a count below 1 is one line and exit 2.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import click

from models import check_backbone_name, list_backbones
from serving.bundle.cliopts import OUT, POSITIVE, RUN_MARKERS, guarded, key_values, slc_command
from serving.calibration.defaults import NORM_MIN_NEGATIVES
from trainer.data import check_dataset_name, dataset_choices
from trainer.losses import list_losses
from trainer.augment import AUGMENTS
from trainer.device import DEVICES, PRECISIONS
from trainer.train import OPTIMIZERS, SCHEDULES

RUN_FILES = ("config.json", "data.json", "checkpoint.pt")


def _dataset(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Optional[str]:
    if value is None:
        return None
    try:
        check_dataset_name(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None
    return value


def _run_dir(ctx: click.Context, param: click.Parameter, value: Path) -> Path:
    missing = [name for name in RUN_FILES if not (value / name).is_file()]
    if missing == ["checkpoint.pt"] and (value / "checkpoints").is_dir():
        status = json.loads((value / "config.json").read_text()).get("status", "running")
        raise click.BadParameter(f"{value} has not finished training ({status}); continue it with "
                                 f"{slc_command()} train --resume {value}", ctx, param)
    if missing:
        raise click.BadParameter(f"{value} is not a run directory of `slc train` (missing {', '.join(missing)})",
                                 ctx, param)
    return value


DATASET = dict(callback=_dataset, help=f"one of: {dataset_choices()} (docs/datasets.md)")
RUN = dict(type=click.Path(path_type=Path), callback=_run_dir)


def _backbone(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if value == "auto":
        return value
    try:
        check_backbone_name(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None
    return value


def _image_size(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Optional[tuple[int, int]]:
    if value is None:
        return None
    h, _, w = value.lower().partition("x")
    try:
        size = (int(h), int(w or h))
    except ValueError:
        raise click.BadParameter(f"expected HxW or N (pixels), got {value!r}", ctx, param) from None
    if min(size) < 4 or max(size) > 4096:
        raise click.BadParameter(f"image size {size[0]}x{size[1]} out of range 4..4096", ctx, param)
    return size


def _model_options() -> list:
    """What is trained: data, backbone and loss (with their keyword parameters)."""
    return [
        click.option("--dataset", **DATASET),
        click.option("--backbone", default="auto", show_default=True, callback=_backbone,
                     help=f"auto (resnet_glyph for images, else mlp), one of {', '.join(list_backbones())}, "
                          "or timm:NAME (docs/backbones.md)"),
        click.option("--weights", type=click.Path(exists=True, path_type=Path),
                     help="starting backbone weights: an earlier slc run (its folder: its backbone and "
                          "backbone parameters too, unless given), or a local state dict (.pt/.pth) or "
                          ".safetensors file (docs/backbones.md)"),
        click.option("--loss", type=click.Choice(list_losses()), default="batch_ce", show_default=True,
                     help="loss of docs/losses.md"),
        click.option("--loss-param", "loss_params", multiple=True, callback=key_values,
                     help="k=v keyword of the loss, repeatable"),
        click.option("--backbone-param", "backbone_params", multiple=True, callback=key_values,
                     help="k=v keyword of the backbone, repeatable"),
    ]


def _optimisation_options() -> list:
    """How it is fitted: epochs, optimizer, schedule, budget and the head's sampling or sharding."""
    return [
        click.option("--epochs", type=click.IntRange(min=1),
                     help="[default: 20, more when that makes fewer than 150 steps; below 1,024 training examples, "
                          "a budget of 3 times that, stopped by --patience (docs/training.md: Defaults on small data)]"),
        click.option("--lr", type=POSITIVE, default=0.01, show_default=True),
        click.option("--batch-size", type=click.IntRange(min=2),
                     help="the global batch [default: 128, less on small data: the largest power of two from 16 "
                          "to 128 giving 8 batches an epoch]"),
        click.option("--optimizer", type=click.Choice(OPTIMIZERS), default="adam", show_default=True),
        click.option("--schedule", type=click.Choice(SCHEDULES), default="cosine", show_default=True),
        click.option("--max-steps", type=click.IntRange(min=0), default=0, show_default=True,
                     help="a budget: stop after N steps, the schedule ending there (0: --epochs decide; with "
                          "--epochs unset below 1,024 training examples, the convergence budget)"),
        click.option("--warmup-steps", type=click.IntRange(min=-1), default=-1, show_default=True,
                     help="linear LR warmup; -1 = 5%% of the steps, at most 1,000"),
        click.option("--clip-grad-norm", type=click.FloatRange(min=0.0), default=0.0, show_default=True,
                     help="clip the gradient norm to this; 0 = off (the norm is logged either way)"),
        click.option("--weight-decay", type=click.FloatRange(min=0.0), default=0.0, show_default=True),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--head-sample", type=click.FloatRange(0.0, 1.0, min_open=True), default=1.0, show_default=True,
                     help="R: each step computes logits for the batch's classes plus a uniform sample of the "
                          "others, R·D columns (Partial FC); 1 = the full head"),
        click.option("--head-shard", is_flag=True,
                     help="under torchrun: each rank holds D/world class rows; features are all-gathered and the "
                          "loss's reductions over classes are all-reduces (Partial FC)"),
    ]


def _runtime_options() -> list:
    """Where and how fast it runs: device, precision, compile, data loading and image decoding."""
    return [
        click.option("--device", default="auto", show_default=True, help=f"{DEVICES}: auto takes CUDA when present"),
        click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True,
                     help="bf16 / fp16 autocast (fp16: CUDA, with a gradient scaler)"),
        click.option("--channels-last", is_flag=True, help="NHWC memory layout for conv backbones"),
        click.option("--compile", is_flag=True, help="torch.compile the network"),
        click.option("--workers", type=click.IntRange(min=0), default=0, show_default=True,
                     help="DataLoader worker processes (the batches are the same for any number)"),
        click.option("--augment", type=click.Choice(AUGMENTS),
                     help="geometry: seeded scale (0.4-1.15), shift and small rotation of image examples "
                          "[default: none; geometry for an image folder trained to convergence (--epochs unset "
                          "below 1,024 training examples; docs/training.md: Defaults on small data)]"),
        click.option("--image-size", callback=_image_size, help="imagefolder/csv: decode images to HxW "
                     "[default: the pretrained backbone's size, else by the images (docs/datasets.md)]"),
        click.option("--channels", type=click.Choice(["1", "3"]), help="imagefolder/csv: grey (1) or RGB (3)"),
        click.option("--skip-bad-images", is_flag=True, help="count and skip unreadable image files instead of refusing"),
    ]


def _validation_options() -> list:
    """Validation, early stopping, checkpoints and logs of the run."""
    return [
        click.option("--val-every", type=click.IntRange(min=0),
                     help="validate on the calibration split every N epochs (0: never) [default: 1; past 20 "
                          "epochs, ceil(epochs/20), unless training to convergence]"),
        click.option("--patience", type=click.IntRange(min=0),
                     help="early stopping: stop after N validations without a better accuracy (0: off) [default: "
                          "off; 10 (and at least 100 steps' worth) when --epochs is left unset below 1,024 "
                          "training examples, unless augmented (an image folder's default: the whole budget)]"),
        click.option("--restore-best/--no-restore-best", default=True, show_default=True,
                     help="export the best validated weights, not the last"),
        click.option("--checkpoint-every", type=click.IntRange(min=0), default=0, show_default=True,
                     help="save the training state every N steps too (0: at epoch ends only)"),
        click.option("--keep-checkpoints", type=click.IntRange(min=1), default=2, show_default=True),
        click.option("--tensorboard", is_flag=True, help="also write TensorBoard events to RUN/tensorboard"),
    ]


def _train_options(f):
    """The training recipe's options, in the order `slc train --help` lists them."""
    options = _model_options() + _optimisation_options() + _runtime_options() + _validation_options()
    for option in reversed(options):
        f = option(f)
    return f


@click.command()
@_train_options
@click.option("--out", help="run directory to create (config, checkpoints, history, metrics)", **OUT)
@click.option("--resume", "resume", type=click.Path(path_type=Path, file_okay=False),
              help="continue the interrupted run RUN from its newest checkpoint (other options but --epochs ignored)")
@guarded("run", inputs=(lambda p: _data_path(p.get("dataset")),), in_place="resume",
         target=lambda p: p.get("out") or p.get("resume"))
def train(out: Optional[Path], overwrite: bool, resume: Optional[Path], **options) -> None:
    """Fit a backbone + class head with a loss; writes config, checkpoints, history and metrics to OUT."""
    from trainer.train import TrainingInterrupted, train as run_train

    cfg, out = _train_config(out, resume, options)
    t0 = time.perf_counter()
    try:
        run_train(cfg, out, resume=resume is not None, overwrite=overwrite)
    except TrainingInterrupted as exc:
        click.echo(str(exc), err=True)
        raise SystemExit(130) from None
    except ValueError as exc:  # the run's options against its data: one line
        raise click.UsageError(str(exc)) from None
    _summary(out, time.perf_counter() - t0)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from trainer.distributed import exit_rank

        exit_rank()  # a torchrun worker whose work is written (a rank was seen to abort in teardown)


def _data_path(dataset: Optional[str]) -> Optional[Path]:
    """The dataset's own folder or file, when it has one (the run folder may not hold it nor lie in it)."""
    if not dataset or not dataset.startswith(("imagefolder:", "csv:", "npz:")):
        return None
    from trainer.data.imagefiles import dataset_path

    path = dataset_path(dataset)
    return path if path.exists() else None


def _train_config(out: Optional[Path], resume: Optional[Path], options: dict):
    """(TrainConfig, run directory): from the options, or from the run to resume."""
    from trainer.train import TrainConfig, resume_config

    if resume is not None:
        if out is not None and Path(out).resolve() != resume.resolve():
            raise click.UsageError("--resume continues the run in place: leave out --out")
        try:
            return resume_config(resume, options["epochs"]), resume
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--resume") from None
    if options["dataset"] is None or out is None:
        raise click.UsageError("give --dataset and --out (or --resume RUN)")
    size, channels = options.pop("image_size"), options.pop("channels")
    _weights_of(options)
    image = {"height": size[0], "width": size[1]} if size else {}
    if channels:
        image["channels"] = int(channels)
    cfg = TrainConfig(**options, image=image or None)
    _check_params(cfg)
    return cfg, out


def _weights_of(options: dict) -> None:
    """--weights as a file path; a run's folder gives its checkpoint, and its backbone with its
    parameters when the command names no backbone of its own."""
    weights = options["weights"]
    if weights is not None and weights.is_dir():
        if not all((weights / name).is_file() for name in RUN_MARKERS):
            raise click.BadParameter(f"{weights} is a folder but not a training run (no {' / '.join(RUN_MARKERS)})",
                                     param_hint="--weights")
        source = json.loads((weights / "config.json").read_text())
        if options["backbone"] == "auto" and not options["backbone_params"]:
            options["backbone"], options["backbone_params"] = source["backbone"], source.get("backbone_params", {})
        weights = weights / "checkpoint.pt"
    options["weights"] = str(weights.resolve()) if weights is not None else None


def _summary(out: Path, seconds: float) -> None:
    metrics_path = out / "metrics.json"
    if metrics_path.is_file() and os.environ.get("RANK", "0") == "0":  # one summary under torchrun
        test = json.loads(metrics_path.read_text())["test"]
        chosen = json.loads((out / "config.json").read_text()).get("kept_weights", {})
        best = f" (best epoch {chosen['best_epoch'] + 1})" if chosen.get("chosen") == "best" else ""
        click.echo(f"trained {out} in {seconds:.0f} s{best}: test accuracy {test['accuracy']:.4f}, "
                   f"auprc {test['auprc']:.4f}, p@r0.99 {test['p_at_r99']:.4f}; curves {out / 'curves.png'}"
                   f"  -> next: {slc_command()} export {out} --out BUNDLE")
        for line in _convergence(out):
            click.echo(line)


def _convergence(out: Path) -> list[str]:
    """Whether the run converged (config.json's verdict, trainer/defaults.py), then the too-short
    warning, unless the verdict already says the run stopped while improving."""
    from trainer.defaults import convergence_line

    config = json.loads((out / "config.json").read_text())
    verdict = config.get("convergence")
    converge = (config.get("defaults") or {}).get("stopping") == "converge"
    lines = [line] if (line := convergence_line(verdict, config["epochs"], int(config.get("step", config["steps"])),
                                                 converge)) else []
    warning = _short_run(out)
    if warning and not (verdict and not verdict["converged"] and "still rising" in warning):
        lines.append(warning)
    return lines


def _short_run(out: Path) -> str | None:
    """trainer/defaults.py's too-short warning from the run's steps and validations (history.csv)."""
    import csv

    from trainer.defaults import short_run_warning

    config, cal = json.loads((out / "config.json").read_text()), []
    if (out / "history.csv").is_file():
        with open(out / "history.csv", newline="") as f:
            cal = [float(r["cal_accuracy"]) for r in csv.DictReader(f) if r["kind"] == "epoch" and r["cal_accuracy"]]
    return short_run_warning(int(config.get("step", config["steps"])), cal, bool(config.get("stopped_early")))


def _check_params(cfg) -> None:
    """Loss, backbone and device checked before any data is loaded."""
    from trainer.device import check_precision, resolve_device
    from models.keywords import check_keywords
    from trainer.losses import loss_class
    from trainer.train import check_head_options

    try:
        check_head_options(cfg)
        check_precision(cfg.precision, resolve_device(cfg.device))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None

    try:  # names and kinds: values that depend on the dataset (nce's q) are checked when training starts
        check_keywords(loss_class(cfg.loss), cfg.loss_params, f"loss {cfg.loss}", skip=("num_classes",))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--loss-param") from None
    _check_backbone(cfg)


def _check_backbone(cfg) -> None:
    """The backbone's keywords (for `auto`, those of a backbone it may choose) and that the weights
    file reads as a state dict; whether the weights fit is known when the data gives the input."""
    from models import check_backbone_params
    from models.timm_backbone import read_state_dict
    from trainer.train import AUTO_BACKBONES

    names = AUTO_BACKBONES if cfg.backbone == "auto" else (cfg.backbone,)
    errors = []
    for name in names:
        try:
            check_backbone_params(name, cfg.backbone_params)
        except ValueError as exc:
            errors.append(str(exc))
    if len(errors) == len(names):
        raise click.BadParameter("; ".join(errors), param_hint="--backbone-param")
    if cfg.weights:
        try:
            read_state_dict(cfg.weights)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--weights") from None


@click.command()
@click.argument("run", **RUN)
@click.option("--split", type=click.Choice(["calibration", "test"]), default="test", show_default=True)
@click.option("--data", help="the run's dataset at its new place, when it has moved (same files, same fingerprint)")
def evaluate(run: Path, split: str, data: Optional[str]) -> None:
    """Single-logit metrics of a trained RUN on a split."""
    from trainer.runs import evaluate_run

    try:
        metrics = evaluate_run(run, split=split, print_table=True, data=data)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(f"{run} on {split}: accuracy {metrics['accuracy']:.4f}, auprc {metrics['auprc']:.4f}")


def _head_precisions(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    from serving.bundle.quantize import PRECISIONS

    names = tuple(dict.fromkeys(p.strip() for p in value.split(",") if p.strip()))
    if bad := [p for p in names if p not in PRECISIONS]:
        raise click.BadParameter(f"unknown head precision {bad[0]!r}; known: {', '.join(PRECISIONS)}", ctx, param)
    return names


@click.command("export")
@click.argument("run", **RUN)
@click.option("--out", required=True, help="bundle directory to write (a new folder, or with --overwrite a bundle it "
              "replaces in one atomic swap)", **OUT)
@click.option("--target-precision", type=click.FloatRange(0.0, 1.0, min_open=True),
              help="calibrate thresholds for this precision [default: 0.99]")
@click.option("--target-recall", type=click.FloatRange(0.0, 1.0, min_open=True),
              help="or for this recall (not with --target-precision)")
@click.option("--threshold-method", type=click.Choice(["auto", "shrink", "per_class", "global", "tail", "norm"]),
              default="auto", show_default=True, help="per-class thresholds pulled toward the global one (shrink), "
              "alone, one for all, read off each class's negatives (tail), or one on logits standardised by each "
              "class's highest negatives (norm); auto: norm for a PoLS loss calibrated with the style shift, global "
              "for one without, shrink otherwise (and for a calibration split too small for norm's tail) "
              "(docs/calibration.md)")
@click.option("--calibration-shift", type=click.Choice(["auto", "style", "none"]), default="auto", show_default=True,
              help="also calibrate on each calibration image with a seeded stroke weight, blur and contrast (style), "
              "so that thresholds hold on images unlike the calibration faces; auto: style for a PoLS loss on images, "
              f"unless the rule is chosen by export too and a class's column would hold under {NORM_MIN_NEGATIVES} negatives "
              "(the norm rule's tail: docs/calibration.md)")
@click.option("--kappa", type=POSITIVE, default=4.0, show_default=True,
              help="shrink: pseudo-count of the global threshold against a class's calibration positives")
@click.option("--data", help="the run's dataset at its new place, when it has moved (same files, same fingerprint)")
@click.option("--head-precision", "head_precision", default="", callback=_head_precisions,
              help="also write quantized heads: int8, bf16 or both, comma-separated (docs/bundle-format.md)")
@guarded("bundle", inputs=("run",))
def export(run: Path, out: Path, overwrite: bool, target_precision: Optional[float], target_recall: Optional[float],
           threshold_method: str, calibration_shift: str, kappa: float, data: Optional[str],
           head_precision: tuple[str, ...]) -> None:
    """Write the ONNX bundle of a trained RUN, calibrated on its calibration split."""
    if target_precision is not None and target_recall is not None:
        raise click.UsageError("give --target-precision or --target-recall, not both")
    if threshold_method == "tail" and target_recall is not None:
        raise click.UsageError("--threshold-method tail needs a precision target, not --target-recall")
    from serving.bundle import load_bundle
    from trainer.export import export_bundle

    precisions = head_precision
    t0 = time.perf_counter()
    method = {"name": threshold_method, "kappa": kappa} if threshold_method == "shrink" else {"name": threshold_method}
    method = None if threshold_method == "auto" else method
    try:
        export_bundle(run, out, target_precision=target_precision, target_recall=target_recall, method=method, data=data,
                      head_precisions=precisions, shift=calibration_shift, overwrite=overwrite)
    except ValueError as exc:  # the run's data gone or changed: one line
        raise click.UsageError(str(exc)) from None
    b = load_bundle(out, verify=False)
    test = (b.calibration.get("summary") or {}).get("test") or {}
    extra = (f", test per-class mean precision {test['per_class_mean_precision']:.3f} recall "
             f"{test['per_class_mean_recall']:.3f}") if test else ""
    click.echo(f"bundle {out}: {b.num_classes} classes, d={b.embed_dim}, verified, target {b.calibration['target']}, thresholds {b.calibration.get('method', {}).get('name', '?')}"
               f"{' on calibration + style-shifted copies' if b.calibration.get('shift') else ''}"
               f"{_small_split_note(b.calibration)}"
               f"{extra} ({time.perf_counter() - t0:.0f} s)  -> next: {slc_command()} serve {out}")
    if line := _support_line(b.calibration, run, out):
        click.echo(line)


def _small_split_note(calibration: dict) -> str:
    """Why export's automatic rule is the clean split's global threshold, when the split is too small for norm."""
    note = calibration.get("default_rule")
    return f" on the calibration split alone ({note['why'].split(':')[0]})" if note else ""


def _support_line(calibration: dict, run: Path, out: Path) -> str | None:
    """serving/calibration/support.py's line when the calibration split cannot show the target."""
    from serving.calibration.support import support_line

    sup = calibration.get("support")
    choose = f"{slc_command()} export {run} --out {out} --overwrite --target-precision {{p}}"
    return support_line(sup, choose) if sup else None


@click.group(no_args_is_help=True)
def data() -> None:
    """Datasets that are built, not downloaded."""


@data.command("glyphs")
@click.argument("name", type=click.Choice(["glyphs-latin", "glyphs3755", "glyphs3755-wide", "glyphs6763"]))
@click.option("--force", is_flag=True, help="render again even when cached")
def data_glyphs(name: str, force: bool) -> None:
    """Render glyph dataset NAME (characters from real fonts, split by typeface) into $SLC_HOME/data/glyphs."""
    from trainer.data import glyphs

    path = glyphs.cache_dir(name)
    try:
        glyphs.require_fonts(glyphs.glyph_set(name))  # before anything is rendered
    except FileNotFoundError as exc:
        raise click.ClickException(str(exc)) from None
    t0 = time.perf_counter()
    if force or not (path / "manifest.json").is_file():
        glyphs.build(name, path)
    manifest, _ = glyphs.load(name, progress=False)
    faces = {split: ", ".join(f"{f['family']} {f['style']}" for f in info["faces"])
             for split, info in manifest["splits"].items()}
    click.echo(f"{name}: {len(manifest['classes'])} classes; " + "; ".join(
        f"{split} {info['examples']} images ({faces[split]})" for split, info in manifest["splits"].items())
        + f" -> {path} ({time.perf_counter() - t0:.1f} s)")
