"""`slc experiment user-calibration`: a user's view of detect on a face no one calibrated on, before and
after `slc calibrate` on a few labelled images of it (issue 37, part 6).

The glyph set's test face (8 renderings per class) is written as PNG files: 2 per class to
recalibrate with (the CSV's val split), 1 left out (train: slc calibrate never uses it), the other
5 to measure on (test). The bundle and its recalibrated copy are each served by `slc serve`, and
every measured PNG is sent as an image body:

- recall: `POST /v1/classes/{its class}/detect` answers match or not;
- false matches: `POST /v1/topk` (k = TOPK, mode exact) gives the image's best logits; a class among
  them whose logit reaches its threshold (GET /v1/model's calibration is a summary, so the
  thresholds are read from the bundle's calibration.json, the file the server loaded) is a match.
  A class outside the top k has a logit below the k-th; the images whose k-th logit still reaches
  the lowest threshold of any class are counted (`unsure`): their false matches may be undercounted.

Achieved precision = true matches / all matches, pooled over every (image, class) decision.
"""
from __future__ import annotations

import csv
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TOPK = 20
PER_CLASS = {"calibration": 2, "train": 1}  # the rest of the test face's renderings are measured


def write_pngs(dataset: str, folder: Path) -> Path:
    """The test face's renderings as PNG files under folder/, listed in folder/faces.csv with splits."""
    from PIL import Image

    from trainer.data import load_dataset

    splits = load_dataset(dataset, progress=False)
    x, y = splits.test
    rows, seen = [], {}
    for i in range(len(y)):
        c = int(y[i])
        k = seen.get(c, 0)
        seen[c] = k + 1
        split = "val" if k < PER_CLASS["calibration"] else "train" if k < sum(PER_CLASS.values()) else "test"
        rel = f"png/{c}/{k}.png"
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.asarray(x[i, 0], dtype=np.uint8)).save(folder / rel)
        rows.append((rel, splits.classes[c], split))
    with open(folder / "faces.csv", "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([("path", "label", "split"), *rows])
    return folder / "faces.csv"


def _thresholds(bundle: Path) -> np.ndarray:
    cal = json.loads((bundle / "calibration.json").read_text())
    return np.array([c["threshold"] for c in cal["per_class"]], dtype=np.float64)


def measure(http, bundle: Path, listing: Path) -> dict:
    """Detect recall, pooled and per-class mean precision over HTTP with PNG bodies (`http`: an httpx
    client on the server), on the listing's test rows (a class with no match has precision 1, as in
    the threshold studies)."""
    from urllib.parse import quote

    thr = _thresholds(bundle)
    rows = [r for r in csv.DictReader(open(listing, encoding="utf-8")) if r["split"] == "test"]
    tp, matches = np.zeros(len(thr), np.int64), np.zeros(len(thr), np.int64)  # [D] per class
    unsure = hits = 0
    head = {"Content-Type": "image/png"}
    for r in rows:
        body = (listing.parent / r["path"]).read_bytes()
        det = http.post(f"/v1/classes/{quote(r['label'], safe='')}/detect", content=body, headers=head).json()
        hits += bool(det["results"][0]["match"])
        top = http.post(f"/v1/topk?k={TOPK}&mode=exact", content=body, headers=head).json()["results"][0]
        for e in top:
            if e["logit"] >= thr[e["class_id"]]:
                matches[e["class_id"]] += 1
                tp[e["class_id"]] += e["class_name"] == r["label"]
        unsure += len(top) == TOPK and top[-1]["logit"] >= thr.min()
    per_class = np.where(matches > 0, tp / np.maximum(matches, 1), 1.0)
    return {"images": len(rows), "recall": hits / len(rows), "matches": int(matches.sum()),
            "true_matches": int(tp.sum()), "precision": float(tp.sum() / matches.sum()) if matches.sum() else 1.0,
            "mean_precision": float(per_class.mean()), "unsure_images": int(unsure)}


def served(bundle: Path, work: Path):
    """`slc serve BUNDLE` on a free port, its own SLC_HOME and data dir under `work`, ready
    (tools/bench/server.py; its log in work/server.log); the process to stop."""
    from tools.bench.server import ServerProcess, free_port

    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    srv = ServerProcess([sys.executable, "-m", "slc", "serve", str(bundle), "--port", str(port),
                         "--data-dir", str(work / "data")], port, work / "server.log",
                        env={"SLC_HOME": str(work / "home"), "SLC_INTRA_OP_THREADS": "1"})
    srv.wait_ready(600)
    return srv


def study(run: Path, work: Path | None = None, options: list[str] | None = None) -> dict:
    """Export the run, write the PNGs, recalibrate (`options`: more slc calibrate options), measure both
    bundles over HTTP."""
    import httpx

    work = Path(work or tempfile.mkdtemp(prefix="slc-user-cal-"))
    dataset = json.loads((run / "config.json").read_text())["dataset"]
    slc = [sys.executable, "-m", "slc"]
    before, after = work / "bundle", work / "bundle-recalibrated"
    if not (before / "manifest.json").is_file():
        subprocess.run(slc + ["export", str(run), "--out", str(before)], check=True)
    listing = work / "faces.csv" if (work / "faces.csv").is_file() else write_pngs(dataset, work)
    t0 = time.perf_counter()
    done = subprocess.run(slc + ["calibrate", str(before), "--data", f"csv:{listing}", "--out", str(after), "--overwrite",
                                 *(options or [])],
                          check=True, stdout=subprocess.PIPE, text=True)
    print(done.stdout, end="")
    cal = json.loads((after / "calibration.json").read_text())
    out = {"run": str(run), "dataset": dataset, "per_class": PER_CLASS, "topk": TOPK,
           "recalibrate_s": time.perf_counter() - t0, "method": cal["method"],
           "method_choice": cal.get("method_choice"), "calibrate_output": done.stdout.splitlines(),
           "calibrate_options": list(options or []),
           "adapted_rows": (cal.get("recalibration") or {}).get("adapted_rows")}
    for name, bundle in (("before", before), ("after", after)):
        with served(bundle, work / f"serve-{name}") as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
            out[name] = measure(http, bundle, listing)
    return out


def markdown(r: dict, command: str) -> str:
    from tools.report import md_table

    body = [[name, f"{r[name]['recall']:.3f}", f"{r[name]['precision']:.3f}",
             f"{r[name]['mean_precision']:.3f}" if "mean_precision" in r[name] else "–", f"{r[name]['matches']:,}",
             f"{r[name]['images']:,}", str(r[name]["unsure_images"])] for name in ("before", "after")]
    return "\n".join([
        "# A user's view: detect on an unseen face, before and after `slc calibrate`", "",
        f"Command: `{command}`  \nRun: `{r['run']}` ({r['dataset']}). The test face's renderings as PNG files: "
        f"{r['per_class']['calibration']} per class recalibrate the bundle (`slc calibrate"
        f"{''.join(' ' + o for o in r.get('calibrate_options', []))}`, "
        f"{r['recalibrate_s']:.0f} s), the others are measured over HTTP with PNG bodies: recall from detect, "
        f"precision from every match among each image's top {r['topk']} (tools/experiments/user_calibration.py).", "",
        md_table(["bundle", "detect recall", "achieved precision (pooled)", "mean per-class precision", "matches",
                  "images", "unsure images"], body, "lrrrrrr"), ""] + _calibrate_lines(r))


def _calibrate_lines(r: dict) -> list[str]:
    """What `slc calibrate` printed (the rule it chose and why), when the run recorded it."""
    if not r.get("calibrate_output"):
        return []
    return [f"`slc calibrate` wrote the rule `{r['method']['name']}`. Its output:", "", "```",
            *r["calibrate_output"], "```", ""]
