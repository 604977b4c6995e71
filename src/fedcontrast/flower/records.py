"""What travels through Flower: tensors as Flower arrays (``ArrayRecord``), never pickles."""

from __future__ import annotations

import numpy as np
import torch

from ..config import RunConfig
from ..errors import ConfigError

CONFIG_KEY = "fedcontrast-config"  # the run configuration (JSON) in the Flower App's run config
INSTALL_HINT = ("the Flower engine needs flwr 1.42, which is not installed: in an environment without OpenFL (their "
                "grpcio versions conflict), pip install -e \".[flower]\"")


def flwr_app():
    """``flwr.app`` (records, messages), or one sentence saying how to install Flower."""
    try:
        from flwr import app
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None
    return app


def to_array_record(tensors: dict[str, torch.Tensor]):
    """Tensors as one packed ArrayRecord (packing.pack_arrays: a few objects for Flower to move, not
    two per tensor)."""
    from .packing import pack_arrays

    flwr_app()  # or one sentence saying how to install Flower
    return pack_arrays({k: v.detach().cpu().numpy() for k, v in tensors.items()})


def from_array_record(record, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    from .packing import unpack_arrays

    out = {k: torch.from_numpy(np.array(v, copy=True)) for k, v in unpack_arrays(record).items()}
    return out if device is None else {k: v.to(device) for k, v in out.items()}


def plan_pins(config: RunConfig) -> dict[str, str]:
    """Files every site must hold identically, as the plan pins them (path relative to the
    operator's folder → SHA-256): FedPCL's frozen backbones. The ServerApp sends them with its first
    message; a site writes them only when their hash matches."""
    settings = config.hyperparameters.get(config.algorithm, {})
    return dict(zip(settings.get("backbone_files") or [], settings.get("backbone_sha256") or []))
