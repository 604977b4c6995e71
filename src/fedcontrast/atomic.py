"""Writing files so that a kill or a full disk mid-write leaves the previous version intact."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path
from typing import Any

from .errors import OutputError

DISK_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


def write_failure(path: str | Path, exc: OSError) -> OutputError:
    """One sentence for a file that could not be written; a full disk and a file size limit alike."""
    if exc.errno in DISK_FULL:
        return OutputError(f"could not write {path}: no space left on device (disk full or file size limit); "
                           "the files written before it are intact: free some space and start the run again "
                           "(`fedcontrast simulate` / `federation`: with --resume; `fx`: it resumes from its "
                           "saved state)")
    return OutputError(f"could not write {path}: {exc.strerror or exc}")


def atomic_write_bytes(path: str | Path, data: bytes | memoryview) -> None:
    """Write ``data`` to a temporary file beside ``path``, then rename it over ``path``; on failure
    the temporary file is removed and :class:`OutputError` names ``path``."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise write_failure(path, exc) from None


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` into memory first: torch's own writer reports a full disk only as "unexpected
    pos N vs M"; Python's file writes say what happened."""
    import torch  # here: the module serves processes that import no torch (a site's SuperNode wrapper)

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getbuffer())
