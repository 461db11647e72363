"""The glyph table's page and figure: docs/results/<dataset>.md and <dataset>-curves.png.

Reads the result dict of tools/experiments/glyphs.py; draws every row's calibration-face
accuracy per epoch (seed 0) beside the learning-rate grid, the two things that say whether a
row's number is the loss's or the recipe's.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tools.experiments.table1 import claim_check, format_error
from tools.experiments.run_cache import PENDING
from tools.report import md_table, write_file, write_text

METRICS = ("accuracy", "auprc", "p_at_r90", "p_at_r99")
VIEW_TITLES = {
    "test": "Test face: AR PL UKai (a brush design never seen in training), 8 renderings per class",
    "test_small": "Test face as users send it (1): the glyph a third of the image, anywhere in it",
    "test_tight": "Test face as users send it (2): the glyph filling the image (a tight crop or scan)",
    "calibration": "Calibration faces: AR PL UMing and Unifont (never seen in training), 4 renderings per class",
}


def table(rows: list[dict]) -> list[str]:
    cells = []
    for row in rows:
        pols = "yes" if row["pols"] else "no"
        if row["seeds_ok"] == 0:
            cells.append([row["loss"], pols, f"0 ({row['seeds_pending']} pending)", *["—"] * 5])
            continue
        seeds = str(row["seeds_ok"]) + (f" (+{row['seeds_failed']} diverged)" if row["seeds_failed"] else "") \
            + (f" (+{row['seeds_pending']} pending)" if row.get("seeds_pending") else "")
        errors = [format_error(row, k) if row["seeds_ok"] > 1 else f"{1 - row[k]:.3f}" for k in METRICS]
        top5 = f"{row['top5_accuracy']:.3f}" if np.isfinite(row["top5_accuracy"]) else "—"
        cells.append([row["loss"], pols, seeds, *errors, top5])
    return [md_table(["loss", "PoLS", "seeds", "1−Acc", "1−AUPRC", "1−P@R0.9", "1−P@R0.99", "top-5 acc"], cells, "l" * 8)]


def lr_lines(search: dict, lrs: tuple[float, ...], steps: int, seed: int) -> list[str]:
    """The learning-rate search: calibration-face accuracy of every grid point, the choice in bold."""
    if not lrs:
        return []
    lines = [f"Learning rate per row (the paper's protocol): each grid point trained {steps} steps with seed "
             f"{seed} (Adam, cosine to 0 over those steps); the best calibration-face accuracy chose, never the "
             "test face. A sampled head (R = 0.1) takes the rate its loss chose with the full head.", ""]
    rows = []
    for row, info in search.items():
        if "inherited from" in info["grid"]:
            rows.append([row, *[""] * len(lrs), f"{info['chosen']} (as {info['grid']['inherited from']})"])
            continue
        cells = [("—" if (a := info["grid"].get(f"{lr:g}")) is None else
                  (f"**{a:.3f}**" if info["chosen"] == lr else f"{a:.3f}")) for lr in lrs]
        rows.append([row, *cells, info["chosen"]])
    return lines + [md_table(["row", *(f"lr {lr:g}" for lr in lrs), "chosen"], rows, "l" + "r" * (len(lrs) + 1)), ""]


def detect_lines(detect: dict) -> list[str]:
    """What the detect route does with the exported thresholds: per-class thresholds calibrated on
    the calibration faces for precision 0.99, then measured on the test face (means over classes)."""
    if not detect:
        return []
    rows = []
    for row, d in detect.items():
        t = d["test"]
        views = [f"{d[v]['per_class_mean_recall']:.3f} / {d[v]['per_class_mean_precision']:.3f}" if v in d else "—"
                 for v in ("test_small", "test_tight")]
        rows.append([row, f"{t['calibration_recall']:.3f}", f"**{t['per_class_mean_recall']:.3f}**",
                     f"{t['per_class_mean_precision']:.3f}", f"{t['classes_reaching_target']:.0f}", *views])
    return [md_table(["row", "calibration recall", "test recall", "test precision", "classes at 0.99 on test",
                      "small: recall / precision", "tight: recall / precision"], rows, "lrrrrrr"), ""]


def timing_lines(run_info: dict) -> list[str]:
    rows = [[row, seed, info.get("lr", ""), info["steps"], f"{info['train_seconds'] / 60:.1f}",
             f"{info['eval_seconds'] / 60:.1f}", f"{info['images_per_second']:.0f}"]
            for row, infos in run_info.items() for seed, info in enumerate(infos) if info]
    return [md_table(["row", "seed", "lr", "steps", "train min", "eval min", "images/s"], rows, "lrrrrrr"), ""]


def plot(out: Path, dataset: str, runs: dict, search: dict, lrs: tuple[float, ...]) -> Path:
    """<dataset>-curves.png: calibration accuracy per epoch of every row (first seed), and the grid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trainer.history import read_history

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    for i, (row, paths) in enumerate(runs.items()):
        first = next((Path(p) for p in paths if p and p != PENDING), None)
        if first is None or not (first / "history.csv").is_file():
            continue
        _, epochs = read_history(first / "history.csv")
        style = "--" if "R=" in row else "-"
        left.plot([0] + [r["epoch"] + 1 for r in epochs], [0] + [r["cal_accuracy"] for r in epochs], style, marker="o",
                  color=f"C{i % 10}", label=row)
    left.set(title="calibration-face accuracy after each epoch (seed 0)", xlabel="epochs trained", ylabel="accuracy", ylim=(0, 1))
    for i, (row, info) in enumerate(search.items()):
        points = [(lr, info["grid"].get(f"{lr:g}")) for lr in lrs]
        points = [(lr, a) for lr, a in points if a is not None]
        if points:
            right.plot(*zip(*points), marker="o", color=f"C{i % 10}", label=row)
    right.set(title="learning-rate grid: calibration accuracy after the search budget", xlabel="Adam learning rate",
              xscale="log", ylim=(0, 1))
    for ax in (left, right):
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(f"{dataset}: learning curves and the learning-rate choice")
    path = out / f"{dataset}-curves.png"
    path = write_file(path, lambda tmp: fig.savefig(tmp, dpi=90))
    plt.close(fig)
    return path


