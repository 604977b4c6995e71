"""One round-number convention: rounds count from 1 in code, records and logs (0 is the initial model);
only the OpenFL glue converts OpenFL's own count, which starts at 0."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fedcontrast.algorithms.fedavg import FedAvg
from fedcontrast.config import RunConfig
from fedcontrast.sim.federation import Federation

SRC = Path(__file__).resolve().parents[1] / "src" / "fedcontrast"


def test_no_code_outside_the_openfl_glue_converts_a_round_number():
    conversion = re.compile(r"\bround(_num|_number)?\s*[+-]\s*1\b")
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.parent.name == "openfl":  # OpenFL counts from 0: its glue converts where it calls in
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if conversion.search(line.split("#")[0]):
                found.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    # the only arithmetic left is the next round and the evaluation at the start of a round (the model
    # after the previous one), each named as such where it happens
    allowed = ("prepare(round_num + 1", "round_num - 1", "self.start_round + 1")
    assert [f for f in found if not any(a in f for a in allowed)] == []


def test_the_plugin_the_records_and_the_seeds_see_the_same_round_numbers(monkeypatch):
    seen = {"site": [], "server": []}
    run_task, aggregate = FedAvg.run_task, FedAvg.aggregate

    def spy_task(self, task, site, received):
        seen["site"].append(site.round_num)
        return run_task(self, task, site, received)

    def spy_aggregate(self, uploads, weights, server):
        seen["server"].append(server.round_num)
        return aggregate(self, uploads, weights, server)

    monkeypatch.setattr(FedAvg, "run_task", spy_task)
    monkeypatch.setattr(FedAvg, "aggregate", spy_aggregate)
    config = RunConfig(algorithm="fedavg", dataset="synthetic", image_size=16, clients=2, rounds=2, min_samples=5,
                       projection_dim=16, training={"local_epochs": 1, "batch_size": 32})
    federation = Federation(config)
    rows = federation.run_round(1) + federation.run_round(2)
    assert seen == {"site": [1, 1, 2, 2], "server": [1, 2]}
    assert sorted({r["round"] for r in rows}) == [1, 2]
    with pytest.raises(ValueError, match="rounds count from 1"):
        federation.run_round(0)
