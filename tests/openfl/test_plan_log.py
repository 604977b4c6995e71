"""OpenFL's plan dump (~130 lines of every party's log) goes to a file; the log gets one line with
its path and SHA-256 (fedcontrast.openfl.plan_log, installed by _fedcontrast_fx_guard)."""

import hashlib
import logging
import re
from pathlib import Path

from fedcontrast.openfl.plan import create_workspace
from fedcontrast.openfl.plan_log import PLAN_LOGGER, PlanDumpToFile, party_label

from .conftest import free_port, small_config


class Kept(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_the_dump_becomes_one_line_with_the_files_path_and_hash(tmp_path):
    logger = logging.getLogger("test.plan_log")
    logger.addFilter(PlanDumpToFile(tmp_path / "logs", "collaborator.hosp1"))
    kept = Kept()
    logger.addHandler(kept)
    logger.setLevel(logging.INFO)
    dump = "aggregator:\n  settings:\n    rounds_to_train: 2\n  template: x.Y\n"
    logger.info("Parsing Federated Learning Plan : SUCCESS : plan/plan.yaml.")
    logger.info(dump)
    path = tmp_path / "logs" / "plan.collaborator.hosp1.yaml"
    assert path.read_text() == dump
    assert kept.lines == ["Parsing Federated Learning Plan : SUCCESS : plan/plan.yaml.",
                          f"the plan in effect: {path} (SHA-256 {hashlib.sha256(dump.encode()).hexdigest()})"]


def test_the_party_names_the_file():
    assert party_label(["fx", "collaborator", "start", "-n", "hosp2"]) == "collaborator.hosp2"
    assert party_label(["fx", "aggregator", "start"]) == "aggregator"
    assert party_label(["fx", "plan", "initialize"]) == "plan"


def test_openfls_own_parse_logs_no_dump(tmp_path, monkeypatch):
    """Plan.parse as fx calls it, in this process (where the guard wrapped OpenFL's plan module)."""
    from openfl.federated.plan.plan import Plan

    ws = create_workspace(tmp_path / "ws", small_config(), port=free_port(), log=lambda m: None)
    monkeypatch.chdir(ws)
    monkeypatch.setattr("sys.argv", ["fx", "aggregator", "start"])
    kept = Kept()
    plan_logger = logging.getLogger(PLAN_LOGGER)
    monkeypatch.setattr(plan_logger, "level", logging.INFO)  # as under fx (its root logger at INFO)
    plan_logger.addHandler(kept)
    try:
        Plan.parse(plan_config_path=Path("plan/plan.yaml"), cols_config_path=Path("plan/cols.yaml"),
                   data_config_path=Path("plan/data.yaml"))
    finally:
        logging.getLogger(PLAN_LOGGER).removeHandler(kept)
    assert not [line for line in kept.lines if "\n" in line], kept.lines
    found = [re.fullmatch(r"the plan in effect: (\S+) \(SHA-256 ([0-9a-f]{64})\)", line) for line in kept.lines]
    found = [m for m in found if m]
    assert len(found) == 1, kept.lines
    path, digest = Path(found[0].group(1)), found[0].group(2)
    assert path == ws.resolve() / "logs" / "plan.aggregator.yaml" or path.resolve() == (ws / "logs" /
                                                                                       "plan.aggregator.yaml").resolve()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
    assert "template: fedcontrast.openfl.components.SafeAggregator" in path.read_text()
