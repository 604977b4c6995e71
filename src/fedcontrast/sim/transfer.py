"""What travels between the simulator's driver and the processes that train its sites away from it
(:mod:`.ray_executor`): tensors as numpy arrays, which Ray hands over without copying them through
pickle (a tensor would be serialised through ``torch.save``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from ..tensors import shared

__all__ = ["pack", "pack_flat", "unpack"]


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
    if isinstance(value, (list, tuple)) and not isinstance(value, (_Array, _Flat)):
        return _rebuilt(value, [pack(v) for v in value])
    return value


class _Flat(NamedTuple):
    """Tensors of one dtype on their way as one numpy array (:func:`pack_flat`): one buffer, one copy
    and one transfer to the device for a site's whole upload instead of one per tensor."""

    array: np.ndarray
    dtype: torch.dtype
    layout: tuple[tuple[str, tuple[int, ...], int, int], ...]  # (name, shape, offset, numel) of each


def pack_flat(tensors: dict[str, torch.Tensor]) -> Any:
    """``tensors`` (name → tensor) as one :class:`_Flat` when they share one dtype, else as :func:`pack`
    makes them; :func:`unpack` gives them back, views of one tensor of their own."""
    values = [t.detach().cpu() for t in tensors.values()]
    if len(values) < 2 or values[0].dtype not in _NUMPY_DTYPES or any(t.dtype != values[0].dtype for t in values):
        return pack(tensors)
    layout, offset = [], 0
    for name, t in zip(tensors, values):
        layout.append((name, tuple(t.shape), offset, t.numel()))
        offset += t.numel()
    return _Flat(torch.cat([t.reshape(-1) for t in values]).numpy(), values[0].dtype, shared(tuple(layout)))




def _rebuilt(value: list | tuple, items: list) -> Any:
    """A list, tuple or named tuple of ``value``'s type holding ``items``."""
    return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)


def unpack(value: Any, device: torch.device | None = None) -> Any:
    """The inverse of :func:`pack` (tensors on ``device``; own copies, writable)."""
    if isinstance(value, _LEAVES):
        return value
    if isinstance(value, _Array):
        tensor = torch.from_numpy(np.array(value.array, copy=True))
        return tensor if device is None else tensor.to(device)
    if isinstance(value, _Flat):
        flat = torch.from_numpy(np.array(value.array, copy=True))
        flat = flat if device is None else flat.to(device)
        return {name: flat[offset:offset + numel].view(shape) for name, shape, offset, numel in value.layout}
    if isinstance(value, torch.Tensor):
        return value if device is None else value.to(device)
    if isinstance(value, dict):
        return {k: unpack(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return _rebuilt(value, [unpack(v, device) for v in value])
    return value


_LEAVES = (str, bytes, int, float, type(None))  # nothing inside to unpack (bool is an int)
_NUMPY_DTYPES = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                 torch.uint8, torch.bool, torch.complex64, torch.complex128}
