"""The aggregator's round records (``save/rounds.jsonl``): every site's figures per round, what
they withheld and why, the final model; read back by ``fedcontrast report`` and the lab."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from openfl.callbacks import Callback

from ..algorithms import Downlink, ServerContext, load_weights
from ..algorithms.base import WEIGHT_PREFIX
from ..atomic import atomic_torch_save
from ..config import RunConfig, site_names
from ..construction import build_algorithm, initial_model, load_public, load_splits, server_seed
from ..devices import resolve_device
from ..errors import FedContrastError
from ..evaluation import local_model_accuracy
from ..outputs import write_json
from ..privacy.releases import (  # engine-free: Flower's ServerApp records the same
    describe_withheld,
    evaluation_metric_names,
    metric_kind,
    withheld_metrics,
)
from ..rounds import records as rounds_records  # engine-free: Flower's ServerApp averages the same
from . import aggregation
from .packing import GLOBAL_PACKED, unpack
from .plan import EVALUATE_TASK
from .runner import EVAL_SAMPLES, WEIGHT_METRIC

# one logger for the plan's components, as log lines name it
logger = logging.getLogger("fedcontrast.openfl.components")

ROUNDS_FILE = "rounds.jsonl"
PENDING_FILE = "round_pending.json"  # the next record's training half, kept across an aggregator restart
FINAL_MODEL = "final_model.pt"
FINAL_DOWNLINK = "final_downlink.pt"

def site_metrics(db, round_number: int, sites: list[str], tasks: list[str]) -> dict[str, dict[str, dict[str, float]]]:
    """Every site's reported metrics of ``round_number`` from the aggregator's tensor database, per
    site and task: ``{site: {task: {metric: value}}}`` (OpenFL itself keeps only their average).

    A NaN or infinite value is left out, with a warning naming the site and the metric: JSON has no
    such numbers (``rounds.jsonl`` would no longer parse) and the weighted mean over sites would be NaN."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    rows = db[(db["round"] == round_number) & db["report"]]
    wanted = set(sites)
    for name, tags, array in zip(rows["tensor_name"], rows["tags"], rows["nparray"]):
        owners = set(tags) & wanted
        if len(owners) != 1 or "metric" not in tags:
            continue  # the aggregated (averaged) rows carry no site
        site = owners.pop()
        value = float(np.asarray(array))
        if not np.isfinite(value):
            logger.warning("round %d: site %s reported %s = %s; left out of the round's record", round_number + 1,
                           site, name, value)
            continue
        if name == WEIGHT_METRIC:
            out.setdefault(site, {}).setdefault("", {})["samples"] = value
            continue
        task = next((t for t in tasks if name.startswith(t + "_")), None)
        if task is not None:
            out.setdefault(site, {}).setdefault(task, {})[name[len(task) + 1:]] = value
    return out


