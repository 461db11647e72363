"""`slc bench agreement`: does the server, over HTTP, give the offline answers on a labelled split?

A bundle exported by `slc export` carries, in calibration.json, each class's precision and
recall on the run's test split, computed offline from the graph's logits at the class's
threshold. Here the same inputs go through a running `slc serve`: top-1 of `/v1/topk` against
the labels (the offline accuracy is in the manifest's test_metrics), and, for a sample of
classes, `/v1/classes/{j}/detect` over every input, whose matches give per-class precision and
recall to compare with calibration.json. Classes with a logit within 1e-4 of their threshold
may flip one decision (the export measured with onnxruntime's full graph, the server answers
with the single-class graph); they are counted apart.
"""
from __future__ import annotations

import json
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np

from tools.bench.server import slc_server
from tools.report import md_table
from serving.bundle import load_bundle


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def measure(bundle_dir: Path, inputs: np.ndarray, labels: np.ndarray, classes: int = 50, batch: int = 256,
            seed: int = 0) -> dict:
    bundle = load_bundle(bundle_dir, verify=False)
    per_class = bundle.calibration["per_class"]
    rng = np.random.default_rng(seed)
    picked = np.sort(rng.choice(bundle.num_classes, size=min(classes, bundle.num_classes), replace=False))
    chunks = [np.asarray(inputs[i:i + batch], np.float32).tolist() for i in range(0, len(inputs), batch)]
    with tempfile.TemporaryDirectory(prefix="slc-agreement-") as tmp:
        with slc_server(bundle_dir, Path(tmp), "agreement", Path(tmp) / "data") as srv:  # 256 inputs per request
            srv.wait_ready(900)
            top1 = np.concatenate([[row[0]["class_id"] for row in _post(f"{srv.url}/v1/topk", {"inputs": c, "k": 1})["results"]]
                                   for c in chunks])
            rows = [_class_agreement(srv.url, bundle, per_class[int(j)], int(j), chunks, labels) for j in picked]
    offline_acc = (bundle.manifest.get("test_metrics") or {}).get("accuracy")
    clear = [r for r in rows if not r["borderline"]]
    return {"bundle": bundle.name, "examples": int(len(labels)), "http_accuracy": float(np.mean(top1 == labels)),
            "offline_accuracy": offline_acc, "classes_checked": len(rows), "borderline": int(sum(r["borderline"] for r in rows)),
            "classes_equal": int(sum(r["equal"] for r in clear)), "classes_clear": len(clear), "rows": rows}


def _class_agreement(url: str, bundle, entry: dict, j: int, chunks: list, labels: np.ndarray) -> dict:
    ref = urllib.parse.quote(str(bundle.classes[j]), safe="")
    results = [res for c in chunks for res in _post(f"{url}/v1/classes/{ref}/detect", {"inputs": c})["results"]]
    match = np.array([r["match"] for r in results])
    logit = np.array([r["logit"] for r in results])
    positive = labels == j
    tp = int((match & positive).sum())
    precision = tp / match.sum() if match.any() else 1.0
    recall = tp / positive.sum() if positive.any() else 0.0
    t = entry["threshold"]
    want = entry.get("test", {})
    return {"class_id": j, "http": [float(precision), float(recall)], "offline": [want.get("precision"), want.get("recall")],
            "equal": bool(abs(precision - want.get("precision", -1)) < 1e-12 and abs(recall - want.get("recall", -1)) < 1e-12),
            "borderline": bool(np.any(np.abs(logit - t) <= 1e-4 * max(1.0, abs(t))))}


def markdown(r: dict, command: str) -> str:
    acc = f"{r['offline_accuracy']:.4f}" if r["offline_accuracy"] is not None else "—"
    return "\n".join([
        f"# HTTP against offline: `{r['bundle']}`", "", f"Command: `{command}`", "",
        f"The test split ({r['examples']:,} inputs) sent to a running `slc serve` (tools/bench/agreement.py).", "",
        md_table(["check", "over HTTP", "offline (export)"], [
            ["top-1 accuracy from `/v1/topk`", f"{r['http_accuracy']:.4f}", acc],
            ["classes whose detect precision and recall equal calibration.json's test figures",
             f"{r['classes_equal']} of {r['classes_clear']}", "—"],
            ["classes with a logit within 1e-4 of the threshold (not compared)", f"{r['borderline']} of {r['classes_checked']}",
             "—"]], "lrr"),
        ""])
