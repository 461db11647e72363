"""`slc experiment glyphs`: the PoLS claim at thousands of classes (glyphs3755, held-out typefaces).

Rows: ce and max_margin (no PoLS), the PoLS paper's five PoLS losses, normalized CE (ce's logits
after softmax normalisation), and ce and batch_ce on a sampled head (R = 0.1). The paper's
protocol: each row's learning rate chosen from a grid by calibration-face accuracy after a short
budget (never the test face; a sampled head takes its loss's choice), then every row trained for
the same number of epochs with at least two seeds; metrics of DESIGN.md §5 on the test face (AR PL
UKai, 8 renderings per class), on the same face as users send it (small and anywhere, or filling
the image: tools/experiments/glyph_eval.py) and on the calibration faces, plus the detect route's recall at
the precision calibrated on the calibration faces.

Runs are cached by their config and the code that trained them (tools/experiments/run_cache.py: one key,
one function for both experiments); seeds go in the outer loop, so a partial table has every row
of seed 0. The tables and curves are written by tools/experiments/glyph_report.py.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tools.experiments.run_cache import PENDING, cached_run

import numpy as np

from tools.experiments.table1 import summarise_seeds
from tools.experiments.glyph_report import write_report
from tools.report import write_json

log = logging.getLogger(__name__)

SMOOTH_HINGE = (("tau", 1.0), ("anneal", 0.5))  # the hinge losses' smooth option (docs/losses.md)
ROWS: tuple[tuple[str, float], ...] = (
    ("ce", 1.0), ("max_margin", 1.0),
    ("self_norm", 1.0), ("nce", 1.0), ("bce", 1.0), ("batch_ce", 1.0), ("batch_max_margin", 1.0),
    ("ce", 0.1), ("batch_ce", 0.1),
)
LOSS_PARAMS = {"max_margin": SMOOTH_HINGE, "batch_max_margin": SMOOTH_HINGE}  # every row of that loss


def row_name(loss: str, rate: float) -> str:
    return loss if rate == 1.0 else f"{loss} (R={rate:g})"


@dataclass(frozen=True)
class GlyphPlan:
    """The one recipe every row is trained with."""

    dataset: str = "glyphs3755"
    seeds: tuple[int, ...] = (0, 1)
    epochs: int = 2
    lr: float = 3e-3
    batch_size: int = 256
    width: int = 16
    embed: int = 256
    lrs: tuple[float, ...] = (1e-3, 3e-3, 1e-2)  # the paper's protocol: each row's lr chosen from this grid (empty: `lr` for all)
    search_steps: int = 250  # the short budget of a grid point, then calibration-face accuracy decides
    patience: int = 0  # full runs stop after this many epochs without a better calibration accuracy (0: off)
    augment: str = "none"
    precision: str = "bf16"  # docs/results/trainer-speed.md: bf16 + channels_last 2.3x fp32 on the CPU
    channels_last: bool = True

    def config(self, loss: str, rate: float, seed: int, lr: float | None = None, max_steps: int = 0):
        from trainer.train import TrainConfig

        return TrainConfig(dataset=self.dataset, backbone="resnet_glyph",
                           backbone_params={"width": self.width, "embed": self.embed}, loss=loss,
                           loss_params=dict(LOSS_PARAMS.get(loss, ())), epochs=1 if max_steps else self.epochs, lr=self.lr if lr is None else lr, batch_size=self.batch_size,
                           optimizer="adam", schedule="cosine", seed=seed, head_sample=rate, max_steps=max_steps,
                           patience=0 if max_steps else self.patience, augment=self.augment,
                           precision=self.precision, channels_last=self.channels_last)


def choose_lr(plan: GlyphPlan, loss: str, rate: float, runs: Path, progress: bool,
              train_missing: bool) -> tuple[float | str | None, dict[str, float | None]]:
    """The paper's choice: every lr of the grid trained `search_steps` steps (first seed), the one
    with the best calibration-face accuracy kept (never the test face). (lr, PENDING while grid
    points are, or None when every point diverged; {lr: accuracy, None if diverged or pending})."""
    if not plan.lrs:
        return plan.lr, {}
    grid: dict[str, float | None] = {}
    for lr in plan.lrs:
        run, _ = cached_run(runs, plan.config(loss, rate, plan.seeds[0], lr, plan.search_steps), progress, train_missing)
        grid[f"{lr:g}"] = json.loads((run / "metrics.json").read_text())["calibration"]["accuracy"] \
            if isinstance(run, Path) else None
        if run == PENDING:
            return PENDING, grid
    scored = {float(k): v for k, v in grid.items() if v is not None}
    return (max(scored, key=lambda k: (scored[k], -k)) if scored else None), grid


def train_or_reuse(cfg, runs: Path, progress: bool, train_missing: bool = True) -> tuple[Path | None | str, bool]:
    """(run directory, None if the loss diverged, or PENDING when not trained and not to be; trained now?)."""
    run, trained = cached_run(runs, cfg, progress, train_missing)
    if trained and run is not None:
        m = json.loads((run / "metrics.json").read_text())["test"]
        log.info("  %s seed %d: test acc %.4f auprc %.4f", row_name(cfg.loss, cfg.head_sample), cfg.seed,
                 m["accuracy"], m["auprc"])
    return run, trained


def _run_info(run: Path) -> dict:
    cfg = json.loads((run / "config.json").read_text())
    code = json.loads((run / "code.json").read_text())["code"] if (run / "code.json").exists() else "?"
    return {"train_seconds": cfg.get("train_seconds", float("nan")), "eval_seconds": cfg.get("eval_seconds", float("nan")),
            "images_per_second": cfg.get("train_images_per_second", float("nan")), "code": code,
            "steps": cfg["steps"], "num_classes": cfg["num_classes"], "lr": cfg.get("lr")}


def _split_metrics(run: Path, split: str, extras: dict, normalized: bool = False) -> dict | None:
    """A run's metrics on `split` (test, calibration, or a user view), normalized-CE ones when asked."""
    extra = extras.get(str(run), {})
    if normalized:
        return extra.get("normalized", {}).get(split)
    if split in ("test", "calibration"):
        return json.loads((run / "metrics.json").read_text())[split]
    return extra.get("views", {}).get(split)


