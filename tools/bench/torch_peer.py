"""The plain peer: what a team would ship without slc, as the comparison baseline of `slc bench scale`.

"Plain" means:
- a FastAPI route with a pydantic body model (`inputs: list[list[float]]`), a synchronous handler
  (FastAPI runs it in its thread pool), no request batching, no caching;
- the model runs eagerly in torch: the backbone is rebuilt as torch ops from backbone.onnx's
  nodes and initializers (Gemm / MatMul / Add / Relu / LpNormalization / ... -- enough for the
  synthetic and MLP bundles; a graph with other ops falls back to onnxruntime for the backbone
  only, and /v1/model says so), the head is W [D, d] and b [D] loaded into torch tensors
  (a full in-RAM copy, as `torch.load` of a checkpoint would give);
- every request computes all D logits and the full softmax over D, then picks the asked class:
  the cost grows with D, which is exactly what single-logit serving avoids;
- torch uses its default intra-op threads (as a team would leave it) under `torch.inference_mode`.

Routes: POST /v1/classes/{class}/softmax (same body and answer shape as slc's), GET /v1/model,
GET /v1/health/live, /v1/health/ready.

This module may import torch -- lazily, inside functions -- and nothing on the serving path
imports it (it runs only as a subprocess of the bench). Run: `python -m tools.bench.torch_peer BUNDLE --port P` (needs the train extra).
"""
# no `from __future__ import annotations`: FastAPI must see the real body model class below
import json
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from serving.bundle.session import ort_session
from tools.bench.server import add_health_routes


def _attr_reader(onnx) -> Callable:
    """attr(node, name, default): an ONNX node attribute's value, or the default when absent
    (ONNX leaves attributes at their default value out of the graph)."""
    def attr(node, name, default=None):
        for a in node.attribute:
            if a.name == name:
                return onnx.helper.get_attribute_value(a)
        return default

    return attr


def _attribute_ops(attr: Callable, torch) -> dict[str, Callable]:
    """The ops whose behaviour depends on node attributes, as (node, *inputs) -> tensor."""
    F = torch.nn.functional

    def gemm(node, x, w, b=None):
        if attr(node, "transA", 0):
            x = x.T
        if attr(node, "transB", 0):
            w = w.T
        y = attr(node, "alpha", 1.0) * (x @ w)
        return y + attr(node, "beta", 1.0) * b if b is not None else y

    def lpnorm(node, x):
        return F.normalize(x, p=attr(node, "p", 2), dim=attr(node, "axis", -1))

    def reduce_l2(node, x, axes=None):
        ax = attr(node, "axes") if axes is None else axes.tolist()
        return torch.linalg.vector_norm(x, dim=ax, keepdim=bool(attr(node, "keepdims", 1)))

    def flatten(node, x):
        axis = attr(node, "axis", 1)
        return x.reshape(int(np.prod(x.shape[:axis])), -1)

    def conv(node, x, w, b=None):
        pads = attr(node, "pads", [0, 0, 0, 0])
        return F.conv2d(x, w, b, stride=attr(node, "strides", [1, 1]), padding=pads[: len(pads) // 2],
                        dilation=attr(node, "dilations", [1, 1]), groups=attr(node, "group", 1))

    return {"Gemm": gemm, "LpNormalization": lpnorm, "ReduceL2": reduce_l2, "Flatten": flatten, "Conv": conv}


def _torch_ops(attr: Callable, torch) -> dict[str, Callable]:
    """ONNX op_type -> eager torch function (node, *inputs): the ops the rebuild covers."""
    F = torch.nn.functional
    layer = _attribute_ops(attr, torch)
    return {
        "Gemm": layer["Gemm"],
        "MatMul": lambda n, a, b: a @ b,
        "Add": lambda n, a, b: a + b,
        "Sub": lambda n, a, b: a - b,
        "Mul": lambda n, a, b: a * b,
        "Div": lambda n, a, b: a / b,
        "Relu": lambda n, x: torch.relu(x),
        "Sigmoid": lambda n, x: torch.sigmoid(x),
        "Tanh": lambda n, x: torch.tanh(x),
        "Sqrt": lambda n, x: torch.sqrt(x),
        "Max": lambda n, a, b: torch.maximum(a, b),
        "Clip": lambda n, x, lo=None, hi=None: torch.clamp(x, lo, hi),
        "Identity": lambda n, x: x,
        "LpNormalization": layer["LpNormalization"],
        "ReduceL2": layer["ReduceL2"],
        "Flatten": layer["Flatten"],
        "Reshape": lambda n, x, shape: x.reshape([int(s) if int(s) != 0 else x.shape[i] for i, s in enumerate(shape)]),
        "Conv": layer["Conv"],
        "MaxPool": lambda n, x: F.max_pool2d(x, attr(n, "kernel_shape"), attr(n, "strides")),
        "GlobalAveragePool": lambda n, x: x.mean(dim=(2, 3), keepdim=True),
    }


def _onnx_backbone_in_torch(path: Path) -> Optional[Callable]:
    """Rebuild backbone.onnx as eager torch ops; None if the graph uses an op not covered here."""
    import onnx
    import torch
    from onnx import numpy_helper

    model = onnx.load(str(path))
    graph = model.graph
    consts = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in graph.initializer}
    ops = _torch_ops(_attr_reader(onnx), torch)
    if any(node.op_type not in ops for node in graph.node):
        return None
    in_name, out_name = graph.input[0].name, graph.output[0].name
    nodes = list(graph.node)

    def forward(x):
        env = dict(consts)
        env[in_name] = x
        for node in nodes:
            args = [env[i] if i else None for i in node.input]
            env[node.output[0]] = ops[node.op_type](node, *args)
        return env[out_name]

    return forward


