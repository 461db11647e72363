"""What the glyph table measures of a trained run beyond its metrics.json (issue 27).

- the test face as users send it: `test_small` (the glyph a third of the image, anywhere) and
  `test_tight` (the glyph filling the image), raw images put through the server's own
  preprocessing (serving/bundle/image.py, the bundle's image spec with its content box);
- normalized CE: the logits minus their logsumexp over all D classes (softmax normalisation, the
  method that needs every logit), scored like any single logit;
- detect at the calibrated precision: per-class thresholds chosen on the calibration faces for
  precision 0.99 (serving/calibration/, what `slc export` ships), then the test face's mean
  per-class recall and precision at them.

Results go to RUN/glyph_eval.json, tagged with EVAL_VERSION so a changed evaluation recomputes.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

EVAL_VERSION = 1
VIEWS = ("test_small", "test_tight")
DETECT_TARGET = {"precision": 0.99}
CHUNK = 512  # classes per logits chunk: [N, 512] float64 at a time


def user_views(dataset: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{view: (x float32 [N, 1, 32, 32] after the server's preprocessing, y [N])} of the test face."""
    from PIL import Image

    from serving.bundle.image import preprocess
    from trainer.data import image_spec
    from trainer.data.glyphs import cache_dir, load_split

    spec = image_spec(dataset)
    out = {}
    for view in VIEWS:
        raw, y = load_split(cache_dir(dataset), view)
        out[view] = (np.stack([preprocess(Image.fromarray(np.asarray(raw[i, 0])), spec) for i in range(len(raw))]), y)
    return out


def embed(model, x, batch: int = 2048) -> np.ndarray:
    """h [N, d] float64 of x [N, ...] (eval mode, fp32)."""
    import torch

    with torch.no_grad():
        return torch.cat([model.embed(torch.tensor(np.asarray(x[i:i + batch], dtype=np.float32)))
                          for i in range(0, len(x), batch)]).double().numpy()


def normalized_chunks(h: np.ndarray, w: np.ndarray, b: np.ndarray, chunk: int = CHUNK):
    """`chunks` (trainer/metrics.py) of z − logsumexp(z) over all D: the softmax-normalised logits."""
    lse = np.full(len(h), -np.inf)  # [N]
    for first in range(0, len(w), chunk):
        lse = np.logaddexp(lse, _logsumexp(h @ w[first:first + chunk].T + b[first:first + chunk]))

    def gen():
        for first in range(0, len(w), chunk):
            yield first, h @ w[first:first + chunk].T + b[first:first + chunk] - lse[:, None]  # [N, c]
    return gen


def _logsumexp(z: np.ndarray) -> np.ndarray:
    m = z.max(axis=1)
    return m + np.log(np.exp(z - m[:, None]).sum(axis=1))


def cached(run: Path) -> dict | None:
    """RUN/glyph_eval.json as last computed (this version), or None."""
    path = Path(run) / "glyph_eval.json"
    if not path.is_file():
        return None
    out = json.loads(path.read_text())
    return out if out.get("version") == EVAL_VERSION else None


def evaluate(run: Path, splits, views: dict, normalized: bool, detect: bool = True) -> dict:
    """RUN/glyph_eval.json: metrics on the user views, detect rates at calibrated precision (when
    `detect`), and (for `normalized`, ce's runs) the normalized-CE metrics on the test and
    calibration splits; computed once. `splits`: the run's dataset (trainer.data.Splits), `views`:
    user_views of it ({} to skip them)."""
    from serving.calibration.chunks import head_chunks
    from trainer.metrics import streaming_slc_metrics
    from trainer.runs import load_run

    path = Path(run) / "glyph_eval.json"
    want = {"views": sorted(views), "detect": detect, "normalized": normalized}
    if path.is_file() and (old := json.loads(path.read_text())).get("version") == EVAL_VERSION \
            and all(old.get("asked", {}).get(k) == v for k, v in want.items()):
        return old
    model = load_run(run)[0]
    w, b = (p.detach().double().numpy() for p in (model.head.weight, model.head.bias))  # [D, d], [D]
    named = {"test": splits.test, "calibration": splits.calibration, **views}
    needed = [s for s in named if s in views or normalized or (detect and s in ("test", "calibration"))]
    h = {s: embed(model, named[s][0]) for s in needed}
    y = {s: named[s][1] for s in needed}
    d = len(b)
    out = {"version": EVAL_VERSION, "asked": want,
           "views": {v: streaming_slc_metrics(head_chunks(h[v], w, b, CHUNK), y[v], d) for v in views}}
    if detect:
        out["detect"] = _detect(h, y, w, b, ("test", *views))
    if normalized:
        out["normalized"] = {s: streaming_slc_metrics(normalized_chunks(h[s], w, b), y[s], d)
                             for s in ("test", "calibration", *views)}
    path.write_text(json.dumps(out, indent=1))
    return out


def _detect(h: dict, y: dict, w: np.ndarray, b: np.ndarray, splits: tuple[str, ...]) -> dict:
    """Per-class thresholds calibrated on the calibration split (DETECT_TARGET, the export's
    default method), then each split's mean per-class recall and precision at them."""
    from serving.calibration.chunks import Logits, head_chunks
    from serving.calibration.counts import measured_rates
    from serving.calibration.estimator import calibrate_chunks

    d = len(b)
    cal = calibrate_chunks(head_chunks(h["calibration"], w, b, CHUNK), y["calibration"], d, DETECT_TARGET,
                           head_chunks(h[splits[0]], w, b, CHUNK), y[splits[0]])
    thresholds = np.array([c["threshold"] for c in cal["per_class"]], dtype=np.float64)  # [D]
    out = {}
    for split in splits:
        rates = measured_rates(Logits(head_chunks(h[split], w, b, CHUNK), y[split], d), thresholds,
                               float(cal["global"]["threshold"]))["per_class"]
        out[split] = {"per_class_mean_recall": float(rates["recall"].mean()),
                      "per_class_mean_precision": float(rates["precision"].mean()),
                      "classes_reaching_target": int((rates["precision"] >= DETECT_TARGET["precision"] - 1e-12).sum()),
                      "calibration_recall": cal["summary"]["per_class_mean_recall"]}
    return out
