"""The tensors that travel, as plain data: their declaration (:class:`TensorSpec`), the check of an
upload against it (:func:`validate_uploads`), and model weights as named tensors (``model.<key>``).

A low-level module: it imports nothing of fedcontrast but :mod:`fedcontrast.errors`, so the plugin
interface (:mod:`fedcontrast.algorithms.base`, which re-exports every name here), the evaluation
and the aggregator's screen (:mod:`fedcontrast.robust`) can all build on it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .errors import FedContrastError

WEIGHT_PREFIX = "model."
TENSOR_KINDS = ("weights", "representation", "count", "metadata")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor that crosses the network: its name, shape, dtype, direction and meaning."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    direction: str  # "upload" (site → aggregator) or "download" (aggregator → site)
    per_site: bool = False  # download only: each site receives its own copy
    description: str = ""
    # what it is, for the privacy audit: "weights" (raw model weights), "representation" (derived
    # from the data through the model: class means, prototypes), "count", "metadata"
    kind: str = "representation"

    def __post_init__(self) -> None:
        if self.kind not in TENSOR_KINDS:
            raise ValueError(f"TensorSpec.kind must be one of {', '.join(TENSOR_KINDS)}, got {self.kind!r}")

    @property
    def nbytes(self) -> int:
        dtype: torch.dtype = getattr(torch, self.dtype)
        return math.prod(self.shape) * dtype.itemsize


class InvalidUploadError(FedContrastError):
    """An upload that does not match the plugin's declaration; names the site and the tensor."""


def validate_uploads(site: str, uploads: Mapping[str, torch.Tensor], specs: list[TensorSpec], *,
                     finite: bool = False) -> None:
    """Reject an upload whose names, shapes or dtypes differ from ``specs`` or that holds NaN/inf.
    ``finite``: every value is known to be finite (measured where the upload was made, by the
    simulator's own site code): the values are not checked again."""
    declared = {s.name: s for s in specs if s.direction == "upload"}
    extra = sorted(set(uploads) - set(declared))
    if extra:
        raise InvalidUploadError(f"site {site!r} uploaded undeclared tensor(s) {extra[:3]}; rejected")
    missing = sorted(set(declared) - set(uploads))
    if missing:
        raise InvalidUploadError(f"site {site!r} did not upload declared tensor(s) {missing[:3]}; rejected")
    if _declared_and_finite(uploads, declared, finite):
        return  # the usual case, in a few operations; else the loop below says what is wrong, first name first
    for name, t in uploads.items():
        spec = declared[name]
        if tuple(t.shape) != spec.shape:
            raise InvalidUploadError(f"site {site!r} uploaded {name!r} with shape {tuple(t.shape)}, "
                                     f"declared {spec.shape}; rejected")
        if str(t.dtype).removeprefix("torch.") != spec.dtype:
            raise InvalidUploadError(f"site {site!r} uploaded {name!r} as {t.dtype}, declared {spec.dtype}; rejected")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise InvalidUploadError(f"site {site!r} uploaded {name!r} with NaN or infinite values; rejected")


def _declared_and_finite(uploads: Mapping[str, torch.Tensor], declared: Mapping[str, TensorSpec],
                         finite: bool = False) -> bool:
    """Every tensor of ``uploads`` of its declared shape and dtype, and every value finite (unless known
    to be, ``finite``): the values are summed, all tensors of a dtype and device at once — a finite sum
    has no NaN or infinity among its terms; a sum that is not finite (or overflowed) sends the upload
    to the check of each tensor, which names the culprit."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for name, t in uploads.items():
        spec = declared[name]
        if tuple(t.shape) != spec.shape or str(t.dtype).removeprefix("torch.") != spec.dtype:
            return False
        if t.is_floating_point() and t.numel() and not finite:
            groups.setdefault((t.dtype, t.device), []).append(t.reshape(-1))
    return all(bool(torch.isfinite((torch.cat(flat) if len(flat) > 1 else flat[0]).sum()))
               for flat in groups.values())


def weight_specs(model: nn.Module, direction: str, description: str) -> list[TensorSpec]:
    """One spec per floating-point entry of ``model.state_dict()`` (parameters and BN statistics)."""
    return [TensorSpec(WEIGHT_PREFIX + k, tuple(v.shape), str(v.dtype).removeprefix("torch."),
                       direction, description=description, kind="weights")
            for k, v in model.state_dict().items() if v.is_floating_point()]


def weight_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of the model's floating-point state, named ``model.<key>``.

    Integer buffers (BatchNorm's ``num_batches_tracked``) stay on the site: averaging a counter is
    meaningless and it does not affect the forward pass when a momentum is set.
    """
    return {WEIGHT_PREFIX + k: v.detach().clone() for k, v in model.state_dict().items()
            if v.is_floating_point()}


def load_weights(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy every ``model.<key>`` tensor of ``tensors`` into ``model``, in place."""
    state = model.state_dict()
    with torch.no_grad():
        for name, value in tensors.items():
            if name.startswith(WEIGHT_PREFIX):
                key = name[len(WEIGHT_PREFIX):]
                if key not in state:
                    raise FedContrastError(f"received weight {name!r} that the local model does not have")
                state[key].copy_(value)


def nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


_SHARED: dict[Any, Any] = {}  # at most SHARED_ENTRIES of them
SHARED_ENTRIES = 64


def shared(value: Any) -> Any:
    """One object for equal (hashable) values: the same layout or list of names, met once per site,
    is then one object, which pickle (and so Ray) writes once per task and memoises after."""
    found = _SHARED.get(value)
    if found is not None:
        return found
    if len(_SHARED) < SHARED_ENTRIES:
        _SHARED[value] = value
    return value


__all__ = ["TENSOR_KINDS", "WEIGHT_PREFIX", "InvalidUploadError", "TensorSpec", "load_weights", "nbytes", "shared",
           "validate_uploads", "weight_specs", "weight_tensors"]
