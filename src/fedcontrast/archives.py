"""Zip archives a party receives from another (the operator's workspace package, a signed certificate,
a certificate request), bounded from the archive's central directory before any entry is read.

A zip's central directory states every entry's compressed and uncompressed size; Python's zipfile
(and ``fx workspace import``, which unpacks with it) never produces more than the stated size of an
entry (a stream that would is cut off there, its CRC then fails). So the stated sizes bound what
reading or unpacking the archive can cost: :func:`check_archive` refuses, in one sentence naming the
archive, the entry and the limit, an archive whose total uncompressed size, number of entries, or any
entry's size or compression ratio exceeds :class:`ArchiveLimits` — before a byte of any entry is
decompressed. Entries are then read in a stream (:func:`scan_entry`), or whole only where small
(:func:`read_entry`, with its own bound).
"""

from __future__ import annotations

import zipfile
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from .errors import ConfigError

MiB, GiB = 1 << 20, 1 << 30
# An entry's ratio is checked from this size on: a small file may compress very well and still cost nothing.
RATIO_FROM_BYTES = MiB
CHUNK = MiB  # what one read of a streamed entry takes


class ArchiveRefused(ConfigError):
    """An archive over its limits, or not a zip archive; the message names the archive and why."""


@dataclass(frozen=True)
class ArchiveLimits:
    """What a site unpacks from one archive at most. The defaults are far above any real package (a
    fedcontrast plan, its initial model and shared backbone files: a few MB to a few hundred MB;
    weights compress about 1.1×, YAML 3–10×) and far below what would exhaust a machine; a site may set
    each in its policy (``package_limits:``)."""

    max_total_bytes: int = 4 * GiB  # all entries, uncompressed
    max_entries: int = 10_000
    max_entry_bytes: int = 2 * GiB  # one entry, uncompressed
    max_ratio: int = 100  # one entry's uncompressed ÷ compressed size (entries of 1 MiB and more)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and value.is_integer():
                object.__setattr__(self, f.name, int(value))
                value = int(value)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"package_limits.{f.name} must be an integer >= 1, got {value!r}")

    @classmethod
    def from_mapping(cls, data: Any, what: str = "package_limits") -> ArchiveLimits:
        """The limits a site's policy sets (``{max_total_bytes: …, …}``; the others keep their defaults)."""
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ConfigError(f"{what} must be a mapping of limits ({', '.join(f.name for f in fields(cls))}), got "
                              f"{data!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{what} has unknown limit(s) {', '.join(map(str, unknown))}; known: "
                              f"{', '.join(sorted(known))}")
        return cls(**dict(data))


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB" if n >= MiB else f"{n} bytes"


def check_archive(archive: str | Path, limits: ArchiveLimits | None = None, *, what: str = "") -> list[zipfile.ZipInfo]:
    """The entries of ``archive`` when it is within ``limits`` (read from its central directory only),
    else :class:`ArchiveRefused` naming the first limit it exceeds. ``what``: how to call it in the sentence."""
    limits = limits or ArchiveLimits()
    archive = Path(archive)
    name = what or str(archive)
    try:
        with zipfile.ZipFile(archive) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise ArchiveRefused(f"{name} is not a readable zip archive ({type(exc).__name__}: {exc})") from None
    advice = ("nothing was unpacked; ask the sender, or raise the limit in the site policy's package_limits "
              "if the archive is genuine")
    if len(infos) > limits.max_entries:
        raise ArchiveRefused(f"{name} holds {len(infos):,} entries, more than the {limits.max_entries:,} of "
                             f"package_limits.max_entries: {advice}")
    total = 0
    for info in infos:
        if info.file_size > limits.max_entry_bytes:
            raise ArchiveRefused(f"{name}'s entry {info.filename} unpacks to {_size(info.file_size)}, more than the "
                                 f"{_size(limits.max_entry_bytes)} of package_limits.max_entry_bytes: {advice}")
        if info.file_size >= RATIO_FROM_BYTES and info.file_size > limits.max_ratio * max(info.compress_size, 1):
            ratio = info.file_size / max(info.compress_size, 1)
            raise ArchiveRefused(f"{name}'s entry {info.filename} unpacks to {_size(info.file_size)} from "
                                 f"{_size(info.compress_size)}, a compression ratio of {ratio:,.0f}, above the "
                                 f"{limits.max_ratio} of package_limits.max_ratio (a zip bomb?): {advice}")
        total += info.file_size
        if total > limits.max_total_bytes:
            raise ArchiveRefused(f"{name} unpacks to more than {_size(limits.max_total_bytes)} (package_limits."
                                 f"max_total_bytes) by its entry {info.filename}: {advice}")
    return infos


def scan_entry(z: zipfile.ZipFile, info: zipfile.ZipInfo) -> Iterator[bytes]:
    """An entry's bytes in chunks of at most :data:`CHUNK` (never the whole entry at once)."""
    try:
        with z.open(info) as f:
            while chunk := f.read(CHUNK):
                yield chunk
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, zlib.error) as exc:  # a damaged or lying entry
        raise ArchiveRefused(f"entry {info.filename} of {z.filename} cannot be read ({type(exc).__name__}: {exc}); "
                             "nothing was unpacked") from None


def read_entry(z: zipfile.ZipFile, name: str, *, max_bytes: int = 16 * MiB, what: str = "") -> bytes:
    """A small entry (a plan, a certificate, a requirement list) read whole, refused in one sentence when
    its stated size is over ``max_bytes``. Raises KeyError when the archive has no such entry."""
    info = z.getinfo(name)
    if info.file_size > max_bytes:
        raise ArchiveRefused(f"{what or name} in {z.filename} is {_size(info.file_size)}, more than the "
                             f"{_size(max_bytes)} such a file can be; nothing was unpacked")
    return b"".join(scan_entry(z, info))
