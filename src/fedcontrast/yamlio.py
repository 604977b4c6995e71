"""Reading the YAML files fedcontrast itself reads (run configurations, plans, site policies).

PyYAML keeps the last of two equal keys in a mapping, so a setting written twice (``rounds: 2`` …
``rounds: 50``) would silently win or lose depending on its position. Every file read here refuses a
duplicate key with one sentence naming the key, the file and the line. Writing stays ``yaml.safe_dump``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping that names a key twice."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping. Keys merged in with
    ``<<: *anchor`` may be overridden, as YAML intends."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            line = key_node.start_mark.line + 1
            if first is not None:
                raise DuplicateKeyError(None, None, f"the key {key!r} is given twice (lines {first} and {line})",
                                        key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def loads_yaml(text: str, source: str) -> Any:
    """Parse ``text`` (read from ``source``, named in messages); syntax errors and duplicate keys
    become one-sentence :class:`ConfigError`."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 — a SafeLoader subclass
    except DuplicateKeyError as exc:
        raise ConfigError(f"{source}: {exc.problem}; a setting may appear only once, remove one of them") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source} is not valid YAML: {str(exc).splitlines()[0]}") from None


def load_yaml_file(path: str | Path, what: str = "file") -> Any:
    """The YAML document in ``path`` (``what`` names the kind of file in messages: "plan", "site
    policy" …); a missing, unreadable or invalid file, or a duplicate key, is a :class:`ConfigError`."""
    p = Path(path)
    if not p.is_file():
        if p.is_dir():
            raise ConfigError(f"{what} {p} is a folder, not a file")
        if os.path.lexists(p):
            raise ConfigError(f"{what} {p} is not a regular file" + (" (a link to nothing)" if p.is_symlink() else ""))
        raise ConfigError(f"{what} {p} does not exist")
    return loads_yaml(read_text(p, what), f"{what} {p}")


def read_text(path: str | Path, what: str = "file") -> str:
    """A text file a party reads (a plan, ``plan/data.yaml``, ``requirements.txt``, a record), decoded as
    UTF-8; a file that cannot be read or decoded is one :class:`ConfigError` naming it, the line and what to do."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} {p} cannot be read ({type(exc).__name__}: {exc.strerror or exc})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{what} {p} is not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line}): it is damaged "
                          "or was saved in another encoding; write it again as UTF-8 text") from None


def read_json(path: str | Path, what: str = "file") -> Any:
    """A JSON file a party reads (its report's records), decoded; one :class:`ConfigError` when it is not."""
    import json

    p = Path(path)
    try:
        return json.loads(read_text(p, what))
    except ValueError as exc:
        raise ConfigError(f"{what} {p} is not valid JSON ({exc}): it is damaged; restore it or run again") from None