def _row(name: str, pols: bool, runs: list, split: str, extras: dict, normalized: bool = False) -> dict:
    per_seed = [m for r in runs if isinstance(r, Path) and (m := _split_metrics(r, split, extras, normalized))]
    row = summarise_seeds(name, pols, None, per_seed, sum(r is None for r in runs))
    row["seeds_pending"] = sum(r == PENDING for r in runs)
    return row


def _rows(done: dict, split: str, extras: dict) -> list[dict]:
    """The table's rows on one split: every (loss, rate), normalized CE right after ce."""
    from trainer.losses import build_loss

    rows = []
    for (loss, rate), runs in done.items():
        rows.append(_row(row_name(loss, rate), bool(getattr(build_loss(loss, 10), "pols", False)), runs, split, extras))
        if (loss, rate) == ("ce", 1.0) and extras:
            rows.append(_row("normalized_ce", True, runs, split, extras, normalized=True))
    return rows


def _detect(done: dict, extras: dict) -> dict:
    """Per row: means over seeds of the detect rates at the calibrated precision, per split."""
    out = {}
    for (loss, rate), runs in done.items():
        per_seed = [extras[str(r)]["detect"] for r in runs if isinstance(r, Path) and "detect" in extras.get(str(r), {})]
        if per_seed:
            out[row_name(loss, rate)] = {split: {k: float(np.mean([d[split][k] for d in per_seed]))
                                                 for k in per_seed[0][split]} for split in per_seed[0]}
    return out


