"""The embedded default model of `slc serve` with no BUNDLE (docs/cli.md).

First use: train an mlp on mnist5k with batch_ce, export and calibrate it into
$SLC_HOME/default-bundle; later starts reuse it. Training and export run as
`python -m slc train/export` subprocesses, so the server process never imports torch (and a
serving image without torch fails here with a clear message, not an ImportError deep down).
A lock file keeps two servers starting at once from building it twice; the bundle is
written to a temporary directory and renamed into place, so a crash never leaves half a bundle.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from serving.bundle import output
from serving.bundle.cliopts import slc_command

log = logging.getLogger(__name__)

# lr / optimizer: what the calibration-split search of the Table 1 experiment chose for batch_ce on this
# same data (mnist5k, mlp).
RECIPE = {"dataset": "mnist5k", "backbone": "mlp", "loss": "batch_ce", "epochs": "20", "seed": "0",
          "optimizer": "sgd", "lr": "0.01"}


def default_bundle_path(home: Path) -> Path:
    return Path(home) / "default-bundle"


def example_request_path(home: Path) -> Path:
    """A detect request body holding one image of a 7 (from the bundle's samples), for the curl printed at start."""
    return Path(home) / "example-7.json"


def write_example(bundle: Path, path: Path, class_name: str = "7") -> bool:
    """The first sample input whose true label is `class_name` as a detect body; False when none is."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    with np.load(bundle / "samples.npz", allow_pickle=False) as samples:
        if "label" not in samples.files or class_name not in manifest["classes"]:
            return False
        hits = np.flatnonzero(samples["label"] == manifest["classes"].index(class_name))
        if hits.size == 0:
            return False
        x = samples["input"][hits[0]]
    path.write_text(json.dumps({"inputs": [x.astype(float).tolist()]}))
    image = manifest.get("image")
    if image and image.get("layout") == "flat" and image.get("channels") == 1:  # the same 7 as a PNG
        from PIL import Image

        pixels = np.clip(np.rint(x.reshape(image["height"], image["width"]) / image.get("scale", 1.0)), 0, 255)
        Image.fromarray(pixels.astype(np.uint8)).save(path.with_suffix(".png"))
    return True


def curl_hint(home: Path, host: str, port: int) -> str | None:
    example = example_request_path(home)
    if not example.is_file():
        return None
    hint = (f"is this image a 7?  curl -s -X POST http://{host}:{port}/v1/classes/7/detect "
            f"-H 'content-type: application/json' -d @{example}")
    if example.with_suffix(".png").is_file():
        hint += (f"\n  or as an image:  curl -s -X POST http://{host}:{port}/v1/classes/7/detect "
                 f"-H 'content-type: image/png' --data-binary @{example.with_suffix('.png')}"
                 f"\n  or draw one:  http://{host}:{port}/demo")
    return hint


INLINE_VALUES = 32  # a sample input of at most this many values is pasted into the curl; larger: zeros built by python3


def bundle_curl_hint(bundle, host: str, port: int) -> str:
    """A ready-to-paste curl asking the served bundle about its first class: an image body for an
    image bundle, else JSON (a sample input from samples.npz when small, else zeros of the input shape)."""
    import math
    from urllib.parse import quote

    shown = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, f"[{host}]" if ":" in host else host)
    name = str(bundle.classes[0])
    url = f"http://{shown}:{port}/v1/classes/{quote(name, safe='')}/detect"
    if bundle.image is not None:
        return (f"is this image of class {name}?  curl -s -X POST {url} -H 'Content-Type: image/png' "
                f"--data-binary @IMAGE.png")
    size = math.prod(bundle.input_shape)
    if size <= INLINE_VALUES:
        body = "'" + json.dumps({"inputs": [_sample(bundle, size)]}) + "'"
    else:
        body = f"\"$(python3 -c 'import json; print(json.dumps({{\"inputs\": [[0.0] * {size}]}}))')\""
    return f"is this input of class {name}?  curl -s -X POST {url} -H 'Content-Type: application/json' -d {body}"


def _sample(bundle, size: int) -> list:
    """The bundle's first sample input, flat (zeros when it has none)."""
    try:
        with np.load(Path(bundle.path) / "samples.npz", allow_pickle=False) as samples:
            return [round(float(v), 6) for v in np.asarray(samples["input"][0]).reshape(-1)]
    except (OSError, KeyError, ValueError, IndexError):
        return [0.0] * size


def ensure_default_bundle(home: Path) -> Path:
    """The default bundle's path, building it first if it does not exist yet."""
    home = Path(home)
    bundle = default_bundle_path(home)
    if (bundle / "manifest.json").is_file():
        return bundle
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "default-bundle.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is building the default model; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if (bundle / "manifest.json").is_file():  # built by the process we waited for
            return bundle
        _build(home, bundle)
    return bundle


def _build(home: Path, bundle: Path) -> None:
    work = home / f"default-build-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    run, staged = work / "slc-default-mnist5k-mlp-batch_ce", work / "bundle"  # run name -> bundle name
    project_root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(project_root), os.environ.get("PYTHONPATH")])))
    train = [sys.executable, "-m", "slc", "train", "--dataset", RECIPE["dataset"], "--backbone", RECIPE["backbone"],
             "--loss", RECIPE["loss"], "--epochs", RECIPE["epochs"], "--seed", RECIPE["seed"],
             "--optimizer", RECIPE["optimizer"], "--lr", RECIPE["lr"], "--out", str(run)]
    export = [sys.executable, "-m", "slc", "export", str(run), "--out", str(staged)]
    log.info("no default model in %s yet: training %s (one time; a few minutes on 2 cores)", bundle,
             " ".join(f"{k}={v}" for k, v in RECIPE.items()))
    t0 = time.perf_counter()
    try:
        for step, cmd in (("train", train), ("export", export)):
            done = subprocess.run(cmd, env=env, cwd=str(project_root))  # inherits the terminal: progress bar shows
            if done.returncode != 0:
                raise RuntimeError(f"building the default model failed at `{step}` (exit {done.returncode}); "
                                   f"the training extras are needed once: pip install 'slc[train]'; "
                                   f"or serve a bundle: {slc_command()} serve BUNDLE")
        write_example(staged, example_request_path(home))
        output.replace_cache(staged, bundle, "bundle")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("default model built in %.0f s: %s", time.perf_counter() - t0, bundle)
