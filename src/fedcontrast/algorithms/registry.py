"""The one registry of algorithm plugins.

Built-ins register themselves with :func:`register_algorithm`; third-party packages add theirs
through the entry-point group ``fedcontrast.algorithms`` (``name = "pkg.module:AlgorithmClass"``),
loaded the first time the registry is read.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from ..errors import ConfigError, UnknownNameError
from .base import Algorithm

ENTRY_POINT_GROUP = "fedcontrast.algorithms"
_REGISTRY: dict[str, type[Algorithm]] = {}
_entry_points_loaded = False


def register_algorithm(cls: type[Algorithm]) -> type[Algorithm]:
    """Register ``cls`` under ``cls.name``; usable as a class decorator. Duplicate names raise."""
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise TypeError(f"{cls!r} is not a subclass of fedcontrast.algorithms.Algorithm")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__name__} must set a non-empty class attribute 'name'")
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"an algorithm named {name!r} is already registered ({_REGISTRY[name].__module__})")
    _REGISTRY[name] = cls
    return cls


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            cls = ep.load()
        except Exception as exc:  # a broken third-party plugin must not break the built-ins
            raise ConfigError(f"the algorithm plugin {ep.name!r} ({ep.value}) failed to load: {exc}") from None
        if ep.name in _REGISTRY and _REGISTRY[ep.name] is cls:
            continue
        register_algorithm(cls)


def available_algorithms() -> list[str]:
    _load_entry_points()
    return sorted(_REGISTRY)


def get_algorithm(name: str) -> type[Algorithm]:
    """The plugin class registered as ``name``; an unknown name lists the known ones."""
    _load_entry_points()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownNameError(f"unknown algorithm {name!r}; known algorithms: "
                               f"{', '.join(sorted(_REGISTRY))}") from None
