"""Round checkpoints: everything needed to continue a run exactly where it stopped.

Written atomically (temporary file, then rename) so a kill during the write leaves the previous
checkpoint intact; read with ``weights_only=True`` so a checkpoint cannot execute code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..atomic import atomic_torch_save
from ..errors import CheckpointError

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
    return data
