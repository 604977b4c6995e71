"""Algorithm plugins and their registry. Importing this package registers the built-ins."""

from .base import (
    Algorithm,
    Downlink,
    InvalidUploadError,
    ServerContext,
    SiteContext,
    TaskResult,
    TensorSpec,
    load_weights,
    nbytes,
    validate_uploads,
    weight_tensors,
)
from .registry import ENTRY_POINT_GROUP, available_algorithms, get_algorithm, register_algorithm

# Built-ins: one registration line each (the decorator in each module).
from . import fedavg, fedpcl, fedprox, fedsiam, fedssc, flesd, moon, simclr  # noqa: E402  isort:skip

_BUILTIN_MODULES = (fedavg, fedpcl, fedprox, fedsiam, fedssc, flesd, moon, simclr)  # imported to register them

__all__ = ["ENTRY_POINT_GROUP", "Algorithm", "Downlink", "InvalidUploadError", "ServerContext",
           "SiteContext", "TaskResult", "TensorSpec", "available_algorithms", "get_algorithm",
           "load_weights", "nbytes", "register_algorithm", "validate_uploads", "weight_tensors"]