def json_safe(value: Any, where: str = "") -> Any:
    """``value`` with every NaN or infinite float replaced by None (``null``), each with a warning:
    strict JSON has no such numbers."""
    if isinstance(value, dict):
        return {k: json_safe(v, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, float) and not np.isfinite(value):
        logger.warning("%s is %s; written as null", where or "a value", value)
        return None
    return value


def weighted_site_mean(sites: dict[str, dict[str, Any]], key: str = "accuracy",
                       samples: str = EVAL_SAMPLES) -> float | None:
    """The mean of the sites' evaluation ``key``, weighted by the size of each site's held-out split
    (``samples``: the name of that size, 1 where a site's record has none; = the figure pooled over
    every site's held-out samples), over a record's ``sites``
    (:func:`fedcontrast.rounds.records.weighted_site_mean`)."""
    mean = rounds_records.weighted_site_mean((v.get("evaluation", {}) for v in sites.values()), key, samples,
                                             default=1.0)
    return None if mean is None else mean[0]


NO_TEST_DATA = "the aggregator holds no test data"  # why a record has no global accuracy (record["no_global_accuracy"])


class RoundReport(Callback):
    """After each round: export the new global model (a torch state_dict), evaluate it on the
    aggregator's own test split when this machine has one, and write one JSON line per finished
    round to ``rounds.jsonl``: round ``k``'s line holds the training metrics of the round that made
    model ``k`` and every site's evaluation of model ``k`` on its own held-out data (measured at the
    start of the next round, or in the final evaluation-only round). Sites may release different
    metrics (their policies): a record lists under ``withheld`` which site kept which metric, and
    says why it has no global accuracy (``no_global_accuracy``) when the aggregator holds no test data."""

    def __init__(self, config: RunConfig, model_shape: dict[str, int], out_dir: str | Path, rounds: int) -> None:
        super().__init__()
        self.config = config
        self.rounds = rounds
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.algorithm = build_algorithm(config)
        self.sites = site_names(config)
        self.tasks = [EVALUATE_TASK, *self.algorithm.tasks]
        device = resolve_device(config.device)
        self.model = initial_model(config, **model_shape).to(device)
        self.global_specs = [s for s in self.algorithm.download_specs(self.model, model_shape["num_classes"])
                             if not s.per_site]
        self.server = ServerContext(model=self.model, round_num=0, seed=server_seed(config, 0), device=device,
                                    num_classes=model_shape["num_classes"])
        self.test = None
        self.no_test: str | None = None  # why the records have no global accuracy (written into each)
        if config.data_schema is None or config.data_root is not None:
            try:  # the embedded demo, or an operator who holds data of its own
                self.test = load_splits(config).test
                self.server.public = load_public(config)  # labelled: linear probes train on it here
            except FedContrastError as exc:
                logger.warning("no test data on the aggregator (%s): rounds are evaluated at the sites only", exc)
                self.test = None
                self.no_test = f"the aggregator could not load its test data ({exc})"
        else:
            logger.info("the aggregator holds no data: every round is evaluated at the sites, on their own data")
            self.no_test = NO_TEST_DATA
        # {round: {task: {site: names of the metrics it sent}}}, filled by the aggregator as results come in
        # (and as a restart replays them): who withheld what (sites may release different metrics)
        self.sent: dict[int, dict[str, dict[str, list[str]]]] = {}
        pending_path = self.out_dir / PENDING_FILE
        self.pending: dict[str, Any] = json.loads(pending_path.read_text()) if pending_path.exists() else {}
        self.reopened: int | None = None  # the round of an incomplete record that its whole record replaces
        self.resume(read_records(self.out_dir))
        self.absent: list[str] = []  # set by the aggregator: sites left out of the round just ended
        self.exported: int | None = None  # the last round whose results export_round wrote

    def resume(self, records: list[dict[str, Any]]) -> None:
        """Go on from the records already written: the last round's is done, unless the federation
        stopped before every site's evaluation of its model arrived (``incomplete``, written by a stopping
        aggregator so that a stopped federation still shows it). That round is reopened: a resumed
        federation redoes it (OpenFL replays the round, the sites evaluate the model again) and its
        whole record replaces the incomplete one (:meth:`write_record`)."""
        self.written = max((r["round"] for r in records), default=0)
        last = records[-1] if records else None
        if last is None or not last.get("incomplete") or last["round"] != self.written:
            return
        self.written, self.reopened = last["round"] - 1, last["round"]
        if self.pending.get("round") != last["round"]:  # no pending file of that round: its training half
            self.pending = training_half(last)
        logger.info("round %d's record is incomplete (the federation stopped before %s evaluated its model): the "
                    "resumed round writes it whole", last["round"], ", ".join(last.get("not_evaluated", [])) or "every "
                                                                                                                "site")

    def note_sent(self, round_num: int, site: str, task: str, names: list[str]) -> None:
        """``site`` sent its results of ``task`` in OpenFL round ``round_num``, with these metrics."""
        for old in [r for r in self.sent if r < round_num - 1]:
            del self.sent[old]
        self.sent.setdefault(round_num, {}).setdefault(task, {})[site] = sorted(names)

    def withheld(self, round_num: int, tasks: Sequence[str]) -> dict[str, list[str]]:
        """``{site: metric names}`` that sites withheld from ``tasks`` of OpenFL round ``round_num``
        (:func:`withheld_metrics`)."""
        sent = getattr(self, "sent", {}).get(round_num, {})
        algorithm, config = getattr(self, "algorithm", None), getattr(self, "config", None)
        declared = {} if algorithm is None or config is None else {
            EVALUATE_TASK: tuple(f"{EVALUATE_TASK}_{m}" for m in evaluation_metric_names(algorithm, config)),
            **{t: tuple(f"{t}_{m}" for m in algorithm.task_metrics.get(t, ())) for t in algorithm.tasks}}
        return withheld_metrics({t: sent[t] for t in tasks if t in sent}, declared)

    def on_round_end(self, round_num: int, logs: dict | None = None) -> None:
        self.export_round(round_num)  # normally done already, before OpenFL committed the round

    def export_round(self, round_num: int) -> None:
        """Write what round ``round_num`` made (the record of the model that went into it, the new
        model, the pending record). The aggregator calls it *before* OpenFL commits the round to its
        checkpoint database: a write that fails (a full disk) leaves the round uncommitted, and a
        restarted aggregator redoes its end from the saved uploads instead of skipping these files."""
        if round_num == self.exported:
            return
        if round_num >= 1:
            self.write_record(round_num, round_ended=True)  # the sites' evaluations of model `round_num`, if not
            # written yet (a site that sent none did not answer in time)
        self._export_model(round_num)
        self.exported = round_num

    def _export_model(self, fl_round: int) -> None:
        """The record and model of OpenFL's round ``fl_round`` (counted from 0): round ``fl_round + 1``."""
        round_num = fl_round + 1
        # OpenFL keys the new model by the next round
        tensors = self.tensor_db.get_tensors_by_round_and_tags(fl_round + 1, ("model",))
        packed = next((v for k, v in tensors.items() if k.tensor_name == GLOBAL_PACKED), None)
        if packed is None:  # the final, evaluation-only round makes no model
            return
        weights = unpack(packed, self.global_specs)
        atomic_torch_save(weights, self.out_dir / FINAL_DOWNLINK)  # everything the sites receive (e.g. prototypes)
        if any(name.startswith(WEIGHT_PREFIX) for name in weights):
            load_weights(self.model, weights)
            atomic_torch_save(self.model.state_dict(), self.out_dir / FINAL_MODEL)
        record: dict[str, Any] = {"round": round_num, "rounds": self.rounds, "trained_at": time.time()}
        if self.absent:
            record["absent"] = list(self.absent)
        link = aggregation.LINK
        if link.excluded:  # uploads the aggregator did not take, with the reason
            record["rejected"] = dict(sorted(link.excluded.items()))
            link.excluded.clear()
        if self.test is not None:
            record.update(self.algorithm.evaluate(Downlink(weights), self.server, self.test))
            if link.local_models:  # the sites' local models (the aggregator does not know their label
                # distributions, so only the balanced accuracy; the simulator also reports the weighted one)
                record.update(local_model_accuracy(self.model, link.local_models, self.test, self.server.device))
                load_weights(self.model, weights)
        link.local_models.clear()
        training = site_metrics(self.tensor_db.tensor_db, fl_round, self.sites, self.tasks)
        record["sites"] = {site: {"samples": m.get("", {}).get("samples"),
                                  "training": {f"{t}_{k}": v for t in self.algorithm.tasks
                                               for k, v in m.get(t, {}).items()}}
                           for site, m in sorted(training.items())}
        withheld = self.withheld(fl_round, self.algorithm.tasks)
        if withheld:  # sites may release different metrics (their policies): who kept which
            record["withheld"] = withheld
        if self.no_test is not None:
            record["no_global_accuracy"] = self.no_test
        self.pending = record = json_safe(record, f"round {round_num}")
        write_json(self.out_dir / PENDING_FILE, record)  # atomic: a kill leaves the previous one
        notes = [f"global test accuracy {record['accuracy']:.4f}" if record.get("accuracy") is not None else
                 f"no global test accuracy: {self.no_test}" if self.no_test is not None else "",
                 describe_withheld(withheld)]
        logger.info("round %d/%d aggregated%s", round_num, self.rounds, "".join(f"; {n}" for n in notes if n))

    def evaluations_complete(self, round_num: int, sites: list[str]) -> bool:
        """Every one of ``sites`` has sent its evaluation of round ``round_num`` (its metrics, or none
        when its policy withholds them)."""
        sent = self.sent.get(round_num, {}).get(EVALUATE_TASK, {})
        return all(s in sent for s in sites)

    def write_record(self, round_num: int, round_ended: bool = False) -> None:
        """Round ``round_num``'s line: the pending training half plus every site's evaluation of the
        model it made, as reported in OpenFL round ``round_num``. Written once, with every site in it: a
        site that sent no evaluation is named under ``not_evaluated`` (at the end of OpenFL round
        ``round_num``, ``round_ended``: it did not answer in time). Written before that round ended (the
        federation stopped), such a record is ``incomplete``: a resumed federation redoes the round and
        replaces it with the whole record (:meth:`resume`)."""
        if round_num <= self.written:
            return
        record: dict[str, Any] = (dict(self.pending) if self.pending.get("round") == round_num
                                  else {"round": round_num, "rounds": self.rounds})
        sites = {site: dict(values) for site, values in record.get("sites", {}).items()}
        evaluations = site_metrics(self.tensor_db.tensor_db, round_num, self.sites, [EVALUATE_TASK])
        for site, m in sorted(evaluations.items()):
            if EVALUATE_TASK in m:
                sites.setdefault(site, {})["evaluation"] = m[EVALUATE_TASK]
        record["sites"] = dict(sorted(sites.items()))
        sent = getattr(self, "sent", {}).get(round_num, {}).get(EVALUATE_TASK, {})  # released or withheld
        missing = [s for s in self.sites if s not in sent and "evaluation" not in sites.get(s, {})]
        if missing:
            record["not_evaluated"] = missing
            if not round_ended:
                record["incomplete"] = ("the federation stopped before every site's evaluation of this model arrived; "
                                        "a resumed federation replaces this record with the whole one")
        withheld = {site: list(names) for site, names in record.get("withheld", {}).items()}  # the training half's
        for site, names in self.withheld(round_num, [EVALUATE_TASK]).items():
            withheld[site] = sorted(set(withheld.get(site, [])) | set(names))
        if withheld:
            record["withheld"] = dict(sorted(withheld.items()))
        if getattr(self, "no_test", None) is not None:
            record.setdefault("no_global_accuracy", self.no_test)
        mean = weighted_site_mean(record["sites"])  # over the sites that released their accuracy
        if mean is not None:
            record["site_accuracy"] = mean
        validation = weighted_site_mean(record["sites"], "val_accuracy", "val_samples")  # their validation parts
        if validation is not None:
            record["site_val_accuracy"] = validation
        record["time"] = time.time()
        record = json_safe(record, f"round {round_num}")
        from ..jsonl import append_jsonl, rewrite_jsonl

        if getattr(self, "reopened", None) == round_num:  # the incomplete record of this round, replaced
            others = [r for r in read_records(self.out_dir) if not (r["round"] == round_num and r.get("incomplete"))]
            rewrite_jsonl(self.out_dir / ROUNDS_FILE, [*others, record])  # atomic: the old file or the new one
            self.reopened = None
        else:
            append_jsonl(self.out_dir / ROUNDS_FILE, record)  # whole, on disk; a line an earlier crash cut is dropped
        self.written = round_num
        if "incomplete" in record:
            logger.warning("round %d/%d: the federation stopped before %s evaluated its model: its record is "
                           "incomplete until a resumed federation redoes the round", round_num, self.rounds,
                           ", ".join(missing))
        shown = ", ".join(f"{s} {v['evaluation']['accuracy']:.4f}" for s, v in record["sites"].items()
                          if "accuracy" in v.get("evaluation", {}))
        kept = describe_withheld({s: [m for m in n if metric_kind(m) == "evaluation"] for s, n in withheld.items()})
        logger.info("round %d/%d: accuracy at the sites on their own held-out data: %s%s%s", round_num, self.rounds,
                    shown or "n/a", f" (weighted mean over {shown.count(',') + 1} sites {mean:.4f})"
                    if mean is not None and shown.count(",") else "",  # one site's number is no mean
                    f"; {kept}" if kept else "")


def training_half(record: dict[str, Any]) -> dict[str, Any]:
    """What the aggregator knew of a round before the sites evaluated its model (the pending record):
    ``record`` without the sites' evaluations and what was derived from them."""
    half = {k: v for k, v in record.items()
            if k not in ("site_accuracy", "site_val_accuracy", "time", "incomplete", "not_evaluated", "withheld")}
    sites = {s: {k: v for k, v in values.items() if k != "evaluation"} for s, values in record.get("sites", {}).items()}
    half["sites"] = {s: values for s, values in sites.items() if values}
    withheld = {s: [n for n in names if metric_kind(n) != "evaluation"]
                for s, names in record.get("withheld", {}).items()}
    if any(withheld.values()):
        half["withheld"] = {s: names for s, names in withheld.items() if names}
    return half


def read_records(directory: str | Path) -> list[dict[str, Any]]:
    """The per-round records of ``rounds.jsonl`` in ``directory`` (empty when there are none yet)."""
    from ..jsonl import read_jsonl

    return read_jsonl(Path(directory) / ROUNDS_FILE, "the aggregator's round records")
