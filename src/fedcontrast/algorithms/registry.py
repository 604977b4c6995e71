"""The one registry of algorithm plugins.

Built-ins register themselves with :func:`register_algorithm`; third-party packages add theirs
through the entry-point group ``fedcontrast.algorithms`` (``name = "pkg.module:AlgorithmClass"``),
loaded the first time the registry is read, or in a module a run names (``plugins:``, ``--plugin``),
imported by :func:`import_plugins` before the run builds its algorithm.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
from collections.abc import Iterable
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType

from ..config.run import is_plugin_file, plugin_problem
from ..errors import ConfigError, UnknownNameError
from .base import Algorithm

ENTRY_POINT_GROUP = "fedcontrast.algorithms"
_REGISTRY: dict[str, type[Algorithm]] = {}
_entry_points_loaded = False
_PLUGINS: dict[str, tuple[str, ...]] = {}  # a plugin module as given → the algorithms it registered


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


def import_plugins(plugins: Iterable[str]) -> None:
    """Import each plugin module of ``plugins`` (see :func:`import_plugin`)."""
    for plugin in plugins:
        import_plugin(plugin)


def import_plugin(plugin: str) -> tuple[str, ...]:
    """Import the plugin module ``plugin`` — a dotted module name, or a path to a ``.py`` file (imported
    as the module named by its stem) — so that the algorithms it registers can be named; returns their
    names. Importing it again does nothing. A module that cannot be found, fails to import (its
    registrations then undone) or registers no algorithm is a :class:`ConfigError` in one sentence."""
    if plugin in _PLUGINS:
        return _PLUGINS[plugin]
    problem = plugin_problem(plugin)
    if problem is not None:
        raise ConfigError(problem)
    before = dict(_REGISTRY)
    try:
        module = _import_file(plugin) if is_plugin_file(plugin) else _import_name(plugin)
    except ConfigError:
        _REGISTRY.clear()
        _REGISTRY.update(before)
        raise
    names = tuple(sorted(name for name, cls in _REGISTRY.items() if before.get(name) is not cls))
    if not names:  # imported before (e.g. by the caller's own script): the algorithms defined in it
        names = tuple(sorted(name for name, cls in _REGISTRY.items()
                             if (cls.__module__ + ".").startswith(module.__name__ + ".")))
    if not names:
        raise ConfigError(f"the plugin {plugin} registers no algorithm: decorate its Algorithm subclass with "
                          "@register_algorithm (from fedcontrast.algorithms)")
    _PLUGINS[plugin] = names
    return names


def _import_name(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name + ".").startswith(exc.name + "."):  # the plugin itself, not a dependency
            raise ConfigError(f"no plugin module named {name!r} can be imported here: install it, or put its "
                              "folder on PYTHONPATH") from None
        raise ConfigError(_failed(name, exc)) from None
    except Exception as exc:  # the plugin's own code: any error, named in one line
        raise ConfigError(_failed(name, exc)) from None


def _import_file(text: str) -> ModuleType:
    path = Path(text).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"the plugin file {text} does not exist")
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None:
        origin = getattr(loaded, "__file__", None)
        if origin is not None and Path(origin).resolve() == path:
            return loaded
        raise ConfigError(f"the plugin file {text} would be imported as {name!r}, the name of a module already "
                          f"imported ({origin or 'built in'}): rename the file")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"the plugin file {text} cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would (dataclasses, pickling by Ray look it up)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the plugin's own code: any error, named in one line
        del sys.modules[name]
        raise ConfigError(_failed(text, exc)) from None
    return module


def _failed(plugin: str, exc: BaseException) -> str:
    """One line: which plugin failed to import, where (the file and line the error was raised at) and why."""
    if isinstance(exc, SyntaxError) and exc.filename:
        where = f"{exc.filename}, line {exc.lineno}"
    else:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen")]
        where = f"{frames[-1].filename}, line {frames[-1].lineno}" if frames else "?"
    message = " ".join(str(exc).split()) if not isinstance(exc, SyntaxError) else (exc.msg or "invalid syntax")
    return f"the plugin {plugin} failed to import ({where}): {type(exc).__name__}: {message}"
