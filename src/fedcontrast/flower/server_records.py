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
from ..rounds.records import weighted_site_mean
from ..rounds.transport import Replies, SecureSum
from .console import say

if TYPE_CHECKING:
    from pathlib import Path

    from ..algorithms import Algorithm, Downlink
    from ..config import RunConfig
    from ..privacy.secagg_relay import SecAggRelay
    from ..rounds import AggregatorRound, RoundOutcome
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
    round_evaluations: dict[str, dict[str, float]]  # the current round's, as the sites sent them
    first_rows: dict[str, dict[str, Any]]  # each site's first row of the current round (its bytes)

    def secure_sum(self, round_num: int, replies: Replies, uploads: dict[str, Any]) -> SecureSum:
        """The sum of the answering sites' terms, by the protocol's messages (flower/secure.py): the
        ServerApp sees no upload alone. Sites silent or dropped this round, withdrawn or blamed are
        left out, each with its reason."""
        from .secure import secure_round

        adverts = {s: bytes(r.content["secagg"]["payload"]) for s, r in replies.messages.items()}
        total = secure_round(self, round_num, adverts, self.site_keys)
        relay = self.relay
        assert relay is not None  # a secure round: the run has a relay
        gone = {s: f"round {round_num}: {why}" for s, why in self.absent.items()}
        return SecureSum(total, len(relay.survivors), {**gone, **relay.withdrawn, **relay.blamed})

    def record(self, round_num: int, replies: Replies, outcome: RoundOutcome) -> None:
        """The round's record in ``rounds.jsonl`` (whole on disk, as the OpenFL engine's): each site's
        released training metrics and evaluation of what it received (its weight, but under secure
        aggregation), who was left out and why, who was dropped or is back, what was withheld."""
        from ..jsonl import append_jsonl

        evaluations = self.round_evaluations
        training = {s: json.loads(str(r.content["outcome"]["metrics"])) for s, r in replies.messages.items()}
        if self.relay is not None:
            relay = self.relay
            for site, row in self.first_rows.items():  # what each site sent for the secure sum
                row["bytes_uploaded"] = int(relay.bytes_from.get(site, 0))
            head = {"secure_sum_of": relay.survivors, "secure_bytes": dict(relay.bytes_from)}
            sites = {s: {"training": training[s], "evaluation_of_received": evaluations[s]} for s in training}
            tail = {"samples": SECURE_SAMPLES}  # why no site's count is in this record, nor in metrics.csv
        else:
            if outcome.note:
                say(f"round {round_num} aggregated without rejected upload(s): {outcome.note}")
            self.rows.extend(metric_row(round_num, s, "rejected", 0, {}) for s in outcome.excluded)
            absent = {s: f"round {round_num}: {why}" for s, why in self.absent.items()}  # silent: not rejected
            outcome.excluded = dict(sorted({**outcome.excluded, **absent}.items()))
            head, tail = {}, {}
            sites = {s: {"weight": replies.weights[s], "training": training[s],
                         "evaluation_of_received": evaluations[s]} for s in training}
        append_jsonl(self.out / ROUNDS_FILE, {
            "round": round_num, "run": self.run_label, "time": time.time(), **head, "sites": sites, **tail,
            "excluded": outcome.excluded, **self.attendance.record(self.back), **self._withheld_record(round_num)})

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
        released: list[dict[str, float]] = []  # the sites' evaluations, in the federation's order
        for site in self.sites:
            measured = evaluations.get(site) or {}
            if not measured:
                continue  # withheld by the plan's DP or the site's policy
            samples = float(measured.get("samples", 0.0))
            self.rows.append(metric_row(after, site, "evaluate", int(samples),
                                        {k: v for k, v in measured.items() if k != "samples"}))
            released.append(measured)
        mean = weighted_site_mean(released)
        if mean is not None:
            accuracy, total = mean
            validation = weighted_site_mean(released, "val_accuracy", "val_samples")  # their training data held out
            held_out = {"val_accuracy": validation[0]} if validation is not None else {}
            self.rows.append(metric_row(after, GLOBAL_SITE, "evaluate", int(total),
                                        {"accuracy": accuracy, **held_out, **self.downlink.metrics}))
