"""Append-only JSON-lines files (one record per line), read so that a crash in the middle of writing
the last line loses that record only, never the file."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from .errors import ConfigError

logger = logging.getLogger(__name__)


def read_jsonl(path: str | Path, what: str = "records") -> list[Any]:
    """The records of ``path`` (empty when it does not exist). A last line cut short by a crash
    (unterminated and unparsable) is left out with a warning; any other unreadable line is a
    :class:`ConfigError` naming the file and the line."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text(errors="replace")
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):  # the unterminated last line: a write the crash cut short
                logger.warning("%s: its last line (line %d) was cut short by a crash and is left out", path, number)
                continue
            raise ConfigError(f"line {number} of {path} ({what}) is not a JSON record: the file is damaged; "
                              "restore it from a backup or remove that line") from None
    return records


def append_jsonl(path: str | Path, record: Any, *, allow_nan: bool = False, sync: bool = True) -> None:
    """Append one record as one line and flush it to disk (``sync``: to the disk itself, fsync). A last
    line left unterminated by an earlier crash is cut off first, so the new record never joins it.
    ``allow_nan``: NaN and infinities written as Python's json reads them back (not strict JSON)."""
    path = Path(path)
    line = json.dumps(record, allow_nan=allow_nan) + "\n"
    with open(path, "a+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size:
            f.seek(max(0, size - 65536))
            tail = f.read()
            if not tail.endswith(b"\n"):
                cut = tail.rfind(b"\n")
                keep = size - len(tail) + cut + 1 if cut >= 0 else (0 if size <= 65536 else None)
                if keep is None:
                    raise ConfigError(f"{path} ends in a line over 64 KiB without a newline; it is damaged")
                f.truncate(keep)
        f.seek(0, os.SEEK_END)
        f.write(line.encode())
        f.flush()
        if sync:
            os.fsync(f.fileno())


def rewrite_jsonl(path: str | Path, records: list[Any], *, allow_nan: bool = False) -> None:
    """Replace the records of ``path`` with ``records``, atomically: a crash or a full disk leaves the
    old file or the new one, each whole, never a mix."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    data = "".join(json.dumps(record, allow_nan=allow_nan) + "\n" for record in records).encode()
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
