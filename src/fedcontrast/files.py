"""Reading a file a party reads, bounded: :func:`read_bytes` refuses anything but a regular file (a
FIFO, a device or a socket would block the reader forever) and a file larger than its limit, before
reading it; :func:`check_regular_file` checks the same without opening it. The records
(:mod:`fedcontrast.jsonl`) and the YAML and text files (:mod:`fedcontrast.yamlio`, which re-exports
both) are read through it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import ConfigError

# The most bytes :func:`read_bytes` reads of a file by default (a record, a certificate, a data file).
MAX_FILE_BYTES = 64 << 20


_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


def _kind_problem(p: Path, mode: int) -> str | None:
    """Why a file of ``mode`` is not read (None: a regular file)."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a folder, not a file"
    kind = next((name for test, name in _KINDS if test(mode)), "a special file")
    return (f"is {kind}, not a regular file: nothing was read from it (reading it could block for ever); put the "
            "file itself there")


def check_regular_file(path: str | Path, what: str = "file", *, limit: int | None = MAX_FILE_BYTES,
                       missing_ok: bool = False) -> os.stat_result | None:
    """``path``'s status when it is a regular file of at most ``limit`` bytes (links followed); else one
    :class:`ConfigError` naming it — a folder, a FIFO, a device, a socket, a link to nothing, a file too
    large. Nothing is opened. None when it does not exist and ``missing_ok``."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        if os.path.lexists(p):
            raise ConfigError(f"{what} {p} is not a regular file (a link to nothing)") from None
        if missing_ok:
            return None
        raise ConfigError(f"{what} {p} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"{what} {p} cannot be read ({type(exc).__name__}: {exc.strerror or exc})") from None
    problem = _kind_problem(p, st.st_mode)
    if problem:
        raise ConfigError(f"{what} {p} {problem}")
    if limit is not None and st.st_size > limit:
        raise ConfigError(f"{what} {p} is {st.st_size:,} bytes, more than the {limit:,} read here; it is not a file "
                          "fedcontrast wrote: replace it")
    return st


def read_bytes(path: str | Path, what: str = "file", *, limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of a file a party reads (a plan, a data file, a certificate, a key, a record): refused in
    one :class:`ConfigError` naming it, before it is opened, unless it is a regular file of at most
    ``limit`` bytes (:func:`check_regular_file`); opened without blocking and checked again once open (a
    file swapped for a FIFO in between is refused too)."""
    p = Path(path)
    check_regular_file(p, what, limit=limit)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
        with os.fdopen(fd, "rb") as f:
            problem = _kind_problem(p, os.fstat(f.fileno()).st_mode)
            if problem:
                raise ConfigError(f"{what} {p} {problem}")
            data = f.read(limit + 1)
    except OSError as exc:
        raise ConfigError(f"{what} {p} cannot be read ({type(exc).__name__}: {exc.strerror or exc})") from None
    if len(data) > limit:
        raise ConfigError(f"{what} {p} is more than the {limit:,} bytes read here; it is not a file fedcontrast "
                          "wrote: replace it")
    return data
