"""`slc experiment glyphs`: the PoLS claim at thousands of classes (glyphs3755, held-out typefaces).

Rows: ce and max_margin (no PoLS), the PoLS paper's five PoLS losses, and ce and batch_ce on a
sampled head (R = 0.1). One recipe for every row (no per-loss learning-rate search: a search
would multiply hours of CPU by the grid; the Table 1 experiment on mnist5k has one), at least
two seeds; metrics of DESIGN.md §5 on the test face (AR PL UKai) and on the calibration faces.

Runs are cached under `runs` by their config alone (not the code's hash, unlike Table 1): one
run costs minutes, and the table is built over several sittings while the trainer grows (the
sharded head) in ways that leave the unsharded path as it was. Each run records the code it
was trained with (`code.json`: the training code's hash), and the table says how many code
versions it spans. Seeds go in the outer loop, so a partial table has every row of seed 0.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from trainer.run_cache import PENDING, cached_run

import numpy as np

from trainer.experiments import claim_check, format_error, summarise_seeds

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
    epochs: int = 3
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
                           loss_params=dict(LOSS_PARAMS.get(loss, ())), epochs=self.epochs, lr=self.lr if lr is None else lr, batch_size=self.batch_size,
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
            "steps": cfg["steps"], "num_classes": cfg["num_classes"]}


def _row(loss: str, rate: float, runs: list, split: str) -> dict:
    from trainer.losses import build_loss

    ok = [r for r in runs if isinstance(r, Path)]
    per_seed = [json.loads((r / "metrics.json").read_text())[split] for r in ok]
    pols = bool(getattr(build_loss(loss, 10), "pols", False))
    row = summarise_seeds(row_name(loss, rate), pols, None, per_seed, sum(r is None for r in runs))
    row["seeds_pending"] = sum(r == PENDING for r in runs)
    return row


def glyph_experiment(plan: GlyphPlan, out: Path, runs: Path, command: str, progress: bool = False,
                     rows: tuple[tuple[str, float], ...] = ROWS, train_missing: bool = True) -> dict:
    """Train (or reuse) every row × seed, then write out/<dataset>.{json,md}. With train_missing
    False, only the cached runs are reported (the others are counted as pending)."""
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
    result = _result(plan, done, trained, time.perf_counter() - started)
    result["lr_search"] = {row_name(*row): {"grid": grid, "chosen": lr} for row, (lr, grid) in search.items()}
    (out / f"{plan.dataset}.json").write_text(json.dumps(result, indent=2))
    _write_markdown(out, plan, result, command)
    return result


def _result(plan: GlyphPlan, done: dict, trained: int, elapsed: float) -> dict:
    infos = [_run_info(r) for runs_ in done.values() for r in runs_ if isinstance(r, Path)]
    return {
        "plan": asdict(plan),
        "rows": {split: [_row(loss, rate, r, split) for (loss, rate), r in done.items()]
                 for split in ("test", "calibration")},
        "runs": {row_name(*k): [str(r) if r else None for r in v] for k, v in done.items()},
        "pending": sum(r == PENDING for v in done.values() for r in v),
        "timing": {"runs_trained_now": trained, "elapsed_seconds": elapsed,
                   "train_seconds_total": float(sum(i["train_seconds"] for i in infos)),
                   "eval_seconds_total": float(sum(i["eval_seconds"] for i in infos)),
                   "images_per_second": float(np.median([i["images_per_second"] for i in infos])) if infos else None},
        "steps": infos[0]["steps"] if infos else None,
        "code_versions": sorted({i["code"] for i in infos}),
        "hardware": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.python_version()}",
    }


def _table(rows: list[dict]) -> list[str]:
    lines = ["| loss | PoLS | seeds | 1−Acc | 1−AUPRC | 1−P@R0.9 | 1−P@R0.99 | top-5 acc |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        top5 = f"{row['top5_accuracy']:.3f}" if np.isfinite(row["top5_accuracy"]) else "—"
        if row["seeds_ok"] == 0:
            lines.append(f"| {row['loss']} | {'yes' if row['pols'] else 'no'} | 0 ({row['seeds_pending']} pending) |"
                         + " — |" * 5)
            continue
        lines.append(f"| {row['loss']} | {'yes' if row['pols'] else 'no'} | {row['seeds_ok']}"
                     + (f" (+{row['seeds_failed']} diverged)" if row["seeds_failed"] else "")
                     + (f" (+{row['seeds_pending']} pending)" if row.get("seeds_pending") else "") + " | "
                     + " | ".join(format_error(row, k) if row["seeds_ok"] > 1 else f"{1 - row[k]:.3f}"
                                  for k in ("accuracy", "auprc", "p_at_r90", "p_at_r99"))
                     + f" | {top5} |")
    return lines


def _lr_lines(search: dict, plan: GlyphPlan) -> list[str]:
    """The learning-rate search: calibration-face accuracy of every grid point, the choice in bold."""
    if not plan.lrs:
        return []
    lines = [f"Learning rate per row (the paper's protocol): each grid point trained {plan.search_steps} steps "
             f"with seed {plan.seeds[0]}; the best calibration-face accuracy chose (never the test face).", "",
             "| row | " + " | ".join(f"lr {lr:g}" for lr in plan.lrs) + " | chosen |",
             "|---|" + "---:|" * (len(plan.lrs) + 1)]
    for row, info in search.items():
        cells = [("—" if (a := info["grid"].get(f"{lr:g}")) is None else
                  (f"**{a:.3f}**" if info["chosen"] == lr else f"{a:.3f}")) for lr in plan.lrs]
        lines.append(f"| {row} | " + " | ".join(cells) + f" | {info['chosen']} |")
    return lines + [""]


def _write_markdown(out: Path, plan: GlyphPlan, result: dict, command: str) -> None:
    t = result["timing"]
    n_runs = sum(1 for v in result["runs"].values() for r in v if r and r != PENDING)
    lines = [
        f"# The PoLS claim at {plan.dataset}: single-logit metrics on unseen typefaces",
        "",
        f"Command: `{command}`  ",
        f"Hardware: {result['hardware']} (shared, no GPU). {n_runs} runs: {t['train_seconds_total'] / 60:.0f} min of "
        f"training and {t['eval_seconds_total'] / 60:.0f} min of evaluation in all (median "
        f"{t['images_per_second'] or 0:.0f} training images/s); {t['runs_trained_now']} trained by the last "
        f"invocation, the rest reused from the run cache. Code versions among the runs: {len(result['code_versions'])}."
        + (f" **Partial: {result['pending']} runs still pending.**" if result.get("pending") else ""),
        "",
        f"Recipe (every row): `resnet_glyph` width {plan.width}, embedding {plan.embed}, Adam lr {plan.lr:g}, "
        f"cosine decay, batch {plan.batch_size}, {plan.epochs} epoch(s) = {result['steps']} steps over the 7 "
        "training faces × 8 augmentations (56 images per class per epoch); seeds "
        f"{list(plan.seeds)}; mean ± sample std over seeds; **1 − metric, lower is better**; raw logits.",
        "",
        "With about 2 test positives per class (4 on the calibration faces), recall 0.9 already needs every "
        "positive, so P@R0.9 equals P@R0.99 on the test face. A reading of these figures, and the pilot that "
        f"chose the recipe: {plan.dataset}-reading.md.",
        "",
        *_lr_lines(result.get("lr_search") or {}, plan),
        "## Test face: AR PL UKai (a brush design never seen in training)",
        "",
        *_table(result["rows"]["test"]),
        "",
        "## Calibration faces: AR PL UMing and Unifont (never seen in training)",
        "",
        *_table(result["rows"]["calibration"]),
        "",
        "## The paper's claim, checked on the test-face means",
        "",
        *claim_check({r["loss"]: r for r in result["rows"]["test"]}),
        "",
    ]
    (out / f"{plan.dataset}.md").write_text("\n".join(lines))
