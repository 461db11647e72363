"""`slc experiment enroll`: classes no model here was trained on, enrolled from a few renderings (issue 38).

GB2312 has 6,763 characters; glyphs3755 trains on its 3,755 level-1 ones. The other 3,008 (level
2), rendered from the training and calibration faces, are enrolled with the server's own rule
(serving/core/enrollment.py: imprinting, the bundle's global threshold) from k = 1, 2 and 5
renderings each, and measured on the test face (8 renderings each, never enrolled from), next to
the trained classes' own figures on the same face:

- detect recall at the thresholds and the achieved precision (per class, and pooled over every
  (image, class) decision), for enrolled and for trained classes;
- top-1 among all 3,755 + 3,008 classes; the trained classes' top-1 and false matches before and
  after enrollment;
- the gallery's answer on the same examples: the nearest stored example (cosine) among the new
  characters', against the enrolled rows' argmax among the same classes.

Offline (numpy over the exported bundle's head and calibration, embeddings by the run's network,
which the export checks equal to backbone.onnx); the server computes the same (tests/serving/
test_enroll.py checks its answers against this math).
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np

KS = (1, 2, 5)
TEST_RENDERINGS = 8
CHUNK = 4096


def new_chars(classes: list[str]) -> str:
    """GB2312 level 2: the characters of glyphs6763 that glyphs3755 does not hold, in code order,
    that every face of the set can draw."""
    from trainer.data.glyphs import gb2312, glyph_set

    gs = glyph_set("glyphs3755")
    cmaps = [f.cmap() for f in gs.all_faces()]
    known = set(classes)
    return "".join(c for c in gb2312(False) if c not in known and all(ord(c) in m for m in cmaps))


def _render_face(args) -> np.ndarray:
    """Worker: `count` renderings of each of `chars` from one face (one font load), seeded: uint8 [n, S, S]."""
    from trainer.data import glyphs

    face, chars, count, seed = args
    rng = np.random.default_rng(seed)
    font = face.load(glyphs.font_size("content"))
    return np.stack([glyphs.render(font, c, rng, "content") for c in chars for _ in range(count)])


def render(chars: str, k_max: int, workers: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """(examples uint8 [C, k_max, 1, S, S]: example j of character i from face (i + j) mod F of the
    training and calibration faces, so every k draws on several faces; test uint8 [C, 8, 1, S, S]
    from the test face)."""
    from concurrent.futures import ProcessPoolExecutor

    from trainer.data.glyphs import SIZE, glyph_set

    gs = glyph_set("glyphs3755")
    faces = list(gs.faces["train"]) + list(gs.faces["calibration"])
    slots = [[(i, j) for i in range(len(chars)) for j in range(k_max) if (i + j) % len(faces) == f]
             for f in range(len(faces))]
    halves = [chars[:len(chars) // 2], chars[len(chars) // 2:]]
    jobs = [(face, "".join(chars[i] for i, _ in slot), 1, 1000 + f) for f, (face, slot) in enumerate(zip(faces, slots))]
    jobs += [(gs.faces["test"][0], half, TEST_RENDERINGS, 500_000 + h) for h, half in enumerate(halves)]
    with ProcessPoolExecutor(workers) as pool:
        done = list(pool.map(_render_face, jobs))
    examples = np.zeros((len(chars), k_max, 1, SIZE, SIZE), np.uint8)
    for slot, imgs in zip(slots, done):
        for (i, j), img in zip(slot, imgs):
            examples[i, j, 0] = img
    test = np.concatenate(done[len(faces):]).reshape(len(chars), TEST_RENDERINGS, 1, SIZE, SIZE)
    return examples, test


def _embed(model, x: np.ndarray) -> np.ndarray:
    import torch

    model.eval()
    with torch.no_grad():
        return np.concatenate([model.embed(torch.tensor(np.asarray(x[i:i + CHUNK], dtype=np.float32))).numpy()
                               for i in range(0, len(x), CHUNK)]).astype(np.float64)


def decisions(h: np.ndarray, labels: np.ndarray, weight: np.ndarray, bias: np.ndarray, thr: np.ndarray) -> dict:
    """Detect at thresholds thr [C] and the top-1 over every class of weight [C, d], for embeddings
    h [N, d] with labels [N] (a column, or -1: a class the head does not hold, negatives only)."""
    n, c = len(h), weight.shape[0]
    tp, matches = np.zeros(c), np.zeros(c)
    top1 = np.zeros(n, dtype=np.int64)
    w, b = weight.astype(np.float64), bias.astype(np.float64)
    for s in range(0, n, 1024):
        z = h[s:s + 1024] @ w.T + b  # [n', C]
        hit = z >= thr
        matches += hit.sum(axis=0)
        y = labels[s:s + 1024]
        own = np.flatnonzero(y >= 0)
        np.add.at(tp, y[own], hit[own, y[own]])
        top1[s:s + 1024] = z.argmax(axis=1)
    return {"tp": tp, "matches": matches, "positives": np.bincount(labels[labels >= 0], minlength=c), "top1": top1}


def summary(d: dict, labels: np.ndarray, classes: np.ndarray) -> dict:
    """Figures of the classes `classes` (columns) and their images: mean per-class recall and
    precision (a class with no match: 1), pooled precision, top-1 accuracy, false matches."""
    tp, m, pos = d["tp"][classes], d["matches"][classes], d["positives"][classes]
    images = np.isin(labels, classes)
    return {"classes": int(len(classes)), "recall": float(np.mean(tp / np.maximum(pos, 1))),
            "precision": float(np.mean(np.where(m > 0, tp / np.maximum(m, 1), 1.0))),
            "pooled_precision": float(tp.sum() / m.sum()) if m.sum() else 1.0,
            "false_matches": int(m.sum() - tp.sum()), "matches": int(m.sum()),
            "top1": float(np.mean(d["top1"][images] == labels[images])) if images.any() else float("nan")}


def nearest_example(h_test: np.ndarray, y_test: np.ndarray, h_items: np.ndarray, y_items: np.ndarray) -> float:
    """The gallery's answer: the label of the nearest stored example by cosine, its accuracy."""
    items = h_items / np.linalg.norm(h_items, axis=1, keepdims=True)
    q = h_test / np.linalg.norm(h_test, axis=1, keepdims=True)
    best = np.concatenate([(q[s:s + 1024] @ items.T).argmax(axis=1) for s in range(0, len(q), 1024)])
    return float(np.mean(y_items[best] == y_test))


