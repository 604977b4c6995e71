"""Heads shared by every model: MOON's projection head and classifier, and a prediction head."""

from __future__ import annotations

import torch
from torch import nn


class ProjectionHead(nn.Module):
    """MOON's 2-layer MLP projection head (Li et al. 2021, §4.1): ``Linear → ReLU → Linear``.

    Shape: ``(B, in_dim) → (B, out_dim)``.
    """

    def __init__(self, in_dim: int, out_dim: int = 256, hidden_dim: int | None = None) -> None:
        super().__init__()
        hidden_dim = hidden_dim or in_dim  # the reference code keeps the encoder's width
        self.net = nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.ReLU(inplace=True),
                                 nn.Linear(hidden_dim, out_dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.net(h)


class PredictionHead(nn.Module):
    """SimSiam-style prediction MLP used by FedSiam-DA: ``Linear → BatchNorm → ReLU → Linear``.

    BatchNorm sits in the hidden layer only; the output layer has none (docs/algorithms.md#fedsiam-da).
    Shape: ``(B, dim) → (B, dim)``.
    """

    def __init__(self, dim: int = 256, hidden_dim: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden_dim, bias=False), nn.BatchNorm1d(hidden_dim),
                                 nn.ReLU(inplace=True), nn.Linear(hidden_dim, dim))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)
