"""Round checkpoints: everything needed to continue a run exactly where it stopped.

Written atomically (temporary file, then rename) so a kill during the write leaves the previous
checkpoint intact; read with ``weights_only=True`` so a checkpoint cannot execute code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..atomic import atomic_torch_save
from ..errors import CheckpointError, FedContrastError

FORMAT = 1


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    atomic_torch_save({"format": FORMAT, **payload}, path)


def load_checkpoint(path: Path) -> dict[str, Any]:
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for truncated or foreign files
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable ({type(exc).__name__}); "
                              "it was left untouched: start a new run with another --name") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} is not a fedcontrast checkpoint of format {FORMAT}")
    missing = _missing_keys(data)
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete (no {', '.join(missing)}); it was left untouched: "
                              "start a new run with another --name")
    return data


# What a resume reads; a checkpoint lacking any of it (edited, or written by a broken tool) is refused
# here rather than met as a KeyError half-way through restoring the federation.
REQUIRED = {"config": dict, "rounds_done": int, "rows": list, "elapsed": float, "federation": dict}
FEDERATION_REQUIRED = {"downlink": dict, "server_state": dict, "site_states": dict}
DOWNLINK_REQUIRED = ("global", "personal", "metrics")


def _missing_keys(data: dict[str, Any]) -> list[str]:
    missing = [k for k, kind in REQUIRED.items()
               if not isinstance(data.get(k), (int, float) if kind is float else kind)]
    federation = data.get("federation")
    if isinstance(federation, dict):
        missing += [f"federation.{k}" for k, kind in FEDERATION_REQUIRED.items()
                    if not isinstance(federation.get(k), kind)]
        downlink = federation.get("downlink")
        if isinstance(downlink, dict):
            missing += [f"federation.downlink.{k}" for k in DOWNLINK_REQUIRED if not isinstance(downlink.get(k), dict)]
        states = federation.get("site_states")
        if isinstance(states, dict) and isinstance(data.get("config"), dict):
            from ..config import RunConfig, site_names

            try:
                names = site_names(RunConfig.from_dict(data["config"]))
            except FedContrastError:
                missing.append("a valid config")
            else:
                missing += [f"federation.site_states.{n}" for n in names if n not in states]
    return missing
