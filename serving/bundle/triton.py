"""A Triton Inference Server model repository from a bundle (`slc bundle triton BUNDLE --out REPO`).

One model per graph, `<bundle name>-backbone`, `-full`, `-single`, each:

    REPO/<model>/config.pbtxt     onnxruntime backend, dynamic batching, names and dims from the graph
    REPO/<model>/1/model.onnx     the bundle's graph, byte for byte
    REPO/<model>/1/<file>         any file the graph keeps external data in (the .npy head)
    REPO/slc-repository.json      slc's index of the above (sha256, bytes): Triton ignores it

The batch dimension (the graphs' leading `N`) is Triton's: `max_batch_size` > 0 and dims
without it. A per-example scalar ([N] in the graph: `class_id`, `logit`) is declared with
dims [1] and `reshape { shape: [] }`, so clients send [batch, 1] as Triton expects.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

from serving.bundle import output
from serving.bundle.format import GRAPH_KINDS, BundleError, sha256_file

REPOSITORY = "slc-repository.json"  # the index of what slc wrote: models, files with sha256 and size
REPOSITORY_FORMAT = "slc-triton-repository"

# ONNX TensorProto element types -> Triton data types
_TRITON_TYPES = {1: "TYPE_FP32", 2: "TYPE_UINT8", 3: "TYPE_INT8", 5: "TYPE_INT16", 6: "TYPE_INT32", 7: "TYPE_INT64",
                 9: "TYPE_BOOL", 10: "TYPE_FP16", 11: "TYPE_FP64"}


def _tensors(values) -> list[tuple[str, str, list[int]]]:
    """(name, Triton type, dims without the batch dimension) of graph inputs or outputs."""
    out = []
    for v in values:
        t = v.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
        if not dims or t.shape.dim[0].HasField("dim_value"):
            raise BundleError(f"{v.name}: the leading dimension must be the batch (symbolic), got {dims}")
        if t.elem_type not in _TRITON_TYPES:
            raise BundleError(f"{v.name}: element type {t.elem_type} has no Triton data type")
        out.append((v.name, _TRITON_TYPES[t.elem_type], dims[1:]))
    return out


def _tensor_block(kind: str, tensors: list[tuple[str, str, list[int]]]) -> str:
    entries = []
    for name, dtype, dims in tensors:
        shape = f"dims: [ {', '.join(map(str, dims))} ]" if dims else "dims: [ 1 ]\n    reshape: { shape: [ ] }"
        entries.append(f'  {{\n    name: "{name}"\n    data_type: {dtype}\n    {shape}\n  }}')
    return f"{kind} [\n" + ",\n".join(entries) + "\n]\n"


def model_config(name: str, graph, max_batch: int, delay_us: int) -> str:
    """config.pbtxt text of one graph (an onnx ModelProto, external data not loaded)."""
    return (f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {int(max_batch)}\n'
            + _tensor_block("input", _tensors(graph.graph.input))
            + _tensor_block("output", _tensors(graph.graph.output))
            + f"dynamic_batching {{\n  max_queue_delay_microseconds: {int(delay_us)}\n}}\n")


def write_triton_repository(bundle_dir: Path, out: Path, max_batch: int = 64, delay_us: int = 2000,
                            overwrite: bool = False) -> list[str]:
    """Write the repository for a verified bundle into `out` (staged, then swapped in: serving/bundle/output.py;
    `overwrite` replaces a repository slc wrote there); returns model names. REPOSITORY lists every file
    with its hash, so that a later --overwrite knows the repository by its content."""
    import onnx

    from serving.bundle.graphs import external_locations
    from serving.bundle.loader import load_bundle

    output.check(out, "Triton repository", overwrite=overwrite, inputs=[bundle_dir])
    bundle = load_bundle(bundle_dir, verify=True)  # BundleError naming the bad file otherwise
    bundle_dir, models = Path(bundle_dir), []
    with output.staged(out, "Triton repository", overwrite=overwrite, inputs=[bundle_dir]) as stage:
        for kind in GRAPH_KINDS:
            name = f"{bundle.name}-{kind}"
            graph_path = bundle_dir / f"{kind}.onnx"
            graph = onnx.load(str(graph_path), load_external_data=False)
            version = stage / name / "1"
            version.mkdir(parents=True)
            shutil.copyfile(graph_path, version / "model.onnx")
            for location in sorted(external_locations(graph)):
                shutil.copyfile(bundle_dir / location, version / location)
            (stage / name / "config.pbtxt").write_text(model_config(name, graph, max_batch, delay_us))
            models.append(name)
        _write_index(stage, bundle.name, models)
    return models


def _write_index(stage: Path, bundle_name: str, models: list[str]) -> None:
    files = {str(p.relative_to(stage)): dict(zip(("sha256", "bytes"), sha256_file(p)))
             for p in sorted(stage.rglob("*")) if p.is_file() and not p.name.startswith(".")}
    (stage / REPOSITORY).write_text(json.dumps({"format": REPOSITORY_FORMAT, "bundle": bundle_name, "models": models,
                                                "files": files}, indent=1) + "\n")


def repository_names(path: Path) -> Optional[set[str]]:
    """The names of the repository slc wrote in `path` (its index, every file listed at its hash);
    None when `path` holds no such repository."""
    try:
        index = json.loads((path / REPOSITORY).read_text())
        files, models = index["files"], [str(m) for m in index["models"]]
        if index.get("format") != REPOSITORY_FORMAT or not isinstance(files, dict):
            return None
        for rel, info in files.items():
            p = path / rel
            if ".." in Path(rel).parts or rel.split("/")[0] not in models or p.is_symlink() or not p.is_file() \
                    or tuple(sha256_file(p)) != (info["sha256"], info["bytes"]):
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {REPOSITORY, *models}


output.register(output.Kind("Triton repository", repository_names))
