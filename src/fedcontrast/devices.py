"""Where tensors live: the run's device, reproducible CUDA, and a CPU stand-in for a GPU.

Rules the code keeps so that a run is right on CUDA as on the CPU:

* every tensor, module and ``torch.Generator`` the package creates names its device. Models are
  built on the CPU (``with torch.device("cpu")``: their initial weights come from the CPU RNG, the
  same on every device) and then moved to the run's device;
* generators that decide *which* samples (batches, Poisson subsampling, augmentations) live on the
  CPU and are seeded as they always were, so CPU results do not depend on the device code; a
  generator that drives sampling *on* the run's device (DP-SGD's noise) lives on that device
  (:func:`device_generator`);
* on CUDA the run is deterministic (:func:`resolve_device` turns on
  ``torch.use_deterministic_algorithms`` with ``CUBLAS_WORKSPACE_CONFIG=:4096:8``).

:func:`cpu_stand_in` checks the first rule on a machine without a GPU: inside it torch's default
device is ``meta``, so a tensor or module created without a device is a meta tensor and mixing it
with the run's (CPU) tensors raises, as a CPU tensor mixed with CUDA tensors would; and a
``torch.Generator`` the package creates without a device raises at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from .errors import ConfigError

_PACKAGE_DIR = str(Path(__file__).resolve().parent)
CUBLAS_WORKSPACE = ":4096:8"  # what cuBLAS needs for deterministic results (CUDA ≥ 10.2)


def resolve_device(name: str) -> torch.device:
    """``auto`` → ``cuda`` where CUDA is available, else ``cpu``. A CUDA device is made
    deterministic (:func:`make_cuda_deterministic`) before the run touches it."""
    if name == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} was requested but CUDA is not available on this machine")
    else:
        device = torch.device(name)
    if device.type == "cuda":
        make_cuda_deterministic()
    return device


def make_cuda_deterministic() -> None:
    """Deterministic kernels on CUDA: the same seed gives the same run, and a resumed run equals the
    uninterrupted one. ``CUBLAS_WORKSPACE_CONFIG`` is read when cuBLAS starts (the first matrix
    product), so this must run before any; an operator's own setting is kept. A kernel without a
    deterministic version warns (once, naming the operation) instead of stopping the run."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    if not torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        logging.getLogger(__name__).info("CUDA: deterministic algorithms on (CUBLAS_WORKSPACE_CONFIG=%s)",
                                         os.environ["CUBLAS_WORKSPACE_CONFIG"])


def device_generator(device: torch.device, seed: int) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``: for sampling that happens on the device."""
    return torch.Generator(device=device).manual_seed(seed)


# --- the CPU stand-in -------------------------------------------------------------------------------

class DeviceMistake(RuntimeError):
    """Raised inside :func:`cpu_stand_in` where the code would put something on the wrong device."""


_REAL_GENERATOR = torch.Generator


class _GeneratorCheck(type(_REAL_GENERATOR)):
    def __instancecheck__(cls, obj) -> bool:  # torch's own generators are generators too
        return isinstance(obj, _REAL_GENERATOR)


class _PlacedGenerator(_REAL_GENERATOR, metaclass=_GeneratorCheck):
    """``torch.Generator`` inside the stand-in: fedcontrast's code must say where a generator lives
    (a CPU generator used for a CUDA model's noise is the crash this catches); others get torch's
    default, the CPU."""

    def __new__(cls, device=None):
        if device is None and _called_from_package():
            frame = sys._getframe(1)
            raise DeviceMistake(f"torch.Generator() without a device at {frame.f_code.co_filename}:{frame.f_lineno}; "
                                "say where it samples: torch.Generator(device=...)")
        return _REAL_GENERATOR.__new__(cls, "cpu" if device is None else device)


def _called_from_package() -> bool:
    frame = sys._getframe(2)
    return Path(frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE_DIR)


@contextlib.contextmanager
def cpu_stand_in() -> Iterator[torch.device]:
    """Run the code inside on the CPU as if the CPU were a GPU: yields the device to run on
    (``cpu``). Anything the code creates without naming a device is a ``meta`` tensor, which raises
    as soon as it meets a real one; a ``torch.Generator`` created by fedcontrast without a device
    raises :class:`DeviceMistake`. Results are those of a CPU run. Not thread-safe (it changes
    torch's process-wide defaults, restored on exit)."""
    previous = torch.get_default_device()
    torch.set_default_device("meta")
    torch.Generator = _PlacedGenerator
    try:
        yield torch.device("cpu")
    finally:
        torch.Generator = _REAL_GENERATOR
        torch.set_default_device(previous)


