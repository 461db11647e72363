"""Issue 50's aims on its small folder, measured over HTTP with PNG bodies (docs/results/small-folder-aims.md).

Every held-out image is asked against every class, one `POST /v1/classes/{name}/detect` each, so a
false match on another class's image counts against that class. Recall: the images whose own class
says match; achieved precision: the matches that are the image's own class, over all matches (pooled).

    python -m tools.experiments.small_folder_aims trained BUNDLE --run RUN [--fresh DIR] [--out JSON]
    python -m tools.experiments.small_folder_aims enrolled BUNDLE --run RUN --data DIR --name K [--name L ...]
        [--shots 5] [--seed 0] [--fresh DIR] [--server-env SLC_ENROLL_THRESHOLD=negatives] [--out JSON]

`trained`: the run's test split (and, with --fresh, every image of a second rendering of the folder,
`python -m tools.small_folder DIR --issue50 --seed 1`). `enrolled`: the bundle of a run trained
without class NAME; NAME is enrolled with `slc enroll` from --shots of DIR/NAME's images (drawn by
--seed) and the held-out images are NAME's others and the run's test split of the trained classes
(with --fresh: all of the second rendering, NAME included).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import quote

import numpy as np


def test_files(run: Path, root: Path | None = None) -> list[tuple[Path, str]]:
    """(file, label) of every test-split image of an imagefolder run (its folder at `root` when it has
    moved), from its image cache (built again under SLC_HOME when it is not there: the same split, by
    the run's split seed)."""
    from trainer.data import load_dataset
    from trainer.data.imagefiles import cache_root

    data = json.loads((run / "data.json").read_text())
    root = root or Path(data["dataset"].split(":", 1)[1])
    meta_path = cache_root() / data["fingerprint"][:24] / "meta.json"
    if not meta_path.is_file():
        load_dataset(f"imagefolder:{root}", seed=data["source"]["seed"])
    meta = json.loads(meta_path.read_text())
    start = meta["splits"]["train"] + meta["splits"]["calibration"]
    files = meta["files"][start:start + meta["splits"]["test"]]
    return [(root / f, Path(f).parts[0]) for f in files]


def folder_files(root: Path) -> list[tuple[Path, str]]:
    """(file, label) of every PNG of an image folder, its class the folder name."""
    return [(p, p.parent.name) for p in sorted(root.glob("*/*.png"))]


def ask_all(url: str, images: list[tuple[Path, str]], classes: list[str]) -> np.ndarray:
    """match[i, c]: detect's answer for image i and class c, one PNG-body request each."""
    import httpx

    match = np.zeros((len(images), len(classes)), dtype=bool)
    with httpx.Client(base_url=url, timeout=60) as http:
        for i, (path, _) in enumerate(images):
            body = path.read_bytes()
            for c, name in enumerate(classes):
                r = http.post(f"/v1/classes/{quote(name, safe='')}/detect", content=body,
                              headers={"Content-Type": "image/png"})
                r.raise_for_status()
                match[i, c] = r.json()["results"][0]["match"]
    return match


def figures(match: np.ndarray, labels: list[str], classes: list[str]) -> dict:
    """Recall per class and pooled, achieved precision pooled and per class, the false matches."""
    own = np.array([[lab == c for c in classes] for lab in labels], dtype=bool)  # [N, C]
    tp, fp = (match & own).sum(0), (match & ~own).sum(0)  # [C]
    pos = own.sum(0)
    per_class = {c: {"images": int(pos[k]), "recall": float(tp[k] / pos[k]) if pos[k] else None,
                     "matches": int(tp[k] + fp[k]), "false_matches": int(fp[k])}
                 for k, c in enumerate(classes)}
    recalls = [v["recall"] for v in per_class.values() if v["recall"] is not None]
    matches = int(tp.sum() + fp.sum())
    false = [(labels[i], classes[c]) for i, c in zip(*np.nonzero(match & ~own))]
    return {"images": len(labels), "recall": float(tp.sum() / own.any(1).sum()), "mean_recall": float(np.mean(recalls)),
            "matches": matches, "true_matches": int(tp.sum()),
            "precision": float(tp.sum() / matches) if matches else 1.0,
            "per_class": per_class, "false_matches": [f"{img} image matched {cls}" for img, cls in false]}


class Served:
    """`slc serve BUNDLE` on a free port with its own SLC_HOME and data directory (tools/bench/server.py)."""

    def __init__(self, bundle: Path, work: Path, env: dict | None = None):
        from tools.bench.server import ServerProcess, free_port

        port = free_port()
        self.srv = ServerProcess([sys.executable, "-m", "slc", "serve", str(bundle), "--port", str(port),
                                  "--data-dir", str(work / "data")], port, work / "server.log",
                                 env={"SLC_HOME": str(work / "home"), "SLC_INTRA_OP_THREADS": "1", **(env or {})})
        self.srv.wait_ready(600)
        self.url = self.srv.url

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.srv.stop()


def bundle_classes(bundle: Path) -> list[str]:
    return list(json.loads((bundle / "manifest.json").read_text())["classes"])


def trained(bundle: Path, run: Path, data: Path | None, fresh: Path | None) -> dict:
    """Every test image (and every fresh one) against every class of the bundle."""
    classes = bundle_classes(bundle)
    sets = {"test": test_files(run, data)} | ({"fresh": folder_files(fresh)} if fresh else {})
    out = {"bundle": bundle.name, "calibration": _calibration_note(bundle)}
    with tempfile.TemporaryDirectory() as work, Served(bundle, Path(work)) as srv:
        for name, images in sets.items():
            out[name] = figures(ask_all(srv.url, images, classes), [lab for _, lab in images], classes)
    return out


def enrolled(bundle: Path, run: Path, data: Path, names: list[str], shots: int, seed: int, fresh: Path | None,
             env: dict | None = None) -> dict:
    """Enroll each of NAMES, in order, from `shots` of its images (drawn by seed) with `slc enroll`; ask
    their other images and the run's test split (and every fresh image) against every class, NAMES
    included."""
    examples, held = {}, []
    for name in names:
        own = sorted((data / name).glob("*.png"))
        pick = sorted(np.random.default_rng(seed).choice(len(own), size=shots, replace=False).tolist())
        examples[name] = [own[i] for i in pick]
        held += [(p, name) for i, p in enumerate(own) if i not in pick]
    classes = bundle_classes(bundle) + list(names)
    sets = {"held_out": held + test_files(run)} | ({"fresh": folder_files(fresh)} if fresh else {})
    out = {"bundle": bundle.name, "enrolled": names[0] if len(names) == 1 else list(names),
           "examples": {n: [p.name for p in e] for n, e in examples.items()} if len(names) > 1 else
           [p.name for p in examples[names[0]]], "draw_seed": seed, "server_env": env or {}}
    with tempfile.TemporaryDirectory() as work, Served(bundle, Path(work), env) as srv:
        said = [subprocess.run([sys.executable, "-m", "slc", "enroll", srv.url, name, *map(str, examples[name])],
                               capture_output=True, text=True, check=True).stdout.strip() for name in names]
        out["enroll_output"] = "\n".join(said)
        listed = {c["class_name"]: c for c in _get(srv.url, "/v1/classes")["classes"]}
        out["class"] = listed[names[0]] if len(names) == 1 else {n: listed[n] for n in names}
        for key, images in sets.items():
            out[key] = figures(ask_all(srv.url, images, classes), [lab for _, lab in images], classes)
    return out


def _get(url: str, path: str) -> dict:
    import httpx

    return httpx.get(url + path, timeout=60).json()


def _calibration_note(bundle: Path) -> dict:
    cal = json.loads((bundle / "calibration.json").read_text())
    return {k: cal.get(k) for k in ("target", "method", "shift", "global")} | {
        "thresholds": [round(float(c["threshold"]), 4) for c in cal["per_class"]]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["trained", "enrolled"])
    p.add_argument("bundle", type=Path)
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--data", type=Path, help="trained: the run's folder when it has moved; enrolled: the full folder, "
                   "NAME's images under DATA/NAME")
    p.add_argument("--name", action="append", help="enrolled: a class left out of the run, enrolled in the order "
                   "given (repeat for several) [default: K]")
    p.add_argument("--shots", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fresh", type=Path)
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="enrolled: a setting of the server, e.g. SLC_ENROLL_THRESHOLD=negatives")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    env = dict(kv.split("=", 1) for kv in a.server_env)
    r = trained(a.bundle, a.run, a.data, a.fresh) if a.mode == "trained" else \
        enrolled(a.bundle, a.run, a.data, a.name or ["K"], a.shots, a.seed, a.fresh, env)
    text = json.dumps(r, indent=1)
    if a.out:
        a.out.write_text(text + "\n")
    summary = {k: {m: v[m] for m in ("images", "recall", "mean_recall", "matches", "precision")}
               for k, v in r.items() if isinstance(v, dict) and "per_class" in v}
    print(json.dumps(summary), file=sys.stderr)


if __name__ == "__main__":
    main()
