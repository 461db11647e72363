"""ONNX graph checks shared by `slc export` (before a bundle is written) and verify, the
external-data tensors that let graphs point into the .npy head instead of copying it, and the
full and single graphs built over such a head without torch (a new head: newhead.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from serving.bundle.format import GRAPH_IO, GRAPH_KINDS, MANIFEST


def graph_problems(p: Path, kind: str) -> tuple[list[str], Any]:
    """onnx.checker (full) by path, I/O names of docs/bundle-format.md, and a plain Gather in single.onnx.

    Shared by `slc export` (before a bundle is written) and verify; returns (problems, the
    graph without its external data, or None when the checker failed)."""
    import onnx

    name = p.name
    try:
        onnx.checker.check_model(str(p), full_check=True)
        model = onnx.load(str(p), load_external_data=False)
    except Exception as e:  # noqa: BLE001
        return [f"{name}: onnx checker failed ({str(e).splitlines()[0][:300]})"], None
    problems = []
    inits = {i.name for i in model.graph.initializer}
    ins = [i.name for i in model.graph.input if i.name not in inits]
    outs = [o.name for o in model.graph.output]
    want_in, want_out = GRAPH_IO[kind]
    if ins != want_in or outs != want_out:
        problems.append(f"{name}: inputs {ins} -> outputs {outs}, expected {want_in} -> {want_out}")
    if kind == "single":
        ops = {n.op_type for n in model.graph.node}
        if "Gather" not in ops or "GatherND" in ops:
            problems.append(f"{name}: must gather class rows with a plain Gather (ops: {sorted(ops)})")
    return problems, model


def check_graphs(path: Path, manifest: dict) -> list[str]:
    """Every graph's own checks, plus: external data only in files the manifest lists."""
    problems = []
    for kind in GRAPH_KINDS:
        p = path / f"{kind}.onnx"
        if not p.is_file():
            continue  # reported by the file check
        found, model = graph_problems(p, kind)
        problems += found
        for loc in external_locations(model) if model is not None else ():
            if "/" in loc or "\\" in loc or loc not in manifest.get("files", {}):
                problems.append(f"{p.name}: external data {loc!r} is not a file listed in {MANIFEST}")
    return problems


def external_locations(model) -> set[str]:
    from onnx import TensorProto

    locs = set()
    for t in model.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            for e in t.external_data:
                if e.key == "location":
                    locs.add(e.value)
    return locs


def external_files(folder: Path, graphs) -> set[str]:
    """The files the external data of `graphs` (file names in `folder`) lives in."""
    import onnx

    return set().union(*(external_locations(onnx.load(str(Path(folder) / g), load_external_data=False))
                         for g in graphs))


def external_tensor(name: str, shape: tuple[int, ...], location: str, offset: int, dtype: int = 1):
    """An initializer (dtype: an onnx TensorProto type, 1 = FLOAT) whose data lives in `location`
    (relative to the graph) at `offset`."""
    from onnx import TensorProto, helper

    t = TensorProto()
    t.name = name
    t.data_type = dtype
    t.dims.extend(int(s) for s in shape)
    t.data_location = TensorProto.EXTERNAL
    length = int(np.prod(shape)) * np.dtype(helper.tensor_dtype_to_np_dtype(dtype)).itemsize
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        e = t.external_data.add()
        e.key, e.value = k, v
    return t


def write_head_graphs(src: Path, stage: Path, d: int, offsets: dict[str, int], total: int) -> None:
    """full.onnx and single.onnx in `stage`: `src`'s backbone graph, then the head over the rows of
    head_weight.npy [total, d] and head_bias.npy [total] (external data at `offsets`)."""
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
