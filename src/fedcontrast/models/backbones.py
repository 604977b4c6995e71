"""Frozen pre-trained backbones for FedPCL: loaded from local weight files, or pre-trained here.

Nothing is downloaded: a backbone's weights come from a file named in the configuration (a
``state_dict`` of :func:`fedcontrast.models.build_encoder`'s encoder for that architecture), or,
without one, from supervised pre-training on the run's public split (labelled data held out of
every site's training data), deterministic given the seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, DataError
from . import build_encoder, build_model

_CACHE: dict[tuple, nn.Module] = {}


def load_backbone(arch: str, path: str | Path, *, in_channels: int, image_size: int) -> nn.Module:
    """The encoder ``arch`` with the weights in ``path``; clear errors when missing or mismatched."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"backbone weight file {p} does not exist (make one with `fedcontrast pretrain`)")
    encoder = build_encoder(arch, in_channels=in_channels, image_size=image_size)
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise DataError(f"backbone weight file {p} is not a readable torch state_dict ({type(exc).__name__})") from None
    try:
        encoder.load_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as exc:
        first = str(exc).strip().splitlines()[0]
        raise ConfigError(f"backbone weight file {p} does not fit a {arch} backbone for {in_channels}x{image_size}x"
                          f"{image_size} images: {first}") from None
    return encoder


def pretrain_backbone(arch: str, public, *, seed: int, epochs: int, lr: float = 1e-3, batch_size: int = 64,
                      device: torch.device | str | None = None) -> nn.Module:
    """Supervised pre-training of encoder ``arch`` (with a temporary head) on ``public``; Adam, no
    augmentation. Trains on ``device`` (default: where ``public`` is); returns the encoder, there."""
    if public is None or len(public) == 0:
        raise ConfigError("pre-training backbones needs a public split: set public_fraction > 0 or give backbone files")
    device = public.x.device if device is None else torch.device(device)
    torch.manual_seed(seed)
    net = build_model(arch, in_channels=public.in_channels, image_size=public.image_size,
                      num_classes=public.num_classes, projection_dim=64).to(device)
    x, y = public.x.to(device), public.y.to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    generator = torch.Generator(device="cpu").manual_seed(seed)  # the batches: drawn on the host
    net.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(public), generator=generator, device="cpu").split(batch_size):
            if len(idx) < 2:
                continue
            idx = idx.to(device)
            _, logits = net(x[idx])
            loss = F.cross_entropy(logits, y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return net.encoder


class FrozenBackbones(nn.Module):
    """K frozen encoders; ``forward`` concatenates their features. Shape: ``(B, C, H, W) → (B, ΣD_k)``."""

    def __init__(self, encoders: list[nn.Module]) -> None:
        super().__init__()
        self.encoders = nn.ModuleList(encoders)
        self.feature_dim = sum(cast(int, e.feature_dim) for e in encoders)  # each encoder's int width
        self.eval()
        self.requires_grad_(False)

    def train(self, mode: bool = True) -> FrozenBackbones:
        return super().train(False)  # frozen: BatchNorm statistics never move

    @torch.no_grad()
    def features(self, x: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
        return torch.cat([self(x[i:i + batch_size]) for i in range(0, len(x), batch_size)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([e(x) for e in self.encoders], dim=1)


def backbone_set(archs: tuple[str, ...], files: tuple[str, ...], public, *, in_channels: int, image_size: int,
                 seed: int, pretrain_epochs: int) -> FrozenBackbones:
    """The configured backbones, built once per process (pre-training is deterministic per seed)."""
    if files and len(files) != len(archs):
        raise ConfigError(f"backbone_files names {len(files)} file(s) for {len(archs)} backbone(s)")
    fingerprint = (len(public), float(public.x.double().sum()), str(public.x.device)) if public is not None else None
    encoders = []
    for k, arch in enumerate(archs):
        # pre-training's float sums depend on the threads: a backbone is reused only at the same count
        key = (arch, files[k] if files else None, in_channels, image_size, seed + k, pretrain_epochs, fingerprint,
               None if files else torch.get_num_threads())
        if key not in _CACHE:
            _CACHE[key] = (load_backbone(arch, files[k], in_channels=in_channels, image_size=image_size) if files
                           else pretrain_backbone(arch, public, seed=seed + k, epochs=pretrain_epochs))
        encoders.append(_CACHE[key])
    return FrozenBackbones(encoders)
