"""`slc export RUN --out BUNDLE`: the ONNX bundle of a trained run (docs/bundle-format.md).

Exporter: torch.onnx.export with dynamo=True (the torch.export-based exporter, default since
torch 2.9; onnxscript is installed). With torch 2.13 it gives clean graphs: BatchNorm folded
into Gemm, a symbolic batch dim "N" on every input and output, and `index_select` as a plain
ONNX Gather. The legacy TorchScript exporter (dynamo=False) is deprecated and left Identity /
BatchNormalization / Shape-Concat clutter in the graph.

Every graph is checked at export: onnx.checker (full_check) and a parity run with
onnxruntime against the torch module on real calibration inputs, at batch 1 and at a full
batch of up to 256 inputs, fewer for large heads so that batch × D stays near PARITY_VALUES
(max |ort - torch| / max(1, max |torch|) <= 1e-4) — export fails loudly otherwise.

Calibration (thresholds, Platt) uses the logits the server's detect compares with the
thresholds: backbone.onnx embeddings run by onnxruntime on the calibration split, times the
head rows in float64. They stream over class chunks (serving.calibration.calibrate_chunks), so
memory stays O(N · chunk + D) whatever D. The test split is only measured.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from serving.bundle import (
    GRAPH_IO, NpyStream, base_manifest, graph_problems, ort_session, verify_bundle,
    write_manifest,
)
from serving.bundle import output
from serving.bundle.negatives import write_negatives
from serving.bundle.synthetic import MAX_SAMPLE_COLUMNS
from serving.bundle.quantize import write_heads
from trainer import calibration_shift
from serving.calibration.estimator import calibrate_chunks
from serving.calibration.defaults import NORM_MIN_NEGATIVES, RULE_DEFAULTS, default_rule, norm_has_tail
from serving.calibration.chunks import chunk_classes
from serving.calibration.support import support

log = logging.getLogger(__name__)

PARITY_TOL = 1e-4
EXTERNAL_DATA_BYTES = 1 << 30  # heads above 1 GiB go to external data (protobuf's hard limit is 2 GiB)
N_SAMPLES = 8
PARITY_BATCH = 256
PARITY_VALUES = 1 << 22  # logits of the full-batch parity run: fewer inputs for large heads


class ExportError(RuntimeError):
    """The exported graphs are not faithful to the trained network."""


def _wrappers(net):
    import torch

    class Backbone(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):  # [N, *shape] raw -> [N, d]
            return self.net.embed(x)

    class Full(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):  # [N, *shape] raw -> [N, D]
            return self.net(x)

    class Single(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x, class_id):  # [N, *shape], [N] int64 -> [N]
            return self.net.single(x, class_id)

    return {"backbone": Backbone().eval(), "full": Full().eval(), "single": Single().eval()}


def _export_graph(module, kind: str, example: tuple, path: Path, external: bool) -> None:
    import torch

    batch = torch.export.Dim("N")
    dynamic = tuple({0: batch} for _ in example)
    ins, outs = GRAPH_IO[kind]
    with warnings.catch_warnings(), _quiet_logger("torch.onnx"), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")  # and the exporter's optimizer passes print their progress
        program = torch.onnx.export(module, example, None, input_names=ins, output_names=outs, dynamo=True,
                                    dynamic_shapes=dynamic, verbose=False, optimize=True)
    program.save(str(path), external_data=external)


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    """The exporter's progress chatter off for one export; the logger's level is restored after."""
    logger = logging.getLogger(name)
    old = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(old)


def _rel_diff(got: np.ndarray, want: np.ndarray) -> float:
    if got.shape != want.shape:
        return float("inf")
    return float(np.max(np.abs(got.astype(np.float64) - want)) / max(1.0, float(np.max(np.abs(want)))))


def check_graph(path: Path, kind: str) -> None:
    """verify's graph checks (onnx.checker, I/O names, plain Gather) plus a dynamic batch dim."""
    problems, model = graph_problems(path, kind)
    if problems:
        raise ExportError("; ".join(problems))
    for v in list(model.graph.input) + list(model.graph.output):
        dim0 = v.type.tensor_type.shape.dim[0]
        if not dim0.dim_param or dim0.HasField("dim_value"):
            raise ExportError(f"{path.name}: {v.name} has a fixed batch dim ({dim0}), expected a dynamic one")


