"""A bundle's head replaced: new rows (`slc bundle fold`'s enrolled classes appended, `slc calibrate
--adapt-rows`' moved rows) written with everything that reads them, by one writer for both:

  head_weight.npy / head_bias.npy   the rows, streamed (npy.py)
  full.onnx / single.onnx           rebuilt from backbone.onnx + a Gemm / Gather over the new head, their
                                    W and b ONNX external data pointing into the .npy files (graphs.py)
  samples.npz                       the same inputs, expected outputs recomputed (onnxruntime backbone,
                                    float64 head)
  heads (int8 / bf16)               re-quantized when the bundle had them (quantize.py)

It says which of the old bundle's files it replaced, so that the caller carries only the others.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from serving.bundle.graphs import external_files, write_head_graphs
from serving.bundle.npy import write_head
from serving.bundle.quantize import write_heads
from serving.bundle.synthetic import MAX_SAMPLE_COLUMNS

REPLACED = ("head_weight.npy", "head_bias.npy", "samples.npz", "full.onnx", "single.onnx")
GRAPHS = ("full.onnx", "single.onnx")


@dataclass
class NewHead:
    """What writing a new head changed: the manifest's entries, and the files of the old bundle it replaced."""

    manifest: dict  # external_data, and heads when the bundle had quantized heads
    replaced: set[str]  # the rows, graphs and their external data, samples and quantized heads of the old bundle


def write_new_head(src: Path, stage: Path, parts: list, bias: np.ndarray, manifest: dict, trained: int) -> NewHead:
    """The new head (`parts`: its rows [n_i, d] one after the other, `bias` [D]) written into `stage` with
    its graphs, samples and quantized heads (module docstring); `src` is the bundle (with `manifest`)
    whose head it replaces, the rows after its first `trained` are new classes (none: `trained` = D)."""
    offsets = write_head(stage, parts, bias)
    write_head_graphs(src, stage, parts[0].shape[1], offsets, sum(p.shape[0] for p in parts))
    replaced = set(REPLACED) | external_files(src, GRAPHS)
    write_samples(src, stage, trained)
    external = {**(manifest.get("external_data") or {}), **{g: ["head_weight.npy", "head_bias.npy"] for g in GRAPHS}}
    fields: dict = {"external_data": external}
    if heads := manifest.get("heads"):
        replaced |= {name for spec in heads.values() for k, name in spec.items()
                     if k != "scheme" and isinstance(name, str)}
        fields["heads"] = write_heads(stage, np.load(stage / "head_weight.npy", mmap_mode="r"), tuple(heads))
    return NewHead(fields, replaced)


def write_samples(src: Path, stage: Path, trained: int) -> None:
    """The bundle's sample inputs with outputs recomputed over the new head in `stage` (the columns
    and an id of rows after the first `trained` included, when there are some)."""
    from serving.bundle.session import ort_session

    with np.load(src / "samples.npz", allow_pickle=False) as f:
        s = {k: f[k] for k in f.files}
    x = s["input"].astype(np.float32)
    h = ort_session(src / "backbone.onnx").run(None, {"input": x})[0].astype(np.float64)  # [n, d]
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
