"""What the ServerApp keeps of each round, beside its messages (:mod:`.server_app`): the rows of
``metrics.csv`` (each site's held-out evaluation of what it received and the sites' weighted mean,
the payloads' bytes), which metrics each site withheld, and the secure round: the downlink from the
sites' secure sum (flower/secure.py) and its record in ``rounds.jsonl``.

:class:`RoundRecords` is a part of :class:`.server_app.FlowerServer`, which sets every attribute it
reads.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from ..outputs import GLOBAL_SITE, metric_row
from ..privacy.releases import evaluation_metric_names, withheld_metrics

if TYPE_CHECKING:
    from pathlib import Path

    from ..algorithms import Algorithm, Downlink
    from ..config import RunConfig
    from ..privacy.secagg_relay import SecAggRelay
    from ..rounds import AggregatorRound
    from .attendance import Attendance

ROUNDS_FILE = "rounds.jsonl"  # one record per round: each site's weight, released metrics, exclusions
SECURE_SAMPLES = ("under secure aggregation a site's samples field is None: its count is inside the secure sum, "
                  "which the operator sees only summed")


def nbytes(tensors: dict[str, Any]) -> int:
    """The payload of a message's tensors, in bytes (as the simulator counts what a site receives and sends)."""
    return int(sum(v.numel() * v.element_size() for v in tensors.values()))


def _count(weight: float) -> int | None:
    """A site's released count as a number of samples (None where it is not a finite number)."""
    return int(round(weight)) if weight == weight and abs(weight) != float("inf") else None


class RoundRecords:
    """The ServerApp's records of its rounds (set by :class:`.server_app.FlowerServer`)."""

    config: RunConfig
    sites: list[str]
    out: Path
    run_label: str
    algorithm: Algorithm
    core: AggregatorRound
    downlink: Downlink
    relay: SecAggRelay | None
    site_keys: dict[str, str]
    attendance: Attendance
    back: list[str]
    absent: dict[str, str]
    rows: list[dict[str, Any]]
    withheld: dict[int, dict[str, list[str]]]

    def _secure_round(self, round_num: int, replies: dict[str, Any], evaluations: dict, previous: dict) -> None:
        """The downlink from the sites' secure sum (flower/secure.py): the ServerApp sees no upload alone."""
        from ..jsonl import append_jsonl
        from .secure import secure_round

        adverts = {s: bytes(r.content["secagg"]["payload"]) for s, r in replies.items()}
        total = secure_round(self, round_num, adverts, self.site_keys)
        relay = self.relay
        assert relay is not None  # a secure round: the run has a relay
        gone = {s: f"round {round_num}: {why}" for s, why in self.absent.items()}
        result = self.core.aggregate_secure(round_num, total, previous,
                                            rejected={**gone, **relay.withdrawn, **relay.blamed},
                                            survivors=len(relay.survivors))
        self.downlink = result.downlink
        append_jsonl(self.out / ROUNDS_FILE, {
            "round": round_num, "run": self.run_label, "time": time.time(), "secure_sum_of": relay.survivors,
            "secure_bytes": dict(relay.bytes_from),
            "sites": {s: {"training": json.loads(str(replies[s].content["outcome"]["metrics"])),
                          "evaluation_of_received": evaluations[s]} for s in replies},
            "samples": SECURE_SAMPLES,  # why no site's count is in this record, nor in metrics.csv
            "excluded": result.excluded, **self.attendance.record(self.back), **self._withheld_record(round_num)})

    def withheld_by(self, released: dict[str, dict[str, dict[str, float]]],
                    evaluations: dict[str, dict[str, float]]) -> dict[str, list[str]]:
        """Which site withheld which metrics in its reply (its policy; under DP the default): ``{site:
        names}``, named as on OpenFL (``train_loss``, ``evaluate_accuracy``; privacy/releases.py)."""
        sent: dict[str, dict[str, list[str]]] = {"evaluate": {s: [f"evaluate_{k}" for k in m]
                                                              for s, m in evaluations.items()}}
        for site, tasks in released.items():
            for task in self.algorithm.tasks:
                sent.setdefault(task, {})[site] = [f"{task}_{k}" for k in tasks.get(task, {})]
        plugin = self.algorithm
        declared = {"evaluate": tuple(f"evaluate_{m}" for m in evaluation_metric_names(plugin, self.config)),
                    **{t: tuple(f"{t}_{m}" for m in plugin.task_metrics.get(t, ())) for t in plugin.tasks}}
        return withheld_metrics(sent, declared)

    def _withheld_record(self, round_num: int) -> dict[str, Any]:
        withheld = self.withheld.get(round_num) or {}
        return {"withheld": withheld} if withheld else {}

    def evaluation_rows(self, round_num: int, evaluations: dict[str, dict[str, float]]) -> None:
        """Each site's held-out score of what it received at the start of ``round_num`` (the model
        after round ``round_num - 1``), and their weighted mean, as rows of round ``round_num - 1``
        (whose model they score; none for the initial model)."""
        after = round_num - 1
        if after == 0:
            return
        total, weighted, val_total, val_weighted = 0.0, 0.0, 0.0, 0.0
        for site in self.sites:
            measured = evaluations.get(site) or {}
            if not measured:
                continue  # withheld by the plan's DP or the site's policy
            samples = float(measured.get("samples", 0.0))
            self.rows.append(metric_row(after, site, "evaluate", int(samples),
                                        {k: v for k, v in measured.items() if k != "samples"}))
            if "accuracy" in measured and samples > 0:
                total += samples
                weighted += samples * float(measured["accuracy"])
            val_samples = float(measured.get("val_samples", 0.0))  # the part of its training data it holds out
            if "val_accuracy" in measured and val_samples > 0:
                val_total += val_samples
                val_weighted += val_samples * float(measured["val_accuracy"])
        if total > 0:
            validation = {"val_accuracy": val_weighted / val_total} if val_total > 0 else {}
            self.rows.append(metric_row(after, GLOBAL_SITE, "evaluate", int(total),
                                        {"accuracy": weighted / total, **validation, **self.downlink.metrics}))