def parity(path: Path, kind: str, module, x: np.ndarray, class_id: np.ndarray) -> float:
    """Max relative difference of onnxruntime vs torch over x (at batch 1 and at the full batch)."""
    import torch

    sess = ort_session(path)
    worst = 0.0
    for sl in (slice(0, 1), slice(0, len(x))):
        feeds = {"input": x[sl]}
        args = (torch.from_numpy(x[sl]),)
        if kind == "single":
            feeds["class_id"] = class_id[sl]
            args += (torch.from_numpy(class_id[sl]),)
        got = sess.run(None, feeds)[0]
        with torch.no_grad():
            want = module(*args).double().numpy()
        worst = max(worst, _rel_diff(got, want))
    if not worst <= PARITY_TOL:
        raise ExportError(f"{path.name}: onnxruntime differs from torch by {worst:.3g} (relative), limit {PARITY_TOL}")
    return worst


def _ort_embeddings(path: Path, x: np.ndarray, batch: int = 256) -> np.ndarray:
    """backbone.onnx under onnxruntime: embeddings [N, d] float32 of inputs x, batch by batch (small batches:
    onnxruntime's arena keeps a batch's activations; docs/results/export-memory.md)."""
    sess = ort_session(path, threads=os.cpu_count() or 1)
    return np.concatenate([sess.run(None, {"input": np.asarray(x[i:i + batch], dtype=np.float32)})[0]
                           for i in range(0, len(x), batch)])


def _target(target_precision: float | None, target_recall: float | None) -> dict:
    if target_precision is not None and target_recall is not None:
        raise ValueError("give target_precision or target_recall, not both")
    if target_recall is not None:
        return {"recall": float(target_recall)}
    return {"precision": float(0.99 if target_precision is None else target_precision)}


def _verified(stage: Path) -> list[str]:
    """The staged bundle's problems, as one ExportError: an unfaithful export is the exporter's fault."""
    if problems := verify_bundle(stage):
        raise ExportError("exported bundle fails verification: " + "; ".join(problems))
    return []


@dataclass
class _Run:
    """What export needs of a trained run: the network, its config and the calibration/test data."""

    path: Path
    net: Any
    config: dict
    data_info: dict
    x_cal: np.ndarray
    y_cal: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    image: dict | None = None  # the dataset's image spec (trainer.data.Splits.image)

    @property
    def head(self) -> tuple[np.ndarray, np.ndarray]:
        """(weight [D, d], bias [D]) as float32 numpy."""
        h = self.net.head
        return (h.weight.detach().cpu().numpy().astype(np.float32), h.bias.detach().cpu().numpy().astype(np.float32))


def _open_run(run: Path, data: str | None = None) -> _Run:
    """The run and its data (from `data` when it has moved; ValueError, one line, when gone or changed)."""
    from trainer.data import load_run_data
    from trainer.runs import load_run

    net, config, data_info = load_run(run)
    net.eval()
    splits = load_run_data(data_info, override=data)
    (x_cal, y_cal), (x_test, y_test) = splits.calibration, splits.test
    return _Run(path=run, net=net, config=config, data_info=data_info,
                x_cal=np.ascontiguousarray(x_cal, dtype=np.float32), y_cal=np.asarray(y_cal),
                x_test=np.ascontiguousarray(x_test, dtype=np.float32), y_test=np.asarray(y_test), image=splits.image)