def glyph_experiment(plan: GlyphPlan, out: Path, runs: Path, command: str, progress: bool = False,
                     rows: tuple[tuple[str, float], ...] = ROWS, train_missing: bool = True,
                     evaluate_missing: bool = True) -> dict:
    """Train (or reuse) every row × seed, then write out/<dataset>.{json,md}. With train_missing
    False, only the cached runs are reported (the others are counted as pending); with
    evaluate_missing False, only the runs' evaluations already made (tools/experiments/glyph_eval.py)."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    done: dict[tuple[str, float], list[Path | None]] = {row: [] for row in rows}
    search = {row: choose_lr(plan, *row, runs, progress, train_missing) for row in rows if row[1] == 1.0}
    for loss, rate in rows:  # a sampled head takes the rate its loss chose with the full head
        if (loss, rate) not in search:
            lr, _ = search.get((loss, 1.0)) or choose_lr(plan, loss, rate, runs, progress, train_missing)
            search[(loss, rate)] = (lr, {"inherited from": row_name(loss, 1.0)} if (loss, 1.0) in search else {})
    trained = 0
    for seed in plan.seeds:  # seeds outside: a partial table has all of seed 0
        for loss, rate in rows:
            lr = search[(loss, rate)][0]
            log.info("%s seed %d lr %s", row_name(loss, rate), seed, lr)
            run, new = (lr, False) if lr in (PENDING, None) else \
                train_or_reuse(plan.config(loss, rate, seed, lr), runs, progress, train_missing)
            done[(loss, rate)].append(run)
            trained += new
    extras = _extras(plan.dataset, done, evaluate_missing)
    result = _result(plan, done, extras, trained, time.perf_counter() - started)
    result["lr_search"] = {row_name(*row): {"grid": grid, "chosen": lr} for row, (lr, grid) in search.items()}
    write_json(out / f"{plan.dataset}.json", result, newline=False)
    write_report(out, plan, result, command)
    return result


def _extras(dataset: str, done: dict, evaluate_missing: bool = True) -> dict:
    """{run path: RUN/glyph_eval.json}: the user views and detect at calibrated precision for each
    row's first seed, normalized CE for every seed of ce's full-head runs; {} for a glyph set
    without user views. Without `evaluate_missing`, only the evaluations already made."""
    from trainer.data import load_dataset
    from trainer.data.glyphs import glyph_set
    from tools.experiments.glyph_eval import cached, evaluate, user_views

    finished = [(loss, rate, seed, r) for (loss, rate), runs in done.items() for seed, r in enumerate(runs)
                if isinstance(r, Path) and (seed == 0 or (loss == "ce" and rate == 1.0))]
    if not finished or not glyph_set(dataset).raw:
        return {}
    if not evaluate_missing:
        return {str(r): e for _, _, _, r in finished if (e := cached(r)) is not None}
    splits, views = load_dataset(dataset), user_views(dataset)
    out = {}
    for loss, rate, seed, run in finished:  # the views and detect on the first seed (minutes of CPU per run)
        ce = loss == "ce" and rate == 1.0
        out[str(run)] = evaluate(run, splits, views if seed == 0 else {}, normalized=ce, detect=seed == 0)
    return out


def _result(plan: GlyphPlan, done: dict, extras: dict, trained: int, elapsed: float) -> dict:
    from tools.experiments.glyph_eval import VIEWS

    infos = [_run_info(r) for runs_ in done.values() for r in runs_ if isinstance(r, Path)]
    return {
        "plan": asdict(plan),
        "rows": {split: _rows(done, split, extras) for split in ("test", *(VIEWS if extras else ()), "calibration")},
        "detect": _detect(done, extras),
        "runs": {row_name(*k): [str(r) if r else None for r in v] for k, v in done.items()},
        "run_info": {row_name(*k): [_run_info(r) if isinstance(r, Path) else None for r in v] for k, v in done.items()},
        "pending": sum(r == PENDING for v in done.values() for r in v),
        "timing": {"runs_trained_now": trained, "elapsed_seconds": elapsed,
                   "train_seconds_total": float(sum(i["train_seconds"] for i in infos)),
                   "eval_seconds_total": float(sum(i["eval_seconds"] for i in infos)),
                   "images_per_second": float(np.median([i["images_per_second"] for i in infos])) if infos else None},
        "steps": infos[0]["steps"] if infos else None,
        "code_versions": sorted({i["code"] for i in infos}),
        "hardware": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.python_version()}",
    }
