"""Characters no model here was trained on, enrolled over HTTP into a served glyphs3755 bundle, and
what they then claim (docs/results/small-folder-aims.md, "Thresholds chosen for the decision").

    python -m tools.experiments.enroll_glyphs_http BUNDLE [--classes 300] [--shots 5]
        [--server-env SLC_ENROLL_RULE=fitted] [--cache NPZ] --out JSON

Every 10th GB2312 level-2 character (`--classes` of them; enroll_glyphs.py's `new_chars`) is enrolled
with one `PUT /v1/classes/new{i}` from `--shots` renderings of the training and calibration faces; then
its 8 test-face renderings, and one rendering of every trained class in each of two held-out faces
(adapt_no_forget.py's), are asked of every class at once by `POST /v1/topk` (k 16, matches only), so
the enrolled classes' matches are the server's decisions, look-alikes applied. Enrolled columns only:
recall on their test renderings; pooled precision (their true matches over all their matches: on the
other new characters' renderings and on the trained classes' held-out renderings).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

EVERY = 10  # every 10th level-2 character: spread over the code order
BATCH = 256


def renderings(classes: list[str], count: int, shots: int, cache: Path | None) -> dict:
    """{chars, ex [C, shots, 1, S, S], test [C, 8, 1, S, S], neg_x [N, 1, S, S], neg_y [N]} uint8, rendered
    once into `cache` when given."""
    from tools.experiments.adapt_no_forget import held_out_faces, render_face
    from tools.experiments.enroll_glyphs import new_chars, render

    if cache is not None and cache.is_file():
        with np.load(cache) as f:
            return {k: f[k] for k in f.files} | {"chars": str(f["chars"])}
    chars = new_chars(classes)[::EVERY][:count]
    ex, test = render(chars, shots)
    parts = [render_face(face, "".join(classes), 1, 7000 + k) for k, face in enumerate(held_out_faces().values())]
    out = {"chars": chars, "ex": ex, "test": test, "neg_x": np.concatenate([p[0] for p in parts]),
           "neg_y": np.concatenate([p[1] for p in parts])}
    if cache is not None:
        np.savez(cache, **out)
    return out


def matched(client, x: np.ndarray, scale: float) -> list[list[int]]:
    """Per input of x [n, 1, S, S] uint8, the class ids that match it (the server's /v1/topk, k 16)."""
    got = []
    for s in range(0, len(x), BATCH):
        body = {"inputs": (x[s:s + BATCH].astype(np.float32) * scale).tolist(), "k": 16, "matches_only": True}
        r = client.post("/v1/topk", json=body)
        r.raise_for_status()
        got += [[e["class_id"] for e in row] for row in r.json()["results"]]
    return got


def study(bundle: Path, count: int, shots: int, env: dict, cache: Path | None) -> dict:
    import httpx

    from tools.experiments.small_folder_aims import Served

    manifest = json.loads((bundle / "manifest.json").read_text())
    classes, scale = list(manifest["classes"]), float(manifest["image"].get("scale", 1.0))
    r = renderings(classes, count, shots, cache)
    with tempfile.TemporaryDirectory() as work, Served(bundle, Path(work), env) as srv, \
            httpx.Client(base_url=srv.url, timeout=600) as client:
        t0, ids = time.perf_counter(), []
        for i, ex in enumerate(r["ex"]):
            answer = client.put(f"/v1/classes/new{i}", json={"inputs": (ex.astype(np.float32) * scale).tolist()})
            answer.raise_for_status()
            ids.append(answer.json()["class_id"])
        seconds = time.perf_counter() - t0
        rules = sorted({c["rule"] for c in client.get("/v1/classes").json()["classes"]})
        test = r["test"].reshape(-1, *r["test"].shape[2:])
        on_test, on_neg = matched(client, test, scale), matched(client, r["neg_x"], scale)
    own = np.repeat(np.asarray(ids), r["test"].shape[1])  # [C * 8] each test rendering's enrolled id
    return {"bundle": bundle.name, "server_env": env, "enrolled": len(ids), "shots": shots, "rules": rules,
            "enroll_seconds": round(seconds, 1), **tally(ids, own, on_test, on_neg, len(classes))}


def tally(ids, own, on_test: list[list[int]], on_neg: list[list[int]], num_trained: int) -> dict:
    """The enrolled columns' figures from the matches: `own` [n] the class of each test rendering,
    on_test / on_neg the class ids matching each test / held-out rendering."""
    enrolled, own = set(int(c) for c in ids), [int(o) for o in own]
    tp = sum(int(o in row) for o, row in zip(own, on_test))
    fp_new = sum(sum(c in enrolled and c != o for c in row) for o, row in zip(own, on_test))
    fp_trained = sum(sum(c in enrolled for c in row) for row in on_neg)
    return {"test_images": len(on_test), "held_out_images": len(on_neg), "recall": tp / max(len(on_test), 1),
            "true_matches": tp, "false_on_new": fp_new, "false_on_trained": fp_trained,
            "pooled_precision": tp / (tp + fp_new + fp_trained) if tp + fp_new + fp_trained else 1.0,
            "trained_claims_on_new": sum(sum(c < num_trained for c in row) for row in on_test)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bundle", type=Path)
    p.add_argument("--classes", type=int, default=300)
    p.add_argument("--shots", type=int, default=5)
    p.add_argument("--server-env", action="append", default=[], help="KEY=VALUE for the server")
    p.add_argument("--cache", type=Path, help="an .npz the renderings are kept in between runs")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    env = dict(kv.split("=", 1) for kv in a.server_env)
    result = study(a.bundle, a.classes, a.shots, env, a.cache)
    a.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("server_env",)}))


if __name__ == "__main__":
    main()
