"""The per-class head and the full network that exported graphs are traced from."""
from __future__ import annotations

import math

import torch
from torch import nn


class ClassHead(nn.Module):
    """Per-class weight rows: logits = h @ weight.T + bias, so z_j needs row j only."""

    def __init__(self, d: int, D: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(D, d))  # [D, d]
        self.bias = nn.Parameter(torch.zeros(D))  # [D]
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, h: torch.Tensor, cols: torch.Tensor | None = None) -> torch.Tensor:
        """[B, d] -> logits [B, D], or [B, K] of the classes `cols` [K] only (a sampled head)."""
        if cols is None:
            return h @ self.weight.T + self.bias
        return h @ torch.index_select(self.weight, 0, cols).T + torch.index_select(self.bias, 0, cols)

    def single(self, h: torch.Tensor, class_id: torch.Tensor) -> torch.Tensor:
        """One logit per row: z_{class_id[i]}(x_i). [B, d], [B] -> [B].

        index_select exports as a plain ONNX Gather (W[idx] would become GatherND).
        """
        w = torch.index_select(self.weight, 0, class_id)  # [B, d]
        b = torch.index_select(self.bias, 0, class_id)  # [B]
        return (h * w).sum(dim=1) + b


class SLCNet(nn.Module):
    """normalize -> backbone -> head. Normalisation lives in the module so graphs take raw input."""

    def __init__(self, backbone: nn.Module, head: ClassHead, mean: torch.Tensor | float = 0.0, std: torch.Tensor | float = 1.0):
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32).clone())
        self.register_buffer("std", torch.as_tensor(std, dtype=torch.float32).clone())

    def embed(self, x: torch.Tensor) -> torch.Tensor:  # [B, *shape] raw -> [B, d]
        return self.backbone((x - self.mean) / self.std)

    def forward(self, x: torch.Tensor, cols: torch.Tensor | None = None) -> torch.Tensor:
        """[B, *shape] raw -> [B, D] (or [B, K] for the classes `cols`; through forward, so DDP syncs it)."""
        return self.head(self.embed(x), cols)

    def single(self, x: torch.Tensor, class_id: torch.Tensor) -> torch.Tensor:  # -> [B]
        return self.head.single(self.embed(x), class_id)
