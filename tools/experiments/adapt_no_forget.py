"""`slc experiment adapt-no-forget BUNDLE`: what `slc calibrate --adapt-rows` buys on the face it is
calibrated on and what it costs the faces it is not (issue 50, parts 4 and 5).

A glyphs3755 bundle (as `slc export` wrote it) is judged per face, with the detect decision the server
makes (own logit >= own threshold) on backbone.onnx embeddings of the rendered arrays (as the trainer
and export read them: already cropped to their content, the bundle's input scale):

- the brush test face (AR PL UKai): per seed, 2 renderings per class (of its 8) are the user's
  images; the other 6 are measured;
- the calibration faces (AR PL UMing, Unifont: the export calibrated on them; `slc calibrate` never
  sees them, and the bundle keeps a sample of their embeddings, calibration_embeddings.npy);
- held-out printed faces: allowed faces training never used (HELD_OUT), rendered here as the
  calibration split is (4 renderings per class, seeded). Never tuned on: reported only.

Bundles judged: as exported; thresholds only (`slc calibrate`, the norm rule, rows kept); rows adapted
as before this issue (`--adapt-rows --no-adapt-keep`: adapt.py); rows adapted keeping the bundle's
calibration examples (`--adapt-rows`, the default: keep.py). The recalibrations call the functions
`slc calibrate` calls, on the same embeddings, thresholds stored as float32.

Per face: recall (the image's own class matches), pooled precision (true matches over every match of
every class), and hard false matches: the share of images whose best-scoring wrong class matches.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

TARGET = {"precision": 0.99}
USER_PER_CLASS = 2
HELD_OUT_RENDERINGS = 4
BATCH = 512


def held_out_faces():
    """Allowed faces (docs: the typeface rule) that glyphs3755 never trains or calibrates on."""
    from trainer.data.glyphs import Face

    noto = "/usr/share/fonts/opentype/noto/"
    return {"Noto Serif CJK JP": Face(noto + "NotoSerifCJK-Regular.ttc", "Noto Serif CJK JP", "fonts-noto-cjk"),
            "WenQuanYi Micro Hei": Face("/usr/share/fonts/truetype/wqy/wqy-microhei.ttc", "WenQuanYi Micro Hei",
                                        "fonts-wqy-microhei")}


def embed(bundle: Path, x: np.ndarray, scale: float) -> np.ndarray:
    """backbone.onnx embeddings [N, d] float32 of uint8 arrays x [N, 1, 32, 32]."""
    from serving.bundle import ort_session

    sess = ort_session(bundle / "backbone.onnx")
    out = [sess.run(None, {"input": np.asarray(x[i:i + BATCH], np.float32) * np.float32(scale)})[0]
           for i in range(0, len(x), BATCH)]
    return np.concatenate(out)


def render_face(face, chars: str, per: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(x uint8 [n, 1, 32, 32], y [n]): every class `per` times, as the calibration split renders a face."""
    from trainer.data.glyphs import font_size, render

    rng, font = np.random.default_rng(seed), face.load(font_size("content"))
    x = np.stack([render(font, c, rng, "content") for c in chars for _ in range(per)])[:, None]
    return x, np.repeat(np.arange(len(chars)), per)


def held_out_arrays(chars: str, cache: Path | None = None) -> dict:
    """{face name: (x, y)} of the held-out faces, rendered once into `cache` (npz) when given."""
    out = {}
    for k, (name, face) in enumerate(held_out_faces().items()):
        path = None if cache is None else Path(cache) / f"held-out-{k}-{HELD_OUT_RENDERINGS}.npz"
        if path is not None and path.is_file():
            with np.load(path) as f:
                out[name] = (f["x"], f["y"])
            continue
        out[name] = render_face(face, chars, HELD_OUT_RENDERINGS, 1000 + k)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            np.savez(path, x=out[name][0], y=out[name][1])
    return out