def enroll_row(h: np.ndarray, stats, negatives=None, num_trained: int = 0, rule: str = "auto"):
    """The row the server makes (SLC_ENROLL_RULE, serving/core/enrolled.py `compute`) where the bundle
    carries calibration negatives (`negatives` = their NegativeStats and embeddings): with `fitted`, the
    fitted row and its cross-fitted threshold for 2 examples or more; with `auto`, standardised
    imprinting (the global threshold); else plain imprinting and the global threshold. (The server also
    gives a standardised or imprinted class whose global threshold rejects all its examples the
    negatives threshold; this study keeps the global one there, as it was measured.)"""
    from serving.core.enrollment import FIT_MIN_EXAMPLES, fitted, imprint, standardised

    if negatives is None:
        return imprint(h, stats)
    if rule == "fitted" and len(h) >= FIT_MIN_EXAMPLES:
        return fitted(h, stats, negatives[0], negatives[1], num_trained)
    return standardised(h, stats, negatives[0], negatives[1])


def study(run: Path, work: Path) -> dict:
    from serving.bundle import load_bundle
    from serving.core.enrollment import head_stats, negative_stats
    from trainer.data import load_run_data
    from trainer.runs import load_run

    t0 = time.perf_counter()
    bundle_dir = work / "bundle"
    if not (bundle_dir / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "slc", "export", str(run), "--out", str(bundle_dir)], check=True)
    b = load_bundle(bundle_dir)
    model, config, info = load_run(run)
    x_test, y_test = load_run_data(info, progress=False).test
    cache = work / "embeddings.npz"  # the renderings' embeddings: a rule can be measured again in seconds
    if cache.is_file():
        e = np.load(cache, allow_pickle=False)
        chars, h_trained, h_new, h_ex = str(e["chars"]), e["trained"], e["new"], e["examples"]
    else:
        chars = new_chars(list(b.classes))
        ex, te = render(chars, max(KS))
        h_trained = _embed(model, x_test)  # [N, d]
        h_new = _embed(model, te.reshape(-1, *te.shape[2:]))  # [C * 8, d]
        h_ex = _embed(model, ex.reshape(-1, *ex.shape[2:])).reshape(len(chars), max(KS), -1)  # [C, k, d]
        np.savez(cache, chars=np.array(chars), trained=h_trained, new=h_new, examples=h_ex)
    D, C = int(b.num_classes), len(chars)
    stats = head_stats(b.weight, b.bias, b.platt_a, b.platt_b, float(b.global_threshold), b.calibration.get("target"))
    thr = np.where(np.isfinite(b.thresholds), b.thresholds, b.global_threshold).astype(np.float64)  # [D]
    h = np.concatenate([h_trained, h_new])
    y_new = D + np.repeat(np.arange(C), TEST_RENDERINGS)
    labels_before = np.concatenate([y_test, np.full(len(h_new), -1)])
    before = decisions(h, labels_before, np.asarray(b.weight), np.asarray(b.bias), thr)
    out = {"run": str(run), "loss": config["loss"], "dataset": info["dataset"], "trained": D, "new": C,
           "global_threshold": float(b.global_threshold), "rule": "imprint + global threshold",
           "before": {"trained": summary(before, labels_before, np.arange(D))}, "after": {}}
    labels = np.concatenate([y_test, y_new])
    negatives = None
    if (bundle_dir / "calibration_embeddings.npy").is_file():
        h_neg = np.load(bundle_dir / "calibration_embeddings.npy")
        y_neg = np.load(bundle_dir / "calibration_labels.npy")
        negatives = (negative_stats(b.weight, b.bias, h_neg, y_neg), h_neg)
    out["rule"] = ("k = 1: standardised imprint (mean, spread and far tail of a trained class on the negatives) + "
                   "global threshold; k >= 2: fitted against the negatives + cross-fitted threshold") \
        if negatives else "imprint + global threshold"
    for k in KS:
        rows = [enroll_row(h_ex[i, :k], stats, negatives, D) for i in range(C)]
        w = np.concatenate([np.asarray(b.weight), np.stack([r.row for r in rows])])
        bias = np.concatenate([np.asarray(b.bias), [r.bias for r in rows]])
        d = decisions(h, labels, w, bias, np.concatenate([thr, [r.threshold for r in rows]]))
        enrolled_only = (h_new @ w[D:].T.astype(np.float64) + bias[D:]).argmax(axis=1)
        out["after"][str(k)] = {
            "trained": summary(d, labels, np.arange(D)), "enrolled": summary(d, labels, D + np.arange(C)),
            "enrolled_top1_among_enrolled": float(np.mean(enrolled_only == y_new - D)),
            "gallery_top1_among_enrolled": nearest_example(h_new, y_new - D, h_ex[:, :k].reshape(C * k, -1),
                                                           np.repeat(np.arange(C), k))}
    out["seconds"] = time.perf_counter() - t0
    return out


