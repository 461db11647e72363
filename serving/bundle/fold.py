"""`slc bundle fold BUNDLE --from DATA_DIR|URL --out NEW`: a bundle whose head holds the enrolled
classes (issue 38) as ordinary rows, written without torch.

NEW = BUNDLE with:
  head_weight.npy / head_bias.npy   [D + n, d] / [D + n]: the trained rows, then the n enrolled rows
                                    in id order (slot order), so enrolled class D + slot gets id D + i
                                    (the same as on the server when no enrolled class was ever deleted)
  classes                           the enrolled names appended
  calibration.json                  per_class extended with each enrolled class's threshold and Platt
                                    a/b (and an `enrolled` note: name, examples, rule, slot); `global` kept;
                                    `lookalikes` {pairs}: BUNDLE's pairs and each enrolled class D + i with
                                    its look-alikes (enrolled ones at their folded ids), so detect decides
                                    as the server did
  full.onnx / single.onnx,          the new head's (serving/bundle/newhead.py): graphs over it, samples
  samples.npz, heads                recomputed (with a sample column and class id of an enrolled class),
                                    quantized heads when BUNDLE had them
  manifest                          `folded` {from_digest, from_name, enrolled: [{name, class_id, enrolled_id}]},
                                    hashed; every other file (backbone.onnx, calibration negatives) copied
The result is verified (`slc verify`) before it replaces NEW.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from serving.bundle import output
from serving.bundle.class_row import ClassRow
from serving.bundle.format import MANIFEST, SELF_HASH_KEY, carry_files, json_load, write_manifest
from serving.bundle.names import enrolled_class_problem, shown
from serving.bundle.newhead import write_new_head
from serving.core.lookalikes import DECISION_WITH_PAIRS, Lookalikes, from_calibration

CALIBRATION = "calibration.json"
LOOKALIKES_NOTE = ("classes of a pair: an input matches only the one whose logit passes its threshold by more "
                   "(docs/api.md, Look-alikes)")


def fold_bundle(src: Path | str, classes: list[ClassRow], out: Path | str, overwrite: bool = False) -> Path:
    """Write NEW (module docstring) from BUNDLE and its enrolled classes (in slot order); returns `out`.
    ValueError, one line, when there is nothing to fold or the result does not verify."""
    from serving.bundle.loader import load_bundle

    src, out = Path(src), Path(out)
    if not classes:
        raise ValueError(f"no enrolled classes of {src} to fold")
    output.check(out, "bundle", overwrite=overwrite, inputs=[src])  # before the bundle is read
    bundle = load_bundle(src, verify=True)
    classes = sorted(classes, key=lambda c: c.slot)
    _check_classes(bundle, classes)
    with output.staged(out, "bundle", overwrite=overwrite, inputs=[src], verify=_verified) as stage:
        bias = np.concatenate([np.asarray(bundle.bias, dtype=np.float32),
                               np.array([c.bias for c in classes], np.float32)])
        head = write_new_head(src, stage, [bundle.weight, np.stack([c.row for c in classes])], bias, bundle.manifest,
                              trained=bundle.num_classes)
        known = carry_files(src, stage, bundle.manifest["files"], skip=head.replaced | {CALIBRATION})
        _write_calibration(src, stage, bundle, classes)
        write_manifest(stage, _manifest(src, bundle, classes, head.manifest), known_hashes=known)
    return out


def _verified(stage: Path) -> list[str]:
    from serving.bundle.verify import verify_bundle

    if problems := verify_bundle(stage):
        raise ValueError(f"the folded bundle does not verify: {problems[0]}")
    return []


def _check_classes(bundle, classes: list[ClassRow]) -> None:
    """ValueError naming the first class fold must not carry into a bundle: one a server would refuse
    to serve (serving/bundle/names.py and calibration.py hold the rules the server applies too), a
    trained class's name, or a name twice. Before anything is written."""
    names = set()
    for c in classes:
        problem = enrolled_class_problem(c, bundle.embed_dim)
        if problem is None and _is_trained(bundle, c.name):
            problem = "its name is that of a class of the bundle"
        if problem is None and c.name in names:
            problem = "its name appears twice"
        if problem:
            raise ValueError(f"enrolled class {shown(str(c.name))} (slot {c.slot}): {problem}; nothing was folded")
        names.add(c.name)


def _is_trained(bundle, name: str) -> bool:
    try:
        bundle.class_id(name)
        return True
    except KeyError:
        return False


def _write_calibration(src: Path, stage: Path, bundle, classes: list[ClassRow]) -> None:
    cal = json_load((src / CALIBRATION).read_bytes())
    D = bundle.num_classes
    for i, c in enumerate(classes):
        cal["per_class"].append({"class_id": D + i, "threshold": c.threshold, "platt": {"a": c.platt_a, "b": c.platt_b},
                                 "enrolled": {"name": c.name, "examples": c.examples, "rule": c.rule, "slot": c.slot}})
    cal["enrolled"] = {"count": len(classes), "note": "enrolled classes' thresholds and Platt a/b come from the "
                       "enrollment rule (docs/api.md), not from the calibration split"}
    if pairs := folded_pairs(cal, D, classes):
        cal["lookalikes"] = {"pairs": pairs, "note": LOOKALIKES_NOTE}
        cal["decision"] = DECISION_WITH_PAIRS
    else:
        cal.pop("lookalikes", None)
    (stage / CALIBRATION).write_text(json.dumps(cal, allow_nan=False) + "\n")


def folded_pairs(cal: dict, D: int, classes: list[ClassRow]) -> list[list[int]]:
    """The folded bundle's look-alike pairs, each [smaller, larger] once, sorted: the source calibration's
    (ids 0..D-1, kept) and, for the i-th folded class (id D + i), one with each of its look-alikes: a
    trained id as it is, an enrolled id D + slot as the id its class is folded to (none: left out)."""
    folded = {D + c.slot: D + i for i, c in enumerate(classes)}
    mine = [(D + i, int(t) if int(t) < D else folded[int(t)]) for i, c in enumerate(classes) for t in c.lookalikes
            if 0 <= int(t) < D or int(t) in folded]
    return Lookalikes([*map(tuple, from_calibration(cal, D).pairs()), *mine]).pairs()


def _manifest(src: Path, bundle, classes: list[ClassRow], head: dict) -> dict:
    from serving.bundle.format import base_manifest

    old = json_load((src / MANIFEST).read_bytes())
    D = bundle.num_classes
    names = [str(c) for c in old["classes"]] + [c.name for c in classes]
    keep = {k: v for k, v in old.items() if k not in ("files", SELF_HASH_KEY, "classes", "num_classes", "heads",
                                                       "created", "format", "format_version")}
    keep["external_data"] = head["external_data"]
    keep["folded"] = {"from_name": old.get("name"), "from_digest": bundle.digest,
                      "enrolled": [{"name": c.name, "class_id": D + i, "enrolled_id": D + c.slot}
                                   for i, c in enumerate(classes)]}
    manifest = base_manifest(keep.pop("name"), keep.pop("input")["shape"], keep.pop("embed_dim"), names,
                             keep.pop("loss", {}), keep.pop("backbone", {}), keep.pop("training", {}),
                             version=keep.pop("version", "1"), **keep)
    if "heads" in head:
        manifest["heads"] = head["heads"]
    return manifest
