"""What travels between the simulator's driver and the processes that train its sites away from it
(:mod:`.ray_executor`): tensors as numpy arrays, which Ray hands over without copying them through
pickle (a tensor would be serialised through ``torch.save``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = ["pack", "unpack"]


class _Array(NamedTuple):
    """A tensor on its way between the driver and a worker, as a numpy array: Ray hands numpy arrays
    over without copying them through pickle (a tensor would be serialised through ``torch.save``)."""

    array: np.ndarray
    dtype: torch.dtype


def pack(value: Any) -> Any:
    """``value`` with every tensor (in dicts, lists, tuples) as an :class:`_Array`, on the CPU."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype in _NUMPY_DTYPES:
            return _Array(value.numpy(), value.dtype)
        return value
    if isinstance(value, dict):
        return {k: pack(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not isinstance(value, _Array):
        return _rebuilt(value, [pack(v) for v in value])
    return value


def _rebuilt(value: list | tuple, items: list) -> Any:
    """A list, tuple or named tuple of ``value``'s type holding ``items``."""
    return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)


def unpack(value: Any, device: torch.device | None = None) -> Any:
    """The inverse of :func:`pack` (tensors on ``device``; own copies, writable)."""
    if isinstance(value, _Array):
        tensor = torch.from_numpy(np.array(value.array, copy=True))
        return tensor if device is None else tensor.to(device)
    if isinstance(value, torch.Tensor):
        return value if device is None else value.to(device)
    if isinstance(value, dict):
        return {k: unpack(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return _rebuilt(value, [unpack(v, device) for v in value])
    return value


_NUMPY_DTYPES = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                 torch.uint8, torch.bool, torch.complex64, torch.complex128}
