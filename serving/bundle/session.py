"""The one onnxruntime session builder: the server's runtime, verify, export parity and the
tools all open graphs through it, so thread and memory settings are set in one place."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

CPU = ["CPUExecutionProvider"]


def ort_session_options(threads: int = 1, prepack: bool = True, spin: bool = True, optimize: bool = True,
                        arena: bool = True):
    """The SessionOptions every session of the project starts from (see ort_session)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3  # a failed CUDA probe under device=auto is expected, not an error
    opts.intra_op_num_threads = int(threads)
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.enable_cpu_mem_arena = bool(arena)
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if not prepack:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    if not spin:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts


def ort_session(path: Path | str | bytes, threads: int = 1, providers: Sequence[str] = CPU, prepack: bool = True,
                spin: bool = True, optimize: bool = True, arena: bool = True):
    """An InferenceSession on `path` (external data resolved next to it), or on a serialized model.

    `prepack=False` makes the Gemm read (memory-mapped) weights as they are instead of keeping a
    pre-packed copy: right for a graph run a few times (verify's samples), wrong for serving.
    `spin=False` stops idle intra-op threads from spinning on cores others need.
    `arena=False` returns each run's buffers instead of keeping the largest ever asked for.
    """
    import onnxruntime as ort

    opts = ort_session_options(threads, prepack=prepack, spin=spin, optimize=optimize, arena=arena)
    model = path if isinstance(path, bytes) else str(path)
    return ort.InferenceSession(model, sess_options=opts, providers=list(providers))
