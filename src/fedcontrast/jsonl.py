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
    return [record for _, _, record in read_jsonl_lines(path, what)]


def read_jsonl_lines(path: str | Path, what: str = "records") -> list[tuple[int, str, Any]]:
    """(line number, text, record) of each record of ``path``, as :func:`read_jsonl` reads them; the
    file is read only if it is a regular file (:func:`~fedcontrast.files.read_bytes`: never a FIFO)."""
    from .files import read_bytes

    path = Path(path)
    if not path.exists():
        return []
    text = read_bytes(path, what, limit=MAX_RECORDS_BYTES).decode("utf-8", errors="replace")
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append((number, line, json.loads(line)))
        except json.JSONDecodeError:
            if number == len(lines):  # the unterminated last line: a write the crash cut short
                logger.warning("%s: its last line (line %d) was cut short by a crash and is left out", path, number)
                continue
            raise ConfigError(f"line {number} of {path} ({what}) is not a JSON record: the file is damaged; "
                              "restore it from a backup or remove that line") from None
    return records


# A run's records are read whole: 4 GiB is far beyond any (1,000 sites' rows of 100 rounds take ~20 MB).
MAX_RECORDS_BYTES = 4 << 30


def read_run_records(path: str | Path, what: str, run: str | None) -> dict[int, tuple[int, str, dict[str, Any]]]:
    """The records of one run in ``path``, by round: ``{round: (line number, text, record)}``. Every
    line must be a record (a mapping) of a round (``"round"``, a positive integer) of the run ``run``
    (``"run"``; None: a run from before records named their run, whose lines name none). A line that
    names another run, or lacks its run where an earlier line gave one, and a second line for a round
    that differs from the first, are refused in one :class:`ConfigError` naming the file and the line —
    a record never silently replaces another; an identical duplicate is dropped. A line without a run
    before any line with one (written before records were bound to their run) is read as this run's."""
    path = Path(path)
    rounds: dict[int, tuple[int, str, dict[str, Any]]] = {}
    bound = False  # a line named its run: every later line must too
    for number, text, record in read_jsonl_lines(path, what):
        where = f"line {number} of {path} ({what})"
        if not isinstance(record, dict) or isinstance(record.get("round"), bool) \
                or not isinstance(record.get("round"), int) or record["round"] < 1:
            raise ConfigError(f"{where} is not a round's record (no round number): the file is damaged; restore it "
                              "from a backup or remove that line")
        r, named = record["round"], record.get("run")
        if named is None:
            if bound:
                raise ConfigError(f"{where}, round {r}, names no run where the lines before it name run {run}: it "
                                  "was not written by this run; remove that line or restore the file from a backup")
        elif named != run:
            raise ConfigError(f"{where} is round {r} of another run ({named}; this run is {run or 'unnamed'}): "
                              "a record of another run never replaces this run's; remove that line or restore the "
                              "file from a backup")
        else:
            bound = True
        first = rounds.get(r)
        if first is None:
            rounds[r] = (number, text, record)
        elif first[1].strip() != text.strip():
            raise ConfigError(f"{where} is a second record of round {r} that differs from the first (line {first[0]}):"
                              " one of them was altered or copied in; remove the wrong one or restore the file from a "
                              "backup")
    return rounds


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