def faces(bundle: Path, dataset: str = "glyphs3755", cache: Path | None = None) -> dict:
    """{face name: (embeddings, labels)}: the test face (all 8 renderings), each calibration face, each held-out face."""
    from trainer.data import glyphs

    manifest, splits = glyphs.load(dataset, progress=False)
    spec = json.loads((bundle / "manifest.json").read_text())["image"]
    scale = float(spec.get("scale", 1.0))
    path = glyphs.cache_dir(dataset)
    out = {}
    for split in ("test", "calibration"):
        x, y = splits[split]
        face = np.load(path / f"face_{split}.npy")
        for i, info in enumerate(manifest["splits"][split]["faces"]):
            rows = np.flatnonzero(face == i)
            out[f"{info['family']} ({split})"] = (embed(bundle, x[rows], scale), np.asarray(y)[rows])
    chars = "".join(manifest["classes"])
    for name, (x, y) in held_out_arrays(chars, cache).items():
        out[f"{name} (held out)"] = (embed(bundle, x, scale), y)
    return out


def judge(h: np.ndarray, y: np.ndarray, weight, bias, t: np.ndarray) -> dict:
    """Recall, pooled precision and hard false matches of detect at thresholds t [D] (float32)."""
    z = h.astype(np.float32) @ np.asarray(weight[0:len(t)], np.float32).T + np.asarray(bias, np.float32)  # [n, D]
    match = z >= t[None, :].astype(np.float32)
    own = match[np.arange(len(y)), y]
    z[np.arange(len(y)), y] = -np.inf
    wrong = z.argmax(axis=1)
    hard = match[np.arange(len(y)), wrong]
    matches = int(match.sum())
    return {"images": int(len(y)), "recall": float(own.mean()), "precision": float(own.sum() / max(matches, 1)),
            "matches": matches, "hard_false_matches": float(hard.mean())}


