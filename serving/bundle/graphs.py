"""ONNX graph checks shared by `slc export` (before a bundle is written) and verify, and the
external-data tensors that let graphs point into the .npy head instead of copying it."""
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

