"""Reading the YAML files fedcontrast itself reads (run configurations, plans, site policies).

PyYAML keeps the last of two equal keys in a mapping, so a setting written twice (``rounds: 2`` …
``rounds: 50``) would silently win or lose depending on its position. Every file read here refuses a
duplicate key with one sentence naming the key, the file and the line. Writing stays ``yaml.safe_dump``.

Every YAML document is bounded: at most :data:`MAX_YAML_BYTES` of text, and at most
:data:`MAX_YAML_NODES` nodes once every alias is expanded (the generated plans share one run
configuration through anchors, so aliases stay allowed; an alias-expansion bomb — "billion laughs" —
or a structure that contains itself is refused before anything walks it). Every file a party reads
goes through :func:`~fedcontrast.files.read_bytes` (re-exported here, with
:func:`~fedcontrast.files.check_regular_file`), which refuses anything but a regular file (a FIFO, a
device or a socket would block the reader forever) and a file larger than its limit, before reading it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError
from .files import MAX_FILE_BYTES, check_regular_file, read_bytes  # noqa: F401 (re-exported: their home was here)

# A plan, a run configuration, a site policy or a collaborator list is a few kB: 1 MiB of YAML is far
# beyond any of them, and the most a party parses (PyYAML takes seconds per MiB).
MAX_YAML_BYTES = 1 << 20
# The most nodes (scalars, sequences, mappings) a YAML document may hold with its aliases expanded; the
# generated plans hold about a thousand.
MAX_YAML_NODES = 200_000


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

    def get_single_data(self) -> Any:
        """The document, its node graph measured (:func:`_expanded_size`) before anything is constructed."""
        node = self.get_single_node()
        if node is None:
            return None
        _expanded_size(node)
        return self.construct_document(node)


class TooLargeError(yaml.YAMLError):
    """A YAML document that expands past :data:`MAX_YAML_NODES` nodes, or contains itself."""


def _expanded_size(root: yaml.Node) -> int:
    """The number of nodes of ``root`` with every alias expanded (an alias is the node it names, shared
    in the graph PyYAML composes), counted once per node without expanding anything; more than
    :data:`MAX_YAML_NODES`, or a node that contains itself, raises :class:`TooLargeError`."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            open_nodes.discard(key)
            total = 1 + sum(sizes[id(child)] for child in _children(node))
            if total > MAX_YAML_NODES:
                raise TooLargeError(f"it expands to more than {MAX_YAML_NODES:,} values through its aliases (an "
                                    "alias-expansion bomb?)")
            sizes[key] = total
            continue
        if key in sizes:
            continue
        if key in open_nodes:
            raise TooLargeError(f"an alias on line {node.start_mark.line + 1} refers to a value that contains it, "
                                "which never ends when expanded")
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in sizes)
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def loads_yaml(text: str, source: str) -> Any:
    """Parse ``text`` (read from ``source``, named in messages); syntax errors, duplicate keys, and a
    document beyond the bounds (:data:`MAX_YAML_BYTES`, :data:`MAX_YAML_NODES`) become one-sentence
    :class:`ConfigError`."""
    if len(text) > MAX_YAML_BYTES:
        raise ConfigError(f"{source} is {len(text):,} characters long, more than the {MAX_YAML_BYTES:,} a YAML file "
                          "may hold here; it is not a file fedcontrast wrote: replace it")
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 — a SafeLoader subclass
    except DuplicateKeyError as exc:
        raise ConfigError(f"{source}: {exc.problem}; a setting may appear only once, remove one of them") from None
    except TooLargeError as exc:
        raise ConfigError(f"{source} is refused, nothing of it was used: {exc}; replace it") from None
    except RecursionError:
        raise ConfigError(f"{source} is refused, nothing of it was used: it is nested too deeply to be a file "
                          "fedcontrast wrote; replace it") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source} is not valid YAML: {str(exc).splitlines()[0]}") from None


def load_yaml_file(path: str | Path, what: str = "file") -> Any:
    """The YAML document in ``path`` (``what`` names the kind of file in messages: "plan", "site
    policy" …); a missing, unreadable or invalid file, or a duplicate key, is a :class:`ConfigError`."""
    p = Path(path)
    return loads_yaml(read_text(p, what, limit=MAX_YAML_BYTES), f"{what} {p}")


def read_text(path: str | Path, what: str = "file", *, limit: int = MAX_FILE_BYTES) -> str:
    """A text file a party reads (a plan, ``plan/data.yaml``, ``requirements.txt``, a record), decoded as
    UTF-8; a file that cannot be read (:func:`read_bytes`: a folder, a FIFO, too large) or decoded is one
    :class:`ConfigError` naming it, the line and what to do."""
    p = Path(path)
    data = read_bytes(p, what, limit=limit)
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
