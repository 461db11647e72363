"""Where a device pass's time goes at a few inputs (issue 36; docs/results/gpu-serving.md): one
DeviceHead of random float32 rows per D, timed directly (no HTTP), and onnxruntime's own profile of
its softmax graph: per node, the provider it ran on and its median host-side time.

    python -m tools.bench.device_profile [--classes 100000,1000000] [--device cuda] [--precision float32,bf16,int8]
                                         [--out FILE.jsonl]

One JSON line per D and precision. `--device cpu` runs the same on the CPU provider (a dry run without a GPU).
"""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import click
import numpy as np

RUNS = 200


def median_ms(fn: Callable[[], object], runs: int = RUNS) -> float:
    fn()
    fn()  # the first calls allocate
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(1e3 * float(np.median(times)), 4)


def _bound_run(sess, head, h: np.ndarray, extra: dict, where: str) -> None:
    """One run with every output left on `where` (no copy back), synchronised."""
    io = head.bind(sess, h, extra, where)
    sess.run_with_iobinding(io)
    io.synchronize_outputs()


def node_profile(head, h: np.ndarray, j: np.ndarray, where: str, runs: int = 60) -> dict:
    """onnxruntime's profile of the softmax graph: [[node, provider, op, median us]] and the run's median."""
    import onnxruntime as ort

    from serving.core.device import head as device_head
    from serving.core.device.backend import head_providers

    opts = ort.SessionOptions()
    opts.enable_profiling = True
    tmp = tempfile.mkdtemp(prefix="slc-profile-")  # onnxruntime writes its profile file there, not in the cwd
    opts.profile_file_prefix = str(Path(tmp) / "softmax")
    sess = ort.InferenceSession(device_head.softmax_graph(head.num_classes, head.embed_dim, head.blocks, head.width,
                                                          head.precision),
                                sess_options=opts, providers=head_providers(where))
    for _ in range(runs):
        _bound_run(sess, head, h, {"j": j}, "cpu")
    events = json.loads(Path(sess.end_profiling()).read_text())
    shutil.rmtree(tmp, ignore_errors=True)
    nodes: dict[str, list] = {}
    model_runs = []
    for ev in events:
        if ev.get("cat") == "Node" and ev["name"].endswith("_kernel_time"):
            entry = nodes.setdefault(ev["name"][:-len("_kernel_time")], [ev["args"].get("provider"), ev["args"].get("op_name"), []])
            entry[2].append(ev["dur"])
        elif ev.get("cat") == "Session" and ev["name"] == "model_run":
            model_runs.append(ev["dur"])
    table = sorted(([name, prov, op, round(float(np.median(d[10:] or d)), 1)] for name, (prov, op, d) in nodes.items()),
                   key=lambda row: -row[3])
    return {"nodes": table, "nodes_sum_us": round(sum(row[3] for row in table), 1),
            "model_run_us": float(np.median(model_runs[10:] or model_runs)) if model_runs else None}


def random_head(num_classes: int, dim: int, precision: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(rows as the precision stores them, bias, int8 scales or None): random, as serving/bundle/quantize.py
    would store a float32 head of N(0, 1/16^2) weights."""
    rng = np.random.default_rng(0)
    b = rng.standard_normal(num_classes).astype(np.float32)
    w = (rng.standard_normal((num_classes, dim), dtype=np.float32) / 16).astype(np.float32)
    if precision == "bf16":
        return (w.view(np.uint32) >> 16).astype(np.uint16), b, None
    if precision == "int8":
        scale = (np.abs(w).max(axis=1) / 127).astype(np.float32)
        return np.rint(w / scale[:, None]).astype(np.int8), b, scale
    return w, b, None


def profile(num_classes: int, dim: int, where: str, precision: str = "float32") -> dict:
    from serving.core import head_scan
    from serving.core.device import head as device_head

    rng = np.random.default_rng(1)
    w, b, scale = random_head(num_classes, dim, precision)
    head = device_head.DeviceHead(w, b, where, max_k=100, precision=precision, scale=scale)
    del w
    h1, h8 = rng.standard_normal((1, dim)).astype(np.float32), rng.standard_normal((8, dim)).astype(np.float32)
    j = np.array([[3]], np.int64)
    out = {"classes": num_classes, "dim": dim, "precision": precision, "providers": head.providers, "blocks": head.blocks, "ms": {
        "softmax_1": median_ms(lambda: head.run(h1, [(slice(0, 1), head_scan.SoftmaxStats(1, 3))])),
        "softmax_8": median_ms(lambda: head.run(h8, [(slice(0, 8), head_scan.SoftmaxStats(8, 3))])),
        "topk10_1": median_ms(lambda: head.run(h1, [(slice(0, 1), head_scan.TopK(1, 10))])),
        "logits_1": median_ms(lambda: head.run(h1, [(slice(0, 1), head_scan.AllLogits(1, num_classes))]), 50),
        "softmax_graph_outputs_left_on_device": median_ms(
            lambda: _bound_run(head.sessions["softmax"], head, h1, {"j": j}, where)),
        "gemm_alone_output_left_on_device": median_ms(lambda: _bound_run(head.sessions["logits"], head, h1, {}, where)),
    }}
    out["profile"] = node_profile(head, h1, j, where)
    return out


@click.command()
@click.option("--classes", default="100000,1000000", show_default=True, help="comma list of D")
@click.option("--dim", type=int, default=256, show_default=True)
@click.option("--device", "where", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True)
@click.option("--precision", default="float32", show_default=True,
              help="comma list of the head's precisions: float32, bf16, int8")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="also append the lines here")
def main(classes: str, dim: int, where: str, precision: str, out: Path | None) -> None:
    """Time a device pass's parts at D = each of --classes and each --precision; one JSON line each."""
    from serving.core.device.backend import preload_cuda

    preload_cuda()
    for D, prec in ((int(c), p) for c in classes.split(",") for p in precision.split(",")):
        line = json.dumps(profile(D, dim, where, prec))
        click.echo(line)
        if out is not None:
            with open(out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
