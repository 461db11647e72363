"""A run read back: its model (`load_run`), its logits (`run_logits`) and its single-logit metrics
on a split (`model_metrics`, `evaluate_run`), without [N, D] in memory when N·D is large.

Training validates with the same functions, so a run's history and `slc eval` measure alike.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from models import ClassHead, SLCNet, build_backbone
from serving.calibration.chunks import head_chunks
from trainer.metrics import pooled_separation, slc_metrics, streaming_slc_metrics


def build_model(backbone: str, backbone_params: dict, input_shape, num_classes: int, mean, std) -> SLCNet:
    body = build_backbone(backbone, input_shape, **backbone_params)
    head = ClassHead(body.embed_dim, num_classes)
    return SLCNet(body, head, torch.as_tensor(np.asarray(mean, dtype=np.float32)), torch.as_tensor(np.asarray(std, dtype=np.float32)))


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def run_logits(model: nn.Module, x, batch_size: int = 2048) -> np.ndarray:
    """Logits float32 [N, D] of raw inputs x [N, *shape], in eval mode, batch by batch."""
    was_training = model.training
    model.eval()
    device = _device_of(model)
    # batch by batch from the (possibly memory-mapped, uint8) array: never a float copy of all of x
    out = [model(torch.tensor(np.asarray(x[i : i + batch_size], dtype=np.float32), device=device)).cpu()
           for i in range(0, len(x), batch_size)]
    model.train(was_training)
    return torch.cat(out).numpy() if out else np.zeros((0, 0), dtype=np.float32)


def split_metrics(scores: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """slc_metrics plus the pooled separation of the scores."""
    return {**slc_metrics(scores, labels), "separation": pooled_separation(scores, labels)}


DENSE_METRICS_MAX = 20_000_000  # N·D above this: metrics stream over class chunks instead of an [N, D] matrix


@torch.no_grad()
def model_metrics(model: SLCNet, x, labels: np.ndarray) -> dict[str, float]:
    """split_metrics of the model's logits on x; without an [N, D] matrix when N·D is large
    (embeddings [N, d], then logits 1,024 classes at a time: trainer.metrics.streaming_slc_metrics)."""
    num_classes = model.head.weight.shape[0]
    if len(x) * num_classes <= DENSE_METRICS_MAX:
        return split_metrics(run_logits(model, x), labels)
    was_training = model.training
    model.eval()
    device = _device_of(model)
    h = torch.cat([model.embed(torch.tensor(np.asarray(x[i:i + 2048], dtype=np.float32), device=device)).cpu()
                   for i in range(0, len(x), 2048)]).double().numpy()  # [N, d]
    model.train(was_training)
    w = model.head.weight.detach().cpu().double().numpy()  # [D, d]
    b = model.head.bias.detach().cpu().double().numpy()  # [D]
    return streaming_slc_metrics(head_chunks(h, w, b), labels, num_classes)


def load_run(run: Path) -> tuple[SLCNet, dict, dict]:
    """(SLCNet in eval mode, config dict, data_info dict) of a run directory."""
    run = Path(run)
    config = json.loads((run / "config.json").read_text())
    data_info = json.loads((run / "data.json").read_text())
    model = build_model(config["backbone"], config.get("backbone_params", {}), data_info["input_shape"],
                        len(data_info["classes"]), data_info["mean"], data_info["std"])
    model.load_state_dict(torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=True))
    return model.eval(), config, data_info


def evaluate_run(run: Path, split: str = "test", print_table: bool = False, data: str | None = None) -> dict[str, float]:
    """Recompute the single-logit metrics (+ separation) of a run on a split of its dataset
    (`data`: the dataset at its new place, when it has moved)."""
    from trainer.data import load_run_data

    model, config, data_info = load_run(run)
    x, y = load_run_data(data_info, override=data).split(split)
    metrics = model_metrics(model, x, y)
    if print_table:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"{run} — {config['loss']} on {data_info['dataset']} ({split}, {len(y)} examples)")
        table.add_column("metric")
        table.add_column("value", justify="right")
        table.add_column("1 − value", justify="right")
        for key, value in metrics.items():
            table.add_row(key, f"{value:.4f}", f"{1 - value:.4f}")
        Console().print(table)
    return metrics
