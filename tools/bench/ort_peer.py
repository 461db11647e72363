"""The onnxruntime peer: what a user would write by hand to serve a bundle on the same card as slc, the
side-by-side baseline of `slc bench gpu` (issue 52).

"By hand" means:
- FastAPI, one uvicorn process, synchronous handlers (FastAPI runs them in its thread pool), a
  pydantic body (`inputs: list[list[float]]`), no request batching, no caching;
- one onnxruntime session of the bundle's full.onnx (input -> all D logits) and one of single.onnx
  (input, class_id -> that class's logit), on onnxruntime-gpu's CUDA provider where it is listed and
  the CPU provider otherwise, each with onnxruntime's defaults (TF32 as the CUDA provider leaves it);
- softmax p(j) and exact top-k: full.onnx's D logits back on the host, then numpy; detect: single.onnx's
  logit, the bundle's calibration.json (threshold, Platt a / b) applied in numpy.

Routes (the same bodies and answer shapes as slc's, so one client measures both): POST
/v1/classes/{class}/detect, POST /v1/classes/{class}/softmax, POST /v1/topk (exact), GET /v1/model,
GET /v1/health/live, /v1/health/ready.

Run: `python -m tools.bench.ort_peer BUNDLE --port P [--device auto|cuda|cpu]`. Imports no torch.
"""
# no `from __future__ import annotations`: FastAPI must see the real body model classes below
import json
from pathlib import Path
from typing import Any, Optional

import numpy as np

from tools.bench.server import add_health_routes

CUDA = "CUDAExecutionProvider"


def providers(device: str) -> list[str]:
    """The providers a user would ask for: CUDA first where onnxruntime lists it (auto / cuda)."""
    import onnxruntime as ort

    if device == "cpu":
        return ["CPUExecutionProvider"]
    if hasattr(ort, "preload_dlls"):  # onnxruntime-gpu's documented way to find the CUDA wheels' libraries
        try:
            ort.preload_dlls(msvc=False, directory="")
        except Exception:  # noqa: BLE001 - the default library path may hold them
            pass
    listed = ort.get_available_providers()
    if device == "cuda" and CUDA not in listed:
        raise SystemExit(f"ort_peer: --device cuda but onnxruntime lists only {', '.join(listed)}")
    return ([CUDA] if CUDA in listed else []) + ["CPUExecutionProvider"]


def softmax_of(logits: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
    """(p(j) [N], whether j is the top class [N]) from all D logits [N, D], in float64."""
    z = logits.astype(np.float64)
    m = z.max(axis=1)
    lse = m + np.log(np.exp(z - m[:, None]).sum(axis=1))
    return np.exp(z[:, j] - lse), logits.argmax(axis=1) == j


def create_peer_app(bundle_path, device: str = "auto"):
    """FastAPI app of the onnxruntime peer over a bundle directory."""
    import onnxruntime as ort
    from fastapi import FastAPI, HTTPException
    from pydantic import BaseModel

    bundle_path = Path(bundle_path)
    manifest = json.loads((bundle_path / "manifest.json").read_text())
    calibration = json.loads((bundle_path / "calibration.json").read_text())
    classes = [str(c) for c in manifest["classes"]]
    class_ids = {name: j for j, name in enumerate(classes)}
    per_class = {int(e["class_id"]): e for e in calibration.get("per_class", [])}
    fallback = float(calibration.get("global", {}).get("threshold", 0.0))
    input_shape = [int(s) for s in manifest["input"]["shape"]]
    wanted = providers(device)
    full = ort.InferenceSession(str(bundle_path / "full.onnx"), providers=wanted)
    single = ort.InferenceSession(str(bundle_path / "single.onnx"), providers=wanted)

    class Inputs(BaseModel):
        inputs: list[Any]

    class TopK(BaseModel):
        inputs: list[Any]
        k: int = 10
        mode: str = "exact"

    app = FastAPI(title="onnxruntime peer")

    add_health_routes(app)

    @app.get("/v1/model")
    def model():
        return {"name": manifest.get("name"), "input": manifest["input"], "num_classes": len(classes),
                "classes": classes[:10], "peer": "onnxruntime", "providers": full.get_providers()}

    def class_id(cls: str) -> int:
        if cls in class_ids:
            return class_ids[cls]
        if cls.isdigit() and int(cls) < len(classes):
            return int(cls)
        raise HTTPException(404, detail={"code": "unknown_class", "message": f"no class {cls!r}"})

    def batch(inputs: list) -> np.ndarray:
        return np.asarray(inputs, dtype=np.float32).reshape(len(inputs), *input_shape)

    @app.post("/v1/classes/{cls}/detect")
    def detect(cls: str, body: Inputs):
        j = class_id(cls)
        x = batch(body.inputs)
        z = single.run(None, {"input": x, "class_id": np.full(len(x), j, np.int64)})[0].reshape(-1)  # [N]
        entry = per_class.get(j, {})
        cut = float(entry.get("threshold", fallback))
        a, b = (float(entry.get("platt", {}).get(k, v)) for k, v in (("a", 1.0), ("b", -cut)))
        p = 1 / (1 + np.exp(-(a * z.astype(np.float64) + b)))
        return {"class_id": j, "class_name": classes[j], "threshold": cut,
                "results": [{"logit": float(zi), "probability": float(pi), "match": bool(zi >= cut)}
                            for zi, pi in zip(z, p)]}

    @app.post("/v1/classes/{cls}/softmax")
    def softmax(cls: str, body: Inputs):
        j = class_id(cls)
        logits = full.run(None, {"input": batch(body.inputs)})[0]  # [N, D]: all D logits to the host
        p, top1 = softmax_of(logits, j)
        return {"class_id": j, "class_name": classes[j],
                "results": [{"probability": float(pi), "logit": float(zi), "is_top1": bool(ti)}
                            for pi, zi, ti in zip(p, logits[:, j], top1)]}

    @app.post("/v1/topk")
    def topk(body: TopK):
        logits = full.run(None, {"input": batch(body.inputs)})[0]  # [N, D]
        k = min(body.k, logits.shape[1])
        part = np.argpartition(-logits, k - 1, axis=1)[:, :k]  # [N, k] unordered
        results = []
        for row, ids in zip(logits, part):
            ids = ids[np.lexsort((ids, -row[ids]))]  # by logit, ties by id
            results.append([{"class_id": int(i), "class_name": classes[i], "logit": float(row[i])} for i in ids])
        return {"k": k, "mode": "exact", "results": results}

    return app


def main(argv: Optional[list[str]] = None) -> None:
    from tools.bench.server import run_peer

    run_peer(create_peer_app, __doc__.split("\n")[0], 8002, argv, device=True)


if __name__ == "__main__":
    main()
