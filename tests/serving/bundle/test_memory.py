"""serving.bundle at large D: compact class names and calibration, same answers as the plain lists.

The references here are the obvious Python structures (a list of names, the parsed JSON
entries, the old dict-then-int class lookup); the compact forms must agree with them.
"""
from __future__ import annotations

import gc
import json
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from serving.bundle import IdNames, PerClassCalibration, compact_names, load_bundle, write_manifest
from serving.bundle.synthetic import build_synthetic_bundle


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return build_synthetic_bundle(classes=120, dim=8, input_dim=4, seed=5, out=tmp_path_factory.mktemp("m") / "bundle")


def reference_class_id(names: list[str], ref) -> int:
    """The lookup rule written out plainly: a name first, else an integer id (int or decimal string)."""
    by_name = {n: i for i, n in enumerate(names)}
    if isinstance(ref, (int, np.integer)) and not isinstance(ref, bool):
        if 0 <= int(ref) < len(names):
            return int(ref)
        raise KeyError(ref)
    if isinstance(ref, str):
        if ref in by_name:
            return by_name[ref]
        if ref.isascii() and ref.lstrip("-").isdigit() and 0 <= int(ref) < len(names):  # no trimming: " 7" is not 7
            return int(ref)
    raise KeyError(ref)


def test_id_names_behave_like_the_list():
    n = 37
    ref = [str(j) for j in range(n)]
    names = IdNames(n)
    assert len(names) == n and list(names) == ref and names == ref and ref == names
    assert names != ref[:-1] and names != ref[:-1] + ["x"] and names == IdNames(n) and names != IdNames(n + 1)
    for j in (0, 5, n - 1, -1, -n, np.int64(7)):
        assert names[j] == ref[j]
    for sl in (slice(None, 10), slice(3, 30, 4), slice(-5, None), slice(None, None, -3)):
        assert names[sl] == ref[sl]
    for bad in (n, -n - 1):
        with pytest.raises(IndexError):
            names[bad]
    for text in ("0", "36", "37", "007", "-1", " 3", "x", "", "٣", 3):
        assert (text in names) == (text in ref), text
        if text in ref:
            assert names.index(text) == ref.index(text)
        else:
            with pytest.raises(ValueError):
                names.index(text)


def test_compact_names_only_for_identity_names():
    assert isinstance(compact_names([str(j) for j in range(50)]), IdNames)
    assert isinstance(compact_names(list(range(50))), IdNames)  # ints in a manifest are names too
    for other in ([str(j + 1) for j in range(50)], ["0", "2", "1"], ["cat", "dog"], ["00", "1"]):
        out = compact_names(other)
        assert isinstance(out, list) and out == [str(c) for c in other]


def test_synthetic_bundle_names_and_lookup_match_the_list(pristine, tmp_path):
    b = load_bundle(pristine, verify=False)
    listed = [str(c) for c in json.loads((pristine / "manifest.json").read_text())["classes"]]
    assert isinstance(b.classes, IdNames) and b.classes == listed and b.manifest["classes"] == listed
    refs = [0, 7, 119, 120, -1, np.int64(5), True, "0", "7", "007", " 7", "119", "120", "-1", "-0", "cat", "", "1e2"]
    for ref in refs:
        try:
            want = reference_class_id(listed, ref)
        except KeyError:
            with pytest.raises(KeyError):
                b.class_id(ref)
        else:
            assert b.class_id(ref) == want, ref
    # names that are not the ids keep the list and its name-first rule
    named = Path(shutil.copytree(pristine, tmp_path / "named"))
    manifest = json.loads((named / "manifest.json").read_text())
    manifest["classes"] = [str(j + 1) for j in range(120)]
    write_manifest(named, manifest)
    nb = load_bundle(named, verify=False)
    assert isinstance(nb.classes, list)
    for ref in refs:
        try:
            want = reference_class_id(manifest["classes"], ref)
        except KeyError:
            with pytest.raises(KeyError):
                nb.class_id(ref)
        else:
            assert nb.class_id(ref) == want, ref