def _peer_backbone(bundle_path: Path) -> tuple[Callable, str]:
    """(backbone, how it runs): the torch rebuild of backbone.onnx, or onnxruntime when the graph
    has an op the rebuild does not cover (the head stays in torch either way)."""
    import torch

    torch_backbone = _onnx_backbone_in_torch(bundle_path / "backbone.onnx")
    if torch_backbone is not None:
        return torch_backbone, "torch (rebuilt from backbone.onnx)"
    # an op not covered: onnxruntime for the backbone only, the head stays in torch
    session = ort_session(bundle_path / "backbone.onnx", threads=0)  # 0: onnxruntime's default threads

    def backbone(x):
        return torch.from_numpy(session.run(["embedding"], {"input": x.numpy()})[0])

    return backbone, "onnxruntime (graph has ops the torch rebuild does not cover)"


def create_peer_app(bundle_path: Path | str):
    """FastAPI app of the plain peer over a bundle directory."""
    import torch
    from fastapi import FastAPI, HTTPException
    from pydantic import BaseModel

    bundle_path = Path(bundle_path)
    manifest = json.loads((bundle_path / "manifest.json").read_text())
    classes: list[str] = [str(c) for c in manifest["classes"]]
    class_ids = {name: j for j, name in enumerate(classes)}
    weight = torch.from_numpy(np.array(np.load(bundle_path / "head_weight.npy", allow_pickle=False)))  # [D, d]
    bias = torch.from_numpy(np.array(np.load(bundle_path / "head_bias.npy", allow_pickle=False)))  # [D]
    input_shape = [int(s) for s in manifest["input"]["shape"]]
    backbone, backbone_kind = _peer_backbone(bundle_path)

    class Inputs(BaseModel):
        inputs: list[Any]

    app = FastAPI(title="plain torch peer")
    add_health_routes(app)

    @app.get("/v1/model")
    def model():
        return {"name": manifest.get("name"), "input": manifest["input"], "num_classes": len(classes),
                "embed_dim": int(weight.shape[1]), "classes": classes[:10], "peer": "torch",
                "backbone": backbone_kind, "torch_threads": torch.get_num_threads()}

    @app.post("/v1/classes/{cls}/softmax")
    def softmax(cls: str, body: Inputs):
        j = class_ids.get(cls)
        if j is None:
            if cls.isdigit() and int(cls) < len(classes):
                j = int(cls)
            else:
                raise HTTPException(404, detail={"code": "unknown_class", "message": f"no class {cls!r}"})
        x = torch.tensor(body.inputs, dtype=torch.float32).reshape(len(body.inputs), *input_shape)
        with torch.inference_mode():
            h = backbone(x)  # [N, d]
            logits = h @ weight.T + bias  # [N, D]: all D dot products per request
            p = torch.softmax(logits, dim=1)  # [N, D]
            top1 = logits.argmax(dim=1)  # [N]
        return {"class_id": j, "class_name": classes[j],
                "results": [{"probability": float(p[i, j]), "logit": float(logits[i, j]), "is_top1": bool(top1[i] == j)}
                            for i in range(x.shape[0])]}

    return app


def main(argv: Optional[list[str]] = None) -> None:
    from tools.bench.server import run_peer

    run_peer(create_peer_app, __doc__.split("\n")[0], 8001, argv, device=False)


if __name__ == "__main__":
    main()
