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
    app = flwr_app()
    return app.ArrayRecord(array_dict={k: app.Array.from_numpy_ndarray(v.detach().cpu().numpy())
                                       for k, v in tensors.items()})


def from_array_record(record, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    out = {k: torch.from_numpy(np.array(a.numpy(), copy=True)) for k, a in record.items()}
    return out if device is None else {k: v.to(device) for k, v in out.items()}


def plan_pins(config: RunConfig) -> dict[str, str]:
    """Files every site must hold identically, as the plan pins them (path relative to the
    operator's folder → SHA-256): FedPCL's frozen backbones. The ServerApp sends them with its first
    message; a site writes them only when their hash matches."""
    settings = config.hyperparameters.get(config.algorithm, {})
    return dict(zip(settings.get("backbone_files") or [], settings.get("backbone_sha256") or []))
