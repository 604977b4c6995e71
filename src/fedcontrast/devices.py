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
``torch.Generator`` the package creates without a device raises at once. What torch's optimisers
create without a device (Adam's step counter on torch 2.11) is on the CPU, as it is on a GPU machine,
whose default device is the CPU: the stand-in depends on no optimiser's internals
(:func:`stand_in_works` says whether it runs on the installed torch).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import torch
from torch.overrides import TorchFunctionMode

from .errors import ConfigError

_PACKAGE_DIR = str(Path(__file__).resolve().parent)
CUBLAS_WORKSPACE = ":4096:8"  # what cuBLAS needs for deterministic results (CUDA ≥ 10.2)


def resolve_device(name: str) -> torch.device:
    """``auto`` → ``cuda`` where CUDA is available, else ``cpu``. A CUDA device always carries its
    index (``cuda`` → ``cuda:0``, the current device), so that it equals the device of the tensors put
    there (``torch.device('cuda') != torch.device('cuda:0')``). A CUDA device is made deterministic
    (:func:`make_cuda_deterministic`) before the run touches it."""
    if name == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} was requested but CUDA is not available on this machine")
    else:
        device = torch.device(name)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= torch.cuda.device_count():
            raise ConfigError(f"device {name!r} was requested but this machine has {torch.cuda.device_count()} "
                              "CUDA device(s)")
        make_cuda_deterministic()
    return device


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether ``a`` and ``b`` name one device: ``cuda`` is the current CUDA device (``cuda:0``)."""
    def canonical(d: torch.device | str) -> torch.device:
        d = torch.device(d)
        if d.type == "cuda" and d.index is None:
            return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
        return d
    return canonical(a) == canonical(b)


def make_cuda_deterministic() -> None:
    """Deterministic kernels on CUDA: the same seed gives the same run, and a resumed run equals the
    uninterrupted one. ``CUBLAS_WORKSPACE_CONFIG`` is read when cuBLAS starts (the first matrix
    product), so this must run before any; an operator's own setting is kept. A kernel without a
    deterministic version warns (once, naming the operation) instead of stopping the run.

    TF32 is turned off for convolutions (on by default in torch) and matrix products: float32 then
    means float32's precision on the GPU as on the CPU (measured on an H100: FedAvg on digits came out
    1.5 points above the CPU over 10 seeds with TF32, within the seeds' spread without it)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
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


class _GeneratorCheck(type(_REAL_GENERATOR)):  # type: ignore[misc]  # torch.Generator's own metaclass
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
        # torch.Generator's constructor takes the device in __new__ (a C type), which its stub does not say
        return _REAL_GENERATOR.__new__(cls, "cpu" if device is None else device)  # type: ignore[call-arg]


def _called_from_package() -> bool:
    frame = sys._getframe(2)
    return Path(frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE_DIR)


# torch.optim's folder, as imported and as resolved (a venv's lib64 may be a link)
_OPTIM_DIRS = tuple({os.path.dirname(torch.optim.__file__) + os.sep,
                     str(Path(torch.optim.__file__).resolve().parent) + os.sep})


class _LibraryStateOnCpu(TorchFunctionMode):
    """Inside the stand-in: a tensor that torch's optimisers create without a device (Adam's step
    counter on torch 2.11, ``torch.tensor(0.0)``) is put on the CPU, as on a GPU machine (whose default
    device is the CPU, where torch hosts such counters on purpose), instead of ``meta``. Everything
    else is left to torch's default-device mode below this one."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (kwargs.get("device") is None and func in _constructors() and torch.get_default_device().type == "meta"
                and _inside_optimiser()):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _constructors() -> set:
    try:
        from torch.utils._device import _device_constructors  # what set_default_device itself applies to

        return _device_constructors()
    except ImportError:  # a torch without it: the common factories
        return {torch.empty, torch.zeros, torch.ones, torch.full, torch.tensor, torch.arange, torch.rand,
                torch.randn, torch.randint, torch.randperm, torch.eye, torch.linspace, torch.as_tensor}


def _inside_optimiser(depth: int = 12) -> bool:
    frame: FrameType | None = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_filename.startswith(_OPTIM_DIRS):
            return True
        frame = frame.f_back
    return False


def stand_in_works() -> tuple[bool, str]:
    """Whether the stand-in runs torch's own training steps on the installed torch (an SGD and an
    Adam step of a module placed on the CPU); else ``(False, why)``, for tests to skip with."""
    try:
        with cpu_stand_in() as device:
            with torch.device(device):
                model = torch.nn.Linear(2, 1)
            for make in (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), lambda p: torch.optim.Adam(p, lr=0.1)):
                optimizer = make(model.parameters())
                model(torch.ones(3, 2, device=device)).sum().backward()
                optimizer.step()
                float(next(iter(optimizer.state.values())).get("step", torch.zeros((), device=device)))
    except Exception as exc:  # noqa: BLE001 - any failure means the stand-in cannot run here
        return False, (f"the CPU stand-in cannot run torch {torch.__version__}'s optimisers "
                       f"({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})")
    return True, ""


@contextlib.contextmanager
def cpu_stand_in() -> Iterator[torch.device]:
    """Run the code inside on the CPU as if the CPU were a GPU: yields the device to run on
    (``cpu``). Anything the code creates without naming a device is a ``meta`` tensor, which raises
    as soon as it meets a real one; a ``torch.Generator`` created by fedcontrast without a device
    raises :class:`DeviceMistake`. Results are those of a CPU run. Not thread-safe (it changes
    torch's process-wide defaults, restored on exit)."""
    previous = torch.get_default_device()
    torch.set_default_device("meta")
    library_state = _LibraryStateOnCpu()
    library_state.__enter__()  # above the default-device mode: asked first
    torch.Generator = _PlacedGenerator  # type: ignore[misc]  # the stand-in's generators, for this block
    try:
        yield torch.device("cpu")
    finally:
        torch.Generator = _REAL_GENERATOR  # type: ignore[misc]
        library_state.__exit__(None, None, None)
        torch.set_default_device(previous)


