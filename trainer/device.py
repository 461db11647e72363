"""Where and in which precision a run computes: `--device auto|cpu|cuda[:N]`, `--precision
fp32|bf16|fp16`. Every check here runs before any data is loaded, and a request this machine
cannot honour is one line (ValueError), never a CUDA traceback mid-run.

Mixed precision is torch.autocast over the forward pass; losses always see float32 logits
(their log-space numerics are written for it). fp16 needs a gradient scaler and CUDA; bf16
runs on CUDA and on CPUs (autocast to bfloat16), with no scaler.
"""
from __future__ import annotations

import contextlib
import os

import torch

DEVICES = "auto|cpu|cuda[:N]"
PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(spec: str, local_rank: int | None = None) -> torch.device:
    """`auto` -> cuda (this rank's GPU under torchrun) where CUDA is present, else cpu."""
    spec = (spec or "auto").strip().lower()
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or spec.startswith("cuda:"):
        if not torch.cuda.is_available():
            build = "a CPU-only build of torch" if torch.version.cuda is None else "no CUDA device visible"
            raise ValueError(f"--device {spec}: CUDA is not available here ({build}); use --device cpu or auto")
        index = local_rank if spec == "cuda" else _index(spec)
        if index >= torch.cuda.device_count():
            raise ValueError(f"--device {spec}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        return torch.device("cuda", index)
    raise ValueError(f"--device {spec!r}: expected {DEVICES}")


def _index(spec: str) -> int:
    try:
        return int(spec.split(":", 1)[1])
    except ValueError:
        raise ValueError(f"--device {spec!r}: expected {DEVICES}") from None


def check_precision(precision: str, device: torch.device) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"--precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if precision == "fp16" and device.type != "cuda":
        raise ValueError("--precision fp16 needs a CUDA device (its gradient scaler is for GPUs); on the CPU use bf16")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"--precision bf16: {torch.cuda.get_device_name(device)} has no bfloat16; use fp16")


def autocast(precision: str, device: torch.device):
    """The forward pass's context: autocast to bf16/fp16, or nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """Enabled for fp16 only (a disabled scaler passes every call through)."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def process_group_backend(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"