def write_report(out: Path, plan, result: dict, command: str) -> None:
    t = result["timing"]
    n_runs = sum(1 for v in result["runs"].values() for r in v if r and r != PENDING)
    search = result.get("lr_search") or {}
    if n_runs:
        plot(out, plan.dataset, result["runs"], search, plan.lrs)
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
        f"Recipe (every row): `resnet_glyph` width {plan.width}, embedding {plan.embed}, Adam at the row's learning "
        f"rate (below), warmup then cosine decay, batch {plan.batch_size}, {plan.epochs} epochs = {result['steps']} "
        f"steps over the 7 training faces × 8 augmentations (56 images per class per epoch), {plan.precision}"
        f"{' + channels_last' if plan.channels_last else ''}; the head starts where each loss says (docs/losses.md, "
        "\"Initial head\"); the hinge losses with their smooth option (τ = 1 annealed to the exact hinge at half "
        f"of training); every image cropped to its content box (docs/datasets.md); seeds {list(plan.seeds)}; mean ± "
        "sample std over seeds; **1 − metric, lower is better**; raw logits except normalized_ce (ce's logits "
        "minus their logsumexp over all classes: the method that needs every logit).",
        "",
        f"Learning curves and the learning-rate grid: ![curves]({plan.dataset}-curves.png)",
        "",
        *lr_lines(search, plan.lrs, plan.search_steps, plan.seeds[0]),
    ]
    for split, rows in result["rows"].items():
        lines += [f"## {VIEW_TITLES.get(split, split)}", "", *table(rows), ""]
    lines += ["## The detect route at the calibrated precision", "",
              "Per-class thresholds chosen on the calibration faces for precision 0.99 (what `slc export` ships), "
              "then measured on the test face and its user views: means over classes, first seed. Precision "
              "counts a class that matches nothing as 1 (the export's convention), so read recall first.", "",
              *detect_lines(result.get("detect") or {}),
              "## The paper's claim, checked on the test-face means", "",
              *claim_check({r["loss"]: r for r in result["rows"]["test"]}), "",
              "## Wall time per run", "", *timing_lines(result.get("run_info") or {})]
    write_text(out / f"{plan.dataset}.md", "\n".join(lines))
