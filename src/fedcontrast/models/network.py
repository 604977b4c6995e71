"""The network every algorithm trains: encoder → projection head → classifier (MOON §3.1)."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from .heads import ProjectionHead


class ContrastiveNet(nn.Module):
    """Base encoder, 2-layer projection head and output layer.

    ``forward`` returns ``(z, logits)``: the projected representation ``z = R_w(x)`` — what the
    contrastive losses compare — separately from the class scores.
    Shapes: ``x (B, C, H, W) → z (B, projection_dim), logits (B, num_classes)``.
    """

    def __init__(self, encoder: nn.Module, num_classes: int, projection_dim: int = 256) -> None:
        super().__init__()
        self.encoder = encoder
        # every encoder (models.encoders, FrozenBackbones) declares its output width as an int
        self.projection = ProjectionHead(cast(int, encoder.feature_dim), projection_dim)
        self.classifier = nn.Linear(projection_dim, num_classes)
        self.projection_dim = projection_dim
        self.num_classes = num_classes

    def represent(self, x: torch.Tensor) -> torch.Tensor:
        """The projected representation ``z`` only (no classifier)."""
        return self.projection(self.encoder(x))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.represent(x)
        return z, self.classifier(z)