def user_split(y: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(user rows: USER_PER_CLASS per class chosen by seed, the other rows)."""
    rng = np.random.default_rng(seed)
    pick = np.concatenate([rng.choice(np.flatnonzero(y == c), USER_PER_CLASS, replace=False) for c in np.unique(y)])
    return np.sort(pick), np.setdiff1d(np.arange(len(y)), pick)


def recalibrations(bundle: Path, h: np.ndarray, y: np.ndarray) -> dict:
    """{state: (rows, thresholds float32, seconds, note)} for the three recalibrations."""
    from serving.bundle.negatives import read_negatives
    from serving.calibration import adapt, keep
    from serving.calibration.chunks import chunk_classes, head_chunks
    from serving.calibration.norm import norm_thresholds
    from serving.bundle.recalibration import read_source

    head = read_source(bundle)
    W, b = head.weight, head.bias
    out = {}
    t0 = time.perf_counter()
    t = norm_thresholds(head_chunks(h.astype(np.float64), W, b, chunk_classes(len(y), len(W))), y, len(W), TARGET)
    out["thresholds only"] = (W, t.astype(np.float32), time.perf_counter() - t0, {})
    t0 = time.perf_counter()
    beta, scores = adapt.choose_beta(h, y, W, b, TARGET)
    rows, t = adapt.thresholds(h, y, W, b, beta, TARGET)
    out["adapt (before: --no-adapt-keep)"] = (rows, t.astype(np.float32), time.perf_counter() - t0,
                                              {"step": beta, "choice": scores})
    t0 = time.perf_counter()
    kept = keep.kept_examples(*read_negatives(bundle), W, b, TARGET)
    beta, scores = keep.choose_beta(h, y, W, b, TARGET, kept)
    rows, t = keep.thresholds(h, y, W, b, beta, TARGET, kept)
    moved = rows.steps.ravel() / max(beta, 1e-300)
    out["adapt keeping (default)"] = (rows, t.astype(np.float32), time.perf_counter() - t0,
                                      {"step": beta, "choice": scores, "kept": len(kept.y), "tau_keep": kept.tau,
                                       "rows_full_step": int((moved >= 1 - 1e-9).sum()),
                                       "rows_held": int((moved < 1e-9).sum())})
    return out


def study(bundle: Path, seeds: tuple[int, ...] = (0, 1, 2), dataset: str = "glyphs3755",
          cache: Path | None = None, partial: Path | None = None) -> dict:
    """The figures of the module docstring; with `partial`, written there (JSON) after each seed too."""
    from serving.bundle.recalibration import read_source

    t0 = time.perf_counter()
    by_face = faces(bundle, dataset, cache)
    embed_s = time.perf_counter() - t0
    test = next(k for k in by_face if k.endswith("(test)"))
    head = read_source(bundle)
    W, b = head.weight, head.bias
    cal = json.loads((bundle / "calibration.json").read_text())
    t_export = np.array([e["threshold"] for e in cal["per_class"]], dtype=np.float32)
    exported = {face: judge(h, y, W, b, t_export) for face, (h, y) in by_face.items()}
    runs = []
    for seed in seeds:
        h, y = by_face[test]
        user, rest = user_split(y, seed)
        measured = {**by_face, test: (h[rest], y[rest])}
        states = {"exported": {face: judge(hh, yy, W, b, t_export) for face, (hh, yy) in measured.items()}}
        notes = {}
        for state, (rows, t, secs, note) in recalibrations(bundle, h[user], y[user]).items():
            states[state] = {face: judge(hh, yy, rows, b, t) for face, (hh, yy) in measured.items()}
            notes[state] = {**note, "seconds": round(secs, 1)}
        runs.append({"seed": seed, "user_images": int(len(user)), "states": states, "notes": notes})
        if partial is not None:
            Path(partial).write_text(json.dumps({"exported": exported, "seeds": runs}, indent=1) + "\n")
    return {"bundle": str(bundle), "target": TARGET, "test_face": test, "exported": exported, "seeds": runs,
            "embed_seconds": round(embed_s, 1), "seconds": round(time.perf_counter() - t0, 1)}


STATES = ("exported", "thresholds only", "adapt (before: --no-adapt-keep)", "adapt keeping (default)")


def _mean_sd(values: list[float]) -> str:
    v = np.asarray(values, dtype=np.float64)
    return f"{v.mean():.3f}" + (f" ± {v.std(ddof=1):.3f}" if len(v) > 1 else "")


def summary_rows(r: dict) -> list[str]:
    """One table row per (state, face): recall, pooled precision and hard false matches over seeds."""
    rows = []
    for state in STATES:
        for face in r["seeds"][0]["states"][state]:
            got = [s["states"][state][face] for s in r["seeds"]]
            before = [s["states"]["exported"][face]["recall"] for s in r["seeds"]]
            delta = _mean_sd([g["recall"] - b for g, b in zip(got, before)])
            rows.append(f"| {state} | {face} | {_mean_sd([g['recall'] for g in got])} | {delta} | "
                        f"{_mean_sd([g['precision'] for g in got])} | {_mean_sd([g['hard_false_matches'] for g in got])} |")
    return rows


def markdown(r: dict, command: str) -> str:
    lines = ["# Calibration that does not forget, and detect as exported, per face (issue 50, parts 4 and 5)", "",
             f"Command: `{command}`  ", f"Bundle: `{r['bundle']}`; target precision {r['target']['precision']}; "
             f"seeds {', '.join(str(s['seed']) for s in r['seeds'])} (which {USER_PER_CLASS} renderings per class of the "
             f"test face are the user's). Methods: tools/experiments/adapt_no_forget.py. Embedding {r['embed_seconds']} s, "
             f"all {r['seconds']} s.", "",
             "## As exported (part 5): detect at the exported thresholds, every image of each face", "",
             "| face | images | recall | pooled precision | matches | hard false matches |", "|---|---:|---:|---:|---:|---:|"]
    for face, m in r["exported"].items():
        lines.append(f"| {face} | {m['images']:,} | {m['recall']:.3f} | {m['precision']:.3f} | {m['matches']:,} | "
                     f"{m['hard_false_matches']:.4f} |")
    lines += ["", "## After recalibrating on the test face (part 4): mean ± sd over seeds", "",
              "The test face is measured on its renderings the user did not give (6 per class). Δ recall: against "
              "the bundle as exported, seed for seed.", "",
              "| bundle | face | recall | Δ recall | pooled precision | hard false matches |",
              "|---|---|---:|---:|---:|---:|"] + summary_rows(r)
    lines += ["", "Per seed, the steps chosen and the time each recalibration took (2 shared CPU cores):", "",
              "| seed | bundle | step | rows full step / held back | seconds |", "|---:|---|---:|---:|---:|"]
    for s in r["seeds"]:
        for state, n in s["notes"].items():
            held = f"{n['rows_full_step']:,} / {n['rows_held']:,}" if "rows_held" in n else "–"
            lines.append(f"| {s['seed']} | {state} | {n.get('step', '–')} | {held} | {n['seconds']} |")
    return "\n".join(lines) + "\n"