def markdown(r: dict, command: str) -> str:
    from tools.report import md_table

    def row(name: str, s: dict, extra: str = "–", gallery: str = "–") -> list:
        return [name, f"{s['recall']:.3f}", f"{s['precision']:.3f}", f"{s['pooled_precision']:.3f}",
                f"{s['false_matches']:,}", f"{s['top1']:.3f}", extra, gallery]

    body = [row("trained classes, before enrollment", r["before"]["trained"])]
    for k, a in r["after"].items():
        body.append(row(f"trained classes, {k}-shot enrollment of {r['new']:,}", a["trained"]))
        body.append(row(f"enrolled classes, k = {k}", a["enrolled"], f"{a['enrolled_top1_among_enrolled']:.3f}",
                        f"{a['gallery_top1_among_enrolled']:.3f}"))
    return "\n".join([
        f"# Enrolled classes: {r['new']:,} characters no model here was trained on", "",
        f"Command: `{command}`  \nRun: `{r['run']}` ({r['loss']} on {r['dataset']}); rule: {r['rule']} "
        f"({r['global_threshold']:.3f}); measured on the test face (AR PL UKai, {TEST_RENDERINGS} renderings per "
        f"class) over all {r['trained'] + r['new']:,} classes; {r['seconds'] / 60:.1f} min. "
        "Recall and precision: detect at each class's threshold (per class, mean; pooled: true matches over all "
        "matches of those classes). Top-1: among every class. 'Among enrolled': the enrolled rows' argmax and "
        "the gallery's nearest stored example (cosine) over the same k examples, among the new classes only. "
        "tools/experiments/enroll_glyphs.py.", "",
        md_table(["classes", "detect recall", "precision (mean)", "precision (pooled)", "false matches", "top-1",
                  "top-1 among enrolled", "gallery nearest example"], body, "lrrrrrrr"), ""])
