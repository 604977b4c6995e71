"""Timestamps of a Flower round's steps, for diagnosing where its time goes: with
``FEDCONTRAST_TRACE=FILE`` in the environment of the SuperLink and the sites, every party appends
``{"t": …, "who": …, "event": …}`` lines to ``FILE`` (one host: one file); without it nothing is done."""

from __future__ import annotations

import json
import os
import time

_PATH = os.environ.get("FEDCONTRAST_TRACE")


def trace(who: str, event: str, **facts) -> None:
    if _PATH:
        with open(_PATH, "a", encoding="utf-8") as f:
            f.write(json.dumps({"t": time.time(), "who": who, "event": event, **facts}) + "\n")
