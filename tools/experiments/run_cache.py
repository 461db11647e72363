"""The experiments' run cache: one key, one function (`slc experiment table1` and `glyphs`).

A cached run is keyed by its resolved TrainConfig and by a hash of the code that produced it: the
training code every run shares plus the module of its own loss. Fix a loss, its initialisation or
the training loop, and the runs it touched are trained again, never silently reused; edit one loss
family and only its runs are.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import logging
from dataclasses import asdict
from pathlib import Path

log = logging.getLogger(__name__)

COMMON_CODE = ("trainer/train.py", "trainer/loader.py", "trainer/augment.py", "trainer/device.py",
               "trainer/checkpoint.py", "trainer/sampled_head.py", "trainer/sharded_head.py", "trainer/distributed.py",
               "trainer/metrics.py", "trainer/losses/__init__.py", "trainer/losses/init.py", "trainer/data/*.py",
               "models/*.py")
PENDING = "pending"  # a run neither cached nor to be trained now


def code_fingerprint(loss: str) -> str:
    """Hash of the code a run of `loss` depends on (file names and contents)."""
    from trainer.losses import loss_class

    root = Path(__file__).resolve().parents[2]  # the checkout: tools/experiments/run_cache.py
    files = [path for pattern in COMMON_CODE for path in sorted(root.glob(pattern))]
    files.append(Path(inspect.getsourcefile(loss_class(loss))).resolve())
    h = hashlib.sha256()
    for path in files:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def run_key(cfg) -> str:
    """The cache key of a run: its config and its code."""
    return hashlib.sha256(json.dumps([asdict(cfg), code_fingerprint(cfg.loss)], sort_keys=True,
                                     default=str).encode()).hexdigest()[:20]


def run_path(cache: Path, cfg) -> Path:
    name = f"{cfg.dataset.replace(':', '_').replace('/', '_')}-{cfg.loss}-R{cfg.head_sample:g}-lr{cfg.lr:g}-s{cfg.seed}"
    return Path(cache) / f"{name}-{run_key(cfg)}"


def cached_run(cache: Path, cfg, progress: bool = False, train_missing: bool = True) -> tuple[Path | None | str, bool]:
    """(run directory, None when the loss diverged, or PENDING; trained now?). Failures are
    remembered (failed.json) like successes."""
    from trainer.train import train

    run = run_path(cache, cfg)
    if (run / "failed.json").exists():
        return None, False
    if (run / "metrics.json").exists():
        return run, False
    if not train_missing:
        return PENDING, False
    try:
        train(cfg, run, progress=progress, overwrite=True)  # a half-written run of this key is replaced
    except FloatingPointError as err:
        run.mkdir(parents=True, exist_ok=True)
        (run / "failed.json").write_text(json.dumps({"error": str(err), "code": code_fingerprint(cfg.loss)}))
        log.info("  %s lr=%g seed %d diverged: %s", cfg.loss, cfg.lr, cfg.seed, err)
        return None, True
    (run / "code.json").write_text(json.dumps({"code": code_fingerprint(cfg.loss)}))
    return run, True