def test_per_class_view_matches_the_json(pristine, tmp_path):
    rich = Path(shutil.copytree(pristine, tmp_path / "rich"))
    cal = json.loads((rich / "calibration.json").read_text())
    rng = np.random.default_rng(0)
    for e in cal["per_class"]:
        e["precision"], e["recall"] = float(rng.uniform()), float(rng.uniform())
        e["test"] = {"precision": float(rng.uniform()), "recall": float(rng.uniform()), "positives": 3}
    (rich / "calibration.json").write_text(json.dumps(cal))
    write_manifest(rich, json.loads((rich / "manifest.json").read_text()))
    for path, extra in ((pristine, False), (rich, True)):
        want = json.loads((path / "calibration.json").read_text())
        b = load_bundle(path)
        view = b.calibration["per_class"]
        assert isinstance(view, PerClassCalibration) and len(view) == b.num_classes == len(want["per_class"])
        assert {k: v for k, v in b.calibration.items() if k != "per_class"} == {
            k: v for k, v in want.items() if k != "per_class"}
        for j in (0, 1, 64, b.num_classes - 1):
            got, ref = view[j], want["per_class"][j]
            assert got["class_id"] == ref["class_id"] == j
            assert ("precision" in got) == ("test" in got) == extra
            for keys in (("threshold",), ("platt", "a"), ("platt", "b")) + (
                    (("precision",), ("recall",), ("test", "precision"), ("test", "recall")) if extra else ()):
                g, r = got, ref
                for k in keys:
                    g, r = g[k], r[k]
                assert g == pytest.approx(r, rel=1e-6, abs=1e-7), (j, keys)
        assert view[-1] == view[b.num_classes - 1] and view[:2] == [view[0], view[1]]
        with pytest.raises(IndexError):
            view[b.num_classes]


def test_loaded_bundle_holds_no_per_class_python_objects(tmp_path):
    """Memory kept by a loaded bundle grows by the float32 arrays per class (5 x 4 bytes), not by dicts.

    The old loader kept ~600 bytes per class (a dict per calibration entry, a str per name).
    """
    D = 30_000
    path = build_synthetic_bundle(classes=D, dim=4, input_dim=4, seed=1, out=tmp_path / "big")
    gc.collect()
    tracemalloc.start()
    try:
        b = load_bundle(path, verify=False)
        gc.collect()
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert b.num_classes == D and b.classes[D - 1] == str(D - 1)
    assert kept < 40 * D, f"{kept / D:.0f} bytes kept per class"


def _resident_kib(path: Path) -> int:
    """KiB of `path`'s mappings in this process that are in RAM (/proc/self/smaps)."""
    total, current = 0, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            current = fields[5] if len(fields) >= 6 else None
        elif fields[0] == "Rss:" and current == str(path):
            total += int(fields[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc/self/smaps")
def test_a_verified_load_leaves_the_heads_out_of_ram(tmp_path):
    """Verification reads sample rows of every head (and hashes the files, so they sit in the page
    cache, where each row read maps ~64 KiB around it): the loaded bundle's mappings must not keep
    that: a float32 server would otherwise hold its int8 and bf16 heads as well (measured: +0.75 of
    the head at D = 10^6)."""
    from serving.bundle.heads import add_heads

    path = build_synthetic_bundle(classes=40_000, dim=32, input_dim=4, seed=2, out=tmp_path / "q")
    add_heads(path, ("int8", "bf16"))
    bundle = load_bundle(path, verify=True)
    sizes = {name: (path / name).stat().st_size // 1024 for name in ("head_weight.npy", "head_int8.npy", "head_bf16.npy")}
    resident = {name: _resident_kib((path / name).resolve()) for name in sizes}
    assert all(resident[n] <= sizes[n] // 10 for n in sizes), (resident, sizes)
    assert set(bundle.heads) == {"int8", "bf16"}
    np.testing.assert_array_equal(bundle.heads["int8"]["weight"][7], np.load(path / "head_int8.npy")[7])
