"""`slc bundle fold BUNDLE --from DATA_DIR|URL --out NEW`: a bundle whose head holds the enrolled
classes (issue 38) as ordinary rows, written without torch.

NEW = BUNDLE with:
  head_weight.npy / head_bias.npy   [D + n, d] / [D + n]: the trained rows, then the n enrolled rows
                                    in id order (slot order), so enrolled class D + slot gets id D + i
                                    (the same as on the server when no enrolled class was ever deleted)
  classes                           the enrolled names appended
  calibration.json                  per_class extended with each enrolled class's threshold and Platt
                                    a/b (and an `enrolled` note: name, examples, rule, slot); `global` kept
  full.onnx / single.onnx           rebuilt from backbone.onnx + a Gemm / Gather over the new head,
                                    their W and b ONNX external data pointing into the .npy files
                                    (serving/bundle/synthetic.py's layout)
  samples.npz                       the same inputs, expected outputs recomputed (onnxruntime backbone,
                                    float64 head), a sample column and class id of an enrolled class
  heads (int8 / bf16)               re-quantized when BUNDLE had them
  manifest                          `folded` {from_digest, from_name, enrolled: [{name, class_id, enrolled_id}]},
                                    hashed; every other file (backbone.onnx, calibration negatives) copied
The result is verified (`slc verify`) before it replaces NEW.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from serving.bundle import output
from serving.bundle.class_row import ClassRow
from serving.bundle.format import MANIFEST, SELF_HASH_KEY, json_load, write_manifest
from serving.bundle.graphs import external_locations, external_tensor
from serving.bundle.names import enrolled_class_problem, shown
from serving.bundle.npy import NpyStream
from serving.bundle.synthetic import MAX_SAMPLE_COLUMNS

CHUNK_ROWS = 65_536
REWRITTEN = ("head_weight.npy", "head_bias.npy", "calibration.json", "samples.npz", "full.onnx", "single.onnx")


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
        _copy_others(src, stage, bundle.manifest)
        offsets = _write_head(stage, bundle, classes)
        write_graphs(src, stage, bundle.embed_dim, offsets, bundle.num_classes + len(classes))
        _write_calibration(src, stage, bundle, classes)
        write_samples(src, stage, bundle.num_classes)
        write_manifest(stage, _manifest(src, stage, bundle, classes))
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


def head_files(src: Path, manifest: dict) -> set[str]:
    """The files a new head replaces: the rows, the graphs and their external data, the samples and
    the quantized heads."""
    import onnx

    skip = set(REWRITTEN) - {"calibration.json"}
    for kind in ("full", "single"):
        skip |= external_locations(onnx.load(str(src / f"{kind}.onnx"), load_external_data=False))
    for spec in (manifest.get("heads") or {}).values():
        skip |= {v for k, v in spec.items() if k != "scheme" and isinstance(v, str)}
    return skip


def _copy_others(src: Path, stage: Path, manifest: dict) -> None:
    """Every listed file that the fold does not rewrite: backbone.onnx, negatives, ... (not the old
    graphs' external data, nor the quantized heads, which are rewritten or dropped)."""
    skip = head_files(src, manifest) | {"calibration.json"}
    for name in manifest["files"]:
        if name not in skip:
            shutil.copy2(src / name, stage / name)


def write_head(stage: Path, blocks, shape: tuple[int, int], bias: np.ndarray) -> dict[str, int]:
    """head_weight.npy [D, d] streamed from `blocks` (float32 row blocks in order) and head_bias.npy;
    the data offsets of both files (the graphs' external data points there)."""
    weight = NpyStream(stage / "head_weight.npy", tuple(shape))
    for block in blocks:
        weight.write(np.asarray(block, dtype=np.float32))
    weight.close()
    stream = NpyStream(stage / "head_bias.npy", (shape[0],))
    stream.write(np.asarray(bias, dtype=np.float32))
    stream.close()
    return {"weight": weight.offset, "bias": stream.offset}


def row_blocks(weight, rows: int = CHUNK_ROWS):
    """weight [D, d] (an array, a memory map, or anything sliced like one) in blocks of `rows`."""
    for start in range(0, weight.shape[0], rows):
        yield weight[start:start + rows]


def _write_head(stage: Path, bundle, classes: list[ClassRow]) -> dict[str, int]:
    """The trained rows streamed, then the enrolled ones; the data offsets of both files."""
    D, d, n = bundle.num_classes, bundle.embed_dim, len(classes)
    blocks = [*row_blocks(bundle.weight), np.stack([c.row for c in classes])]
    bias = np.concatenate([np.asarray(bundle.bias, dtype=np.float32), np.array([c.bias for c in classes], np.float32)])
    return write_head(stage, blocks, (D + n, d), bias)


def write_graphs(src: Path, stage: Path, d: int, offsets: dict[str, int], total: int) -> None:
    """full.onnx and single.onnx: the backbone's graph, then the head over the new rows (external data)."""
    import onnx
    from onnx import TensorProto, helper

    base = onnx.load(str(src / "backbone.onnx"))  # its own external data, if any, loaded inline
    batch = base.graph.input[0].type.tensor_type.shape.dim[0].dim_param or "N"
    opset = max([o.version for o in base.opset_import if o.domain in ("", "ai.onnx")] + [13])
    head = [external_tensor("slc_head_weight", (total, d), "head_weight.npy", offsets["weight"]),
            external_tensor("slc_head_bias", (total,), "head_bias.npy", offsets["bias"])]

    def graph(name: str, nodes: list, extra_inits: list, extra_inputs: list, outputs: list) -> onnx.ModelProto:
        model = onnx.ModelProto()
        model.CopyFrom(base)
        model.graph.name = name
        model.graph.node.extend(nodes)
        model.graph.initializer.extend(head + extra_inits)
        model.graph.input.extend(extra_inputs)
        del model.graph.output[:]
        model.graph.output.extend(outputs)
        for o in model.opset_import:
            if o.domain in ("", "ai.onnx"):
                o.version = opset  # ReduceSum takes its axes as an input from opset 13
        return model

    full = graph("full", [helper.make_node("Gemm", ["embedding", "slc_head_weight", "slc_head_bias"], ["logits"],
                                           transB=1)], [], [],
                 [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, total])])
    onnx.save_model(full, str(stage / "full.onnx"))
    axes = helper.make_tensor("slc_sum_axes", TensorProto.INT64, [1], [1])
    single = graph("single", [
        helper.make_node("Gather", ["slc_head_weight", "class_id"], ["slc_rows"], axis=0),  # [N, d]
        helper.make_node("Gather", ["slc_head_bias", "class_id"], ["slc_row_bias"], axis=0),  # [N]
        helper.make_node("Mul", ["embedding", "slc_rows"], ["slc_prod"]),
        helper.make_node("ReduceSum", ["slc_prod", "slc_sum_axes"], ["slc_dot"], keepdims=0),
        helper.make_node("Add", ["slc_dot", "slc_row_bias"], ["logit"])], [axes],
        [helper.make_tensor_value_info("class_id", TensorProto.INT64, [batch])],
        [helper.make_tensor_value_info("logit", TensorProto.FLOAT, [batch])])
    onnx.save_model(single, str(stage / "single.onnx"))


