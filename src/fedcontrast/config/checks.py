"""How a setting is checked: one :class:`~fedcontrast.errors.ConfigError` sentence per problem, every
field against its type annotation (:func:`_check_types`), a section given as a mapping converted with
its unknown keys named (:func:`_typed_section`), and the sane bounds every section shares."""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any

from ..errors import ConfigError


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# Sane bounds, refused at configuration time rather than met as a memory blow-up or a NaN upload later.
MAX_IMAGE_SIZE = 1024  # pixels per side of the model's input
MAX_PROJECTION_DIM = 65536
# Clipping bounds (DP-SGD's max_grad_norm, the representations' clip): far above any useful bound,
# and small enough that σ·C noise stays finite in float32.
MAX_CLIP = 1e4
# Noise multipliers σ: below 0.1 ε is in the hundreds or more (no privacy at all) and Opacus's PRV
# accountant runs out of memory; above 1e6 the noise is all there is.
MIN_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER = 0.1, 1e6
# δ must be well below 1/n for the guarantee to mean anything (δ ≥ 1/n allows releasing a sample).
MAX_DELTA = 0.01


def _in_range(x: Any, low: float, high: float) -> bool:
    return _finite(x) and low <= x <= high


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` (as YAML gives it) fits the type annotation ``hint``; containers are checked
    on the outside only (the field's own check looks inside)."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is tuple or hint is tuple:
        return isinstance(value, (tuple, list))
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return isinstance(value, (hint, dict))  # a mapping is converted by the field's own code
    return True


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    if dataclasses.is_dataclass(hint):
        return "a mapping of settings"
    names = {type(None): "left out", bool: "true or false", int: "an integer", float: "a number", str: "a string",
             tuple: "a list", dict: "a mapping"}
    return names.get(typing.get_origin(hint) or hint, str(hint))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_types(obj: Any, prefix: str = "") -> None:
    """Every field of the dataclass ``obj`` checked against its annotation, so that a list where a
    number belongs (``training: [1, 2]``, ``device: 5``) is one sentence, not a traceback later."""
    cls: type = type(obj)  # (mypy takes type(obj) for unhashable)
    hints = _hints(cls)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        _check(_fits(value, hints[f.name]), f"{prefix}{f.name} must be {_describe(hints[f.name])}, got {value!r}")


def _check_noise_multiplier(value: Any, name: str) -> None:
    _check(_in_range(value, MIN_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER),
           f"{name} must be a number > 0 in [{MIN_NOISE_MULTIPLIER:g}, {MAX_NOISE_MULTIPLIER:g}] (below "
           f"{MIN_NOISE_MULTIPLIER:g} there is no privacy to speak of), got {value!r}")


def _check_clip(value: Any, name: str) -> None:
    _check(_finite(value) and 0 < value <= MAX_CLIP,
           f"{name} must be a number > 0 and at most {MAX_CLIP:g} (a larger bound clips nothing), got {value!r}")


def _typed_section(cls: type, value: Any, name: str) -> Any:
    """``value`` as ``cls``: a mapping is checked for unknown keys and converted; None stays None."""
    if value is None or isinstance(value, cls):
        return value
    _check(isinstance(value, dict), f"{name} must be a mapping of settings")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    _check(not unknown, f"unknown {name} setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    try:
        return cls(**value)
    except TypeError as exc:
        raise ConfigError(f"invalid {name} settings: {exc}") from None


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value
