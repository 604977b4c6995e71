"""Algorithm plugins and their registry. Importing this package registers the built-ins.

The core interface is :class:`Algorithm`; the opt-in capabilities are :class:`SecureSum`,
:class:`UploadChecks`, :class:`SharedFiles` and :class:`PersonalEvaluation`; the run facts a plugin is
built with are :class:`RunFacts`. docs/plugins.md is the contract."""

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
    weight_specs,
    weight_tensors,
)
from .capabilities import PersonalEvaluation, SecureSum, SharedFiles, UploadChecks, secure_summable
from .facts import RunFacts
from .registry import (
    ENTRY_POINT_GROUP,
    available_algorithms,
    get_algorithm,
    import_plugin,
    import_plugins,
    register_algorithm,
)

# Built-ins: one registration line each (the decorator in each module).
from . import fedavg, fedpcl, fedprox, fedsiam, fedssc, flesd, moon, simclr  # noqa: E402  isort:skip

_BUILTIN_MODULES = (fedavg, fedpcl, fedprox, fedsiam, fedssc, flesd, moon, simclr)  # imported to register them

__all__ = ["ENTRY_POINT_GROUP", "Algorithm", "Downlink", "InvalidUploadError", "PersonalEvaluation", "RunFacts",
           "SecureSum", "ServerContext", "SharedFiles", "SiteContext", "TaskResult", "TensorSpec", "UploadChecks",
           "available_algorithms", "get_algorithm", "import_plugin", "import_plugins", "load_weights", "nbytes",
           "register_algorithm", "secure_summable", "validate_uploads", "weight_specs", "weight_tensors"]