def _export_graphs(r: _Run, stage: Path, D: int, external: bool) -> dict[str, float]:
    """backbone/full/single.onnx, each checked and compared with torch; returns the parity per graph."""
    import torch

    rng = np.random.default_rng(0)
    example_x = torch.from_numpy(r.x_cal[:max(2, min(4, len(r.x_cal)))].copy())
    example_c = torch.from_numpy(np.array(r.y_cal[:len(example_x)], dtype=np.int64))
    rows = max(2, min(PARITY_BATCH, PARITY_VALUES // D))  # the full graph's output is [rows, D]
    parity_x = np.array(r.x_cal[:rows], dtype=np.float32)  # writable copy for torch.from_numpy
    parity_c = rng.integers(0, D, len(parity_x)).astype(np.int64)
    report = {}
    for kind, module in _wrappers(r.net).items():
        example = (example_x, example_c) if kind == "single" else (example_x,)
        path = stage / f"{kind}.onnx"
        _export_graph(module, kind, example, path, external=external and kind != "backbone")
        check_graph(path, kind)
        report[kind] = parity(path, kind, module, parity_x, parity_c)
    return report


def _write_head(stage: Path, weight: np.ndarray, bias: np.ndarray) -> None:
    """The head rows as page-aligned .npy (what the server memory-maps and the index reads)."""
    for name, arr in (("head_weight.npy", weight), ("head_bias.npy", bias)):
        stream = NpyStream(stage / name, arr.shape)
        stream.write(arr)
        stream.close()


def _write_calibration(r: _Run, stage: Path, target: dict, method: dict | None = None,
                       shift: str = "none", note: dict | None = None) -> tuple[dict, dict]:
    """Thresholds chosen on the calibration split's logits as the server's detect computes them
    (backbone.onnx embeddings, float64 head rows), class chunk by class chunk: never [N, D]; with
    shift "style", on the split and its style-shifted copy (trainer/calibration_shift.py). Also a
    sample of the clean embeddings with their labels (serving/bundle/negatives.py: an enrolled class's
    negatives); `support`: what the clean split can show (serving/calibration/support.py); returns
    (calibration, the manifest's `negatives`)."""
    from serving.calibration.chunks import head_chunks

    weight, bias = r.head  # [D, d], [D]
    has_test = len(r.x_test) > 0
    h_cal = _ort_embeddings(stage / "backbone.onnx", r.x_cal).astype(np.float64)  # [N, d]
    h_fit, y_fit = h_cal, r.y_cal
    if shift == "style":
        shifted = calibration_shift.style_shifted(r.x_cal, r.image or {})
        h_fit = np.concatenate([h_cal, _ort_embeddings(stage / "backbone.onnx", shifted)])  # [2N, d]
        y_fit = np.concatenate([r.y_cal, r.y_cal])
    h_test = _ort_embeddings(stage / "backbone.onnx", r.x_test).astype(np.float64) if has_test else None  # [N', d]
    chunk = chunk_classes(max(len(h_fit), len(r.x_test)), len(weight))
    cal = calibrate_chunks(head_chunks(h_fit, weight, bias, chunk), y_fit, len(weight), target,
                           head_chunks(h_test, weight, bias, chunk) if has_test else None,
                           r.y_test if has_test else None, method=method, progress=True)
    entry = calibration_shift.record(shift, len(r.y_cal))
    if entry is not None and cal["method"]["name"] == "global":  # asked for: one threshold, shifted copies in
        cal = dict(cal, shift=entry)
    elif entry is not None:
        clean = calibrate_chunks(head_chunks(h_cal, weight, bias, chunk), r.y_cal, len(weight), target,
                                 head_chunks(h_test, weight, bias, chunk) if has_test else None,
                                 r.y_test if has_test else None, method={"name": "global"}, progress=True)
        cal = calibration_shift.with_clean_global(cal, clean, entry)
    # what the clean calibration images can show (shifted copies are no new evidence): reported, never used
    cal["support"] = support(head_chunks(h_cal, weight, bias, chunk), r.y_cal, len(weight), target)
    if note is not None:
        cal["default_rule"] = note
    (stage / "calibration.json").write_text(json.dumps(cal, indent=1, allow_nan=False) + "\n")
    return cal, write_negatives(stage, h_cal, r.y_cal)


def _write_samples(r: _Run, stage: Path, D: int) -> None:
    """samples.npz: the first example of a few classes, expected outputs from torch."""
    import torch

    rng = np.random.default_rng(1)
    pick = np.sort(np.unique(r.y_cal, return_index=True)[1][:N_SAMPLES])
    xs = r.x_cal[pick]
    sample_cid = r.y_cal.astype(np.int64)[pick]
    sample_cid[-1] = D - 1
    columns = np.arange(D) if D <= MAX_SAMPLE_COLUMNS else np.unique(
        np.concatenate([[0, D - 1], sample_cid, rng.choice(D, MAX_SAMPLE_COLUMNS, replace=False)]))
    with torch.no_grad():
        xt = torch.from_numpy(xs)
        emb = r.net.embed(xt).numpy()  # [n, d]
        logits = r.net(xt).numpy()[:, columns]  # [n, c]
        single = r.net.single(xt, torch.from_numpy(sample_cid)).numpy()  # [n]
    np.savez(stage / "samples.npz", input=xs, embedding=emb.astype(np.float32), logits=logits.astype(np.float32),
             logit_columns=columns.astype(np.int64), class_id=sample_cid, logit=single.astype(np.float32),
             label=r.y_cal.astype(np.int64)[pick])


def _manifest(r: _Run, stage: Path, classes: list[str], embed_dim: int, cal: dict, parity_report: dict) -> dict:
    import onnx
    import torch

    config = r.config
    metrics = json.loads((r.path / "metrics.json").read_text()) if (r.path / "metrics.json").exists() else {}
    full_model = onnx.load(str(stage / "full.onnx"), load_external_data=False)
    opset = max(o.version for o in full_model.opset_import if o.domain in ("", "ai.onnx"))
    return base_manifest(
        r.path.resolve().name, r.data_info["input_shape"], embed_dim, classes,
        version=str(config.get("versions", {}).get("slc", "dev")),
        loss={"name": config.get("loss"), "params": config.get("loss_params", {}),
              "pols": bool(config.get("loss_pols", False))},
        backbone={"name": config.get("backbone"), "params": config.get("backbone_params", {})},
        training=config, dataset=r.data_info.get("dataset"), test_metrics=metrics.get("test"),
        calibration_metrics=metrics.get("calibration"),
        onnx={"opset": int(opset), "ir_version": int(full_model.ir_version),
              "exporter": f"torch {torch.__version__} dynamo", "parity_max_rel_diff": parity_report},
        calibration_target=cal["target"],
        **({"image": spec} if (spec := r.data_info.get("image", r.image)) else {}))


def _small_split(r: _Run, D: int) -> dict:
    """calibration.json `default_rule` when the split is too small for the norm rule: what was chosen, and why."""
    fewest = 2 * (len(r.y_cal) - int(np.bincount(r.y_cal, minlength=D).max()))
    return {"rule": dict(RULE_DEFAULTS["export small split"]), "shift": "none",
            "why": f"{fewest} negatives in a class's column with the style-shifted copies, under the "
                   f"{NORM_MIN_NEGATIVES} the norm rule's tail needs: shrink on the clean split"}


def export_bundle(run: Path, out: Path, target_precision: float | None = None, target_recall: float | None = None,
                  method: dict | None = None, data: str | None = None, head_precisions: tuple[str, ...] = (),
                  shift: str = "auto", overwrite: bool = False) -> Path:
    """Write BUNDLE (docs/bundle-format.md) from a run directory; returns `out`. Raises ExportError if unfaithful.
    `data`: the run's dataset at its new place, when it has moved (trainer.data.load_run_data);
    `head_precisions`: quantized copies of the head to add (serving/bundle/quantize.py);
    `shift`: calibrate on style-shifted copies too (trainer/calibration_shift.py; auto: for a PoLS loss on images);
    `overwrite`: replace a bundle already at `out` (serving/bundle/output.py: checked before any work)."""
    run, out = Path(run), Path(out)
    output.check(out, "bundle", overwrite=overwrite, inputs=[run])
    target = _target(target_precision, target_recall)
    r = _open_run(run, data)
    pols = bool(r.config.get("loss_pols", False))
    auto = (method is None or method.get("name") == "auto") and shift == "auto"
    shift = calibration_shift.resolve(shift, pols, tuple(r.data_info["input_shape"]), r.image)
    small = auto and shift == "style" and not norm_has_tail(r.y_cal, len(r.data_info["classes"]), copies=2)
    if small:  # too few negatives per class for the norm rule's tail: the clean split, shrink
        shift, method = "none", dict(RULE_DEFAULTS["export small split"])
    if method is None or method.get("name") == "auto":
        method = default_rule(pols, shift)
    weight, bias = r.head  # [D, d], [D]
    D, d = weight.shape
    classes = [str(c) for c in r.data_info["classes"]]
    if len(classes) != D:
        raise ExportError(f"{len(classes)} class names for a head of {D} rows")
    with output.staged(out, "bundle", overwrite=overwrite, inputs=[run], verify=_verified) as stage:
        parity_report = _export_graphs(r, stage, D, external=weight.nbytes > EXTERNAL_DATA_BYTES)
        _write_head(stage, weight, bias)
        cal, negatives = _write_calibration(r, stage, target, method, shift, _small_split(r, D) if small else None)
        _write_samples(r, stage, D)
        manifest = _manifest(r, stage, classes, d, cal, parity_report)
        manifest["negatives"] = negatives
        if head_precisions:
            manifest["heads"] = write_heads(stage, weight, tuple(head_precisions))
        write_manifest(stage, manifest)
    log.debug("exported %s -> %s (%d classes, parity %s)", run, out, D,
             ", ".join(f"{k} {v:.1e}" for k, v in parity_report.items()))
    return out
