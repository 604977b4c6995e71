"""OpenFL's plan in a file, not in the log: ``Plan.parse`` logs the whole resolved plan at INFO (~130
lines at the top of every aggregator's and collaborator's log). A filter on OpenFL's plan logger
(installed by ``_fedcontrast_fx_guard`` when OpenFL's plan module is imported; OpenFL itself is not
changed) writes that dump to ``logs/plan.PARTY.yaml`` in the party's workspace and puts one line in its
place: the file's path and SHA-256. Imports no OpenFL."""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path

PLAN_LOGGER = "openfl.federated.plan.plan"


def party_label(argv: list[str] | None = None) -> str:
    """``collaborator.NAME``, ``aggregator`` or ``plan``, from this process's ``fx`` arguments."""
    from .guard import fx_option

    args = list(sys.argv if argv is None else argv)[1:]
    for party in ("collaborator", "aggregator"):
        if party in args and args[args.index(party) + 1:args.index(party) + 2] == ["start"]:
            name = fx_option(args, ("-n", "--collaborator_name")) if party == "collaborator" else None
            return f"{party}.{name}" if name else party
    return "plan"


class PlanDumpToFile(logging.Filter):
    """Replaces the plan dump (a multi-line INFO record of OpenFL's plan logger) by one line naming
    the file it was written to and its SHA-256; every other record passes unchanged."""

    def __init__(self, folder: str | Path | None = None, label: str | None = None) -> None:
        super().__init__()
        self.folder, self.label = folder, label

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or not isinstance(record.msg, str) or record.msg.count("\n") < 3:
            return True
        text = record.getMessage()
        if not text.endswith("\n"):
            text += "\n"
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        path = Path(self.folder or Path(os.getcwd()) / "logs") / f"plan.{self.label or party_label()}.yaml"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            where = str(path)
        except OSError as exc:
            where = f"(not written: {exc.strerror or exc})"
        record.msg, record.args = f"the plan in effect: {where} (SHA-256 {digest})", ()
        return True

    @classmethod
    def install(cls) -> None:
        """On OpenFL's plan logger, once."""
        target = logging.getLogger(PLAN_LOGGER)
        if not any(isinstance(f, cls) for f in target.filters):
            target.addFilter(cls())