def _write_calibration(src: Path, stage: Path, bundle, classes: list[ClassRow]) -> None:
    cal = json_load((src / "calibration.json").read_bytes())
    D = bundle.num_classes
    for i, c in enumerate(classes):
        cal["per_class"].append({"class_id": D + i, "threshold": c.threshold, "platt": {"a": c.platt_a, "b": c.platt_b},
                                 "enrolled": {"name": c.name, "examples": c.examples, "rule": c.rule, "slot": c.slot}})
    cal["enrolled"] = {"count": len(classes), "note": "enrolled classes' thresholds and Platt a/b come from the "
                       "enrollment rule (docs/api.md), not from the calibration split"}
    (stage / "calibration.json").write_text(json.dumps(cal, allow_nan=False) + "\n")


def write_samples(src: Path, stage: Path, trained: int) -> None:
    """The bundle's sample inputs with outputs recomputed over the new head in `stage` (the columns
    and an id of rows after the first `trained` included, when there are some)."""
    from serving.bundle.session import ort_session

    with np.load(src / "samples.npz", allow_pickle=False) as f:
        s = {k: f[k] for k in f.files}
    x = s["input"].astype(np.float32)
    h = ort_session(stage / "backbone.onnx").run(None, {"input": x})[0].astype(np.float64)  # [n, d]
    weight = np.load(stage / "head_weight.npy", mmap_mode="r")
    bias = np.load(stage / "head_bias.npy", mmap_mode="r")
    total = weight.shape[0]
    added = np.arange(trained, total)
    columns = np.unique(np.concatenate([s["logit_columns"].astype(np.int64), added[:MAX_SAMPLE_COLUMNS]]))
    cid = s["class_id"].astype(np.int64).copy()
    cid[-1] = total - 1  # the last row (after a fold, an enrolled class) through single.onnx
    logits = h @ np.asarray(weight[columns], dtype=np.float64).T + np.asarray(bias[columns], dtype=np.float64)
    single = (h * np.asarray(weight[cid], dtype=np.float64)).sum(axis=1) + np.asarray(bias[cid], dtype=np.float64)
    out = dict(s, embedding=h.astype(np.float32), logits=logits.astype(np.float32), logit_columns=columns,
               class_id=cid, logit=single.astype(np.float32))
    np.savez(stage / "samples.npz", **out)


def _manifest(src: Path, stage: Path, bundle, classes: list[ClassRow]) -> dict:
    from serving.bundle.format import base_manifest

    old = json_load((src / MANIFEST).read_bytes())
    D = bundle.num_classes
    names = [str(c) for c in old["classes"]] + [c.name for c in classes]
    keep = {k: v for k, v in old.items() if k not in ("files", SELF_HASH_KEY, "classes", "num_classes", "heads",
                                                       "created", "format", "format_version")}
    external = dict(old.get("external_data") or {})
    external.update({"full.onnx": ["head_weight.npy", "head_bias.npy"], "single.onnx": ["head_weight.npy", "head_bias.npy"]})
    keep["external_data"] = external
    keep["folded"] = {"from_name": old.get("name"), "from_digest": bundle.digest,
                      "enrolled": [{"name": c.name, "class_id": D + i, "enrolled_id": D + c.slot}
                                   for i, c in enumerate(classes)]}
    manifest = base_manifest(keep.pop("name"), keep.pop("input")["shape"], keep.pop("embed_dim"), names,
                             keep.pop("loss", {}), keep.pop("backbone", {}), keep.pop("training", {}),
                             version=keep.pop("version", "1"), **keep)
    if old.get("heads"):
        from serving.bundle.quantize import write_heads

        weight = np.load(stage / "head_weight.npy", mmap_mode="r")
        manifest["heads"] = write_heads(stage, weight, tuple(old["heads"]))
    return manifest
