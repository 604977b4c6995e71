"""Aggregator, collaborator and task assigner classes for the plan (``aggregator.template`` etc.).

OpenFL 1.9 hangs when an aggregation function raises or a collaborator never answers, retries an
unreachable aggregator forever and saves ``last.pbuf`` from the model that went *into* the last
round. These subclasses change only that: a failed round, a round that outlives the plan's
``round_timeout`` (unless ``min_sites`` lets it go on without the silent sites) or a site that
reports a failed task ends the federation (aggregator exit code 3, every live collaborator told to
stop with a reason); a collaborator that cannot reach the aggregator keeps trying, with back-off,
for the plan's ``wait_for_aggregator`` (an aggregator's restart fits in it), and a failing
collaborator exits with one sentence. Every round the sites evaluate what they received on their
own held-out data (the engine's ``evaluate`` task, plus one evaluation-only round at the end), and
the aggregator writes one record per round with every site's figures (``save/rounds.jsonl``).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import sys
import threading
import time
import traceback
from contextlib import closing
from pathlib import Path
from typing import Any, Callable

import grpc
import numpy as np
import torch
from openfl.callbacks import Callback
from openfl.component.aggregator.aggregator import Aggregator
from openfl.component.assigner import Assigner
from openfl.component.collaborator.collaborator import Collaborator
from openfl.transport.grpc import aggregator_server as grpc_server
from openfl.transport.grpc import common as grpc_common
from openfl.utilities import TaskResultKey, TensorKey, change_tags

from ..algorithms import Downlink, ServerContext, load_weights
from ..algorithms.base import WEIGHT_PREFIX
from ..atomic import atomic_torch_save
from ..config import RunConfig, site_names
from ..construction import (attach_public, build_algorithm, initial_model, load_public, load_splits, resolve_device,
                            server_seed)
from ..errors import ConfigError, FedContrastError
from ..evaluation import local_model_accuracy
from ..sim.outputs import write_json
from . import aggregation
from .packing import GLOBAL_PACKED, PERSONAL_PACKED, pack, packed_size, unpack
from .pki import (EnrolledCertificates, check_aggregator_certificate, check_certificate_dates, check_certificate_name,
                  check_enrolled_certificates, check_own_certificate, check_server_files)
from .tls_log import HandshakeLog, StderrTap, enable_handshake_trace
from .plan import (DEFAULT_RECONNECT_INTERVAL_MAX, DEFAULT_ROUND_TIMEOUT, DEFAULT_WAIT_FOR_AGGREGATOR, EVALUATE_TASK,
                   check_wait_settings, fx_plan_path, load_plan_file)
from .runner import EVAL_SAMPLES, PERSONAL_TAG, WEIGHT_METRIC
from .sitecheck import CollaboratorStopped  # defined without OpenFL: the site's pre-flight raises it too

logger = logging.getLogger(__name__)

FAILURE_SLEEP_CODE = 97  # sent in GetTasksResponse.sleep_time with quit: "the federation failed"
FAILURE_EXIT_CODE = 3
STOPPED = "the aggregator stopped the federation: "  # the details of the ABORTED status every site is answered with
STOP_GRACE_S = 3.0  # after the last site was told why the federation stopped, the reason is still served this long
WAITING_NOTICE_S = 60.0  # how often the aggregator names the sites that have not connected yet
FAILURE_METRIC = "fedcontrast_task_failed"  # a collaborator's last word: its task failed (reason: its own log)
ROUNDS_FILE = "rounds.jsonl"
PENDING_FILE = "round_pending.json"  # the next record's training half, kept across an aggregator restart
FINAL_MODEL = "final_model.pt"
FINAL_DOWNLINK = "final_downlink.pt"

UPLOAD_MARGIN = 1 << 20  # bytes allowed around the declared packed upload: header, names, metrics
# gRPC refuses a message over its max_receive_message_length before Python sees it: the sender would
# learn why, the aggregator nothing (the round would wait out its timeout). Its limit is set one of
# OpenFL's upload messages (2 MiB chunks, utils.proto_to_datastream) above the bound, so that every
# message of an over-bound upload reaches _bounded_stream, which names the sender and the size.
MESSAGE_ALLOWANCE = (2 << 20) + (64 << 10)
# OpenFL calls Aggregator._get_sleep_time() through the class name, so a subclass override would be
# ignored; it tells an idle collaborator to sleep 10 s. One second keeps rounds moving (an int is
# required: it travels in an int32 protobuf field).
Aggregator._get_sleep_time = staticmethod(lambda: 1)


class RoundAssigner(Assigner):
    """Every collaborator, every round: ``evaluate`` (what it received, on its own held-out data),
    then the plugin's tasks; after the last training round, one more round of ``evaluate`` alone, so
    that the final model is measured at every site too. ``rounds_to_train`` counts training rounds."""

    def __init__(self, train_tasks: list[str], **kwargs: Any) -> None:
        self.train_tasks = list(train_tasks)
        super().__init__(**kwargs)

    def define_task_assignments(self) -> None:
        self.all_tasks_in_groups = [EVALUATE_TASK, *self.train_tasks]

    def tasks_of_round(self, round_number: int) -> list[str]:
        return [EVALUATE_TASK, *self.train_tasks] if round_number < self.rounds else [EVALUATE_TASK]

    def get_tasks_for_collaborator(self, collaborator_name: str, round_number: int) -> list[str]:
        return self.tasks_of_round(round_number)

    def get_collaborators_for_task(self, task_name: str, round_number: int) -> list[str]:
        return list(self.authorized_cols) if task_name in self.tasks_of_round(round_number) else []

    def get_all_tasks_for_round(self, round_number: int) -> list[str]:
        return self.tasks_of_round(round_number)


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
            logger.warning("round %d: site %s reported %s = %s; left out of the round's record", round_number, site,
                           name, value)
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


def weighted_site_mean(sites: dict[str, dict[str, Any]], key: str = "accuracy") -> float | None:
    """The mean of the sites' evaluation ``key``, weighted by the size of each site's held-out split
    (= the figure pooled over every site's held-out samples)."""
    pairs = [(v["evaluation"][key], v["evaluation"].get(EVAL_SAMPLES, 1.0)) for v in sites.values()
             if key in v.get("evaluation", {})]
    total = sum(n for _, n in pairs)
    return sum(a * n for a, n in pairs) / total if total else None


NO_TEST_DATA = "the aggregator holds no test data"  # why a record has no global accuracy (record["no_global_accuracy"])


def withheld_metrics(sent: dict[str, dict[str, list[str]]],
                     declared: dict[str, tuple[str, ...]]) -> dict[str, list[str]]:
    """Which site withheld which metric, from what each site sent with its results (``{task: {site:
    metric names}}``) and the metrics each task declares (``declared``, OpenFL names such as
    ``evaluate_accuracy``): a site that sent a task's results withheld every metric of that task that
    another site sent, and, when it sent none of the task's declared metrics, those too (its policy
    keeps them, the default under DP). ``{site: sorted names}``; a site that withheld nothing is absent."""
    out: dict[str, set[str]] = {}
    for task, by_site in sent.items():
        anyone = set().union(*map(set, by_site.values())) if by_site else set()
        names = set(declared.get(task, ()))
        for site, own in by_site.items():
            own = set(own)
            expected = anyone | (names if not own & names else set())
            missing = expected - own - {WEIGHT_METRIC}
            if missing:
                out.setdefault(site, set()).update(missing)
    return {site: sorted(names) for site, names in sorted(out.items())}


def metric_kind(name: str) -> str:
    """What a site's metric is about, for a sentence: ``evaluation`` (``evaluate_*``), ``ε``
    (``*_dp_epsilon*``) or ``training``."""
    if name.startswith(EVALUATE_TASK + "_"):
        return "evaluation"
    return "ε" if "dp_epsilon" in name else "training"


def describe_withheld(withheld: dict[str, list[str]]) -> str:
    """One clause per group of sites that withheld the same kinds of metrics, e.g. ``site_1
    withheld its evaluation and training metrics``; empty when no site withheld any."""
    groups: dict[tuple[str, ...], list[str]] = {}
    order = ("evaluation", "training", "ε")
    for site, names in sorted(withheld.items()):
        kinds = tuple(k for k in order if any(metric_kind(n) == k for n in names))
        if kinds:
            groups.setdefault(kinds, []).append(site)
    clauses = []
    for kinds, sites in groups.items():
        what = " and ".join(kinds) if len(kinds) < 3 else f"{kinds[0]}, {kinds[1]} and {kinds[2]}"
        clauses.append(f"{', '.join(sites)} withheld {'its' if len(sites) == 1 else 'their'} {what} metrics")
    return "; ".join(clauses)


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
                    "resumed round writes it whole", last["round"], ", ".join(last.get("not_evaluated", [])) or "every site")

    def note_sent(self, round_num: int, site: str, task: str, names: list[str]) -> None:
        """``site`` sent its results of ``task`` in OpenFL round ``round_num``, with these metrics."""
        for old in [r for r in self.sent if r < round_num - 1]:
            del self.sent[old]
        self.sent.setdefault(round_num, {}).setdefault(task, {})[site] = sorted(names)

    def withheld(self, round_num: int, tasks: list[str]) -> dict[str, list[str]]:
        """``{site: metric names}`` that sites withheld from ``tasks`` of OpenFL round ``round_num``
        (:func:`withheld_metrics`)."""
        sent = getattr(self, "sent", {}).get(round_num, {})
        algorithm = getattr(self, "algorithm", None)
        declared = {} if algorithm is None else {
            EVALUATE_TASK: tuple(f"{EVALUATE_TASK}_{m}" for m in (*algorithm.evaluation_metrics, EVAL_SAMPLES)),
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

    def _export_model(self, round_num: int) -> None:
        tensors = self.tensor_db.get_tensors_by_round_and_tags(round_num + 1, ("model",))
        packed = next((v for k, v in tensors.items() if k.tensor_name == GLOBAL_PACKED), None)
        if packed is None:  # the final, evaluation-only round makes no model
            return
        weights = unpack(packed, self.global_specs)
        atomic_torch_save(weights, self.out_dir / FINAL_DOWNLINK)  # everything the sites receive (e.g. prototypes)
        if any(name.startswith(WEIGHT_PREFIX) for name in weights):
            load_weights(self.model, weights)
            atomic_torch_save(self.model.state_dict(), self.out_dir / FINAL_MODEL)
        record: dict[str, Any] = {"round": round_num + 1, "rounds": self.rounds, "trained_at": time.time()}
        if self.absent:
            record["absent"] = list(self.absent)
        if aggregation.EXCLUDED:  # uploads the aggregator did not take, with the reason
            record["rejected"] = dict(sorted(aggregation.EXCLUDED.items()))
            aggregation.EXCLUDED.clear()
        if self.test is not None:
            record.update(self.algorithm.evaluate(Downlink(weights), self.server, self.test))
            if aggregation.LOCAL_MODELS:  # the sites' local models (the aggregator does not know their label
                # distributions, so only the balanced accuracy; the simulator also reports the weighted one)
                record.update(local_model_accuracy(self.model, aggregation.LOCAL_MODELS, self.test, self.server.device))
                load_weights(self.model, weights)
        aggregation.LOCAL_MODELS.clear()
        training = site_metrics(self.tensor_db.tensor_db, round_num, self.sites, self.tasks)
        record["sites"] = {site: {"samples": m.get("", {}).get("samples"),
                                  "training": {f"{t}_{k}": v for t in self.algorithm.tasks for k, v in m.get(t, {}).items()}}
                           for site, m in sorted(training.items())}
        withheld = self.withheld(round_num, self.algorithm.tasks)
        if withheld:  # sites may release different metrics (their policies): who kept which
            record["withheld"] = withheld
        if self.no_test is not None:
            record["no_global_accuracy"] = self.no_test
        self.pending = record = json_safe(record, f"round {round_num + 1}")
        write_json(self.out_dir / PENDING_FILE, record)  # atomic: a kill leaves the previous one
        notes = [f"global test accuracy {record['accuracy']:.4f}" if record.get("accuracy") is not None else
                 f"no global test accuracy: {self.no_test}" if self.no_test is not None else "",
                 describe_withheld(withheld)]
        logger.info("round %d/%d aggregated%s", round_num + 1, self.rounds, "".join(f"; {n}" for n in notes if n))

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
        record = dict(self.pending) if self.pending.get("round") == round_num else {"round": round_num,
                                                                                    "rounds": self.rounds}
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
                    shown or "n/a", f" (weighted mean {mean:.4f})" if mean is not None else "",
                    f"; {kept}" if kept else "")


def training_half(record: dict[str, Any]) -> dict[str, Any]:
    """What the aggregator knew of a round before the sites evaluated its model (the pending record):
    ``record`` without the sites' evaluations and what was derived from them."""
    half = {k: v for k, v in record.items()
            if k not in ("site_accuracy", "time", "incomplete", "not_evaluated", "withheld")}
    sites = {s: {k: v for k, v in values.items() if k != "evaluation"} for s, values in record.get("sites", {}).items()}
    half["sites"] = {s: values for s, values in sites.items() if values}
    withheld = {s: [n for n in names if metric_kind(n) != "evaluation"] for s, names in record.get("withheld", {}).items()}
    if any(withheld.values()):
        half["withheld"] = {s: names for s, names in withheld.items() if names}
    return half


def read_records(directory: str | Path) -> list[dict[str, Any]]:
    """The per-round records of ``rounds.jsonl`` in ``directory`` (empty when there are none yet)."""
    from ..jsonl import read_jsonl

    return read_jsonl(Path(directory) / ROUNDS_FILE, "the aggregator's round records")


class FederationStopped(Exception):
    """Raised to the aggregator's gRPC server by a call that came after the federation stopped; its
    message is the one sentence the caller is answered with (an ABORTED status)."""


class SafeAggregator(Aggregator):
    """The stock aggregator, plus: a failed round, a round past ``round_timeout`` seconds (unless
    ``min_sites`` sites answered: then it is aggregated without the others, who are named) or a
    site's failed task stops the federation cleanly with exit code 3; the sites' evaluations are
    recorded per site; one evaluation-only round follows the ``rounds_to_train`` training rounds."""

    def __init__(self, run_config: dict[str, Any] | None = None, model_shape: dict[str, int] | None = None,
                 report_dir: str = "save", round_timeout: float | None = DEFAULT_ROUND_TIMEOUT,
                 min_sites: int | None = None, rounds_to_train: int = 1, **kwargs: Any) -> None:
        self.failure: str | None = None  # set before super(): recovery may replay a round end
        self.absent: set[str] = set()  # sites that did not answer in the last round that ended
        try:
            config = RunConfig.from_dict(run_config or {})
            cert_dir = check_aggregator_plan(config, {"run_config": run_config, "model_shape": model_shape,
                                                      "rounds_to_train": rounds_to_train})
            _check_collaborators(config, kwargs.get("authorized_cols") or [], min_sites)
            # Each connection must present the very certificate signed here for its name, never a revoked one
            # (_validate_enrolled_collaborator); a revocation record that cannot be read stops the start.
            self.enrolment = None if cert_dir is None else EnrolledCertificates(cert_dir)
            if self.enrolment is not None:
                self.enrolment.revoked()
            if config.public_data is not None:  # every party holds exactly the plan's public files
                from ..data.schema import verify_public_folder

                verify_public_folder(config.public_data)
            self.report = RoundReport(config, model_shape or {}, report_dir, rounds_to_train)
            if kwargs.get("initial_tensor_dict") is None:
                check_initial_model(kwargs.get("init_state_path") or "save/init.pbuf", self.report.global_specs)
            if kwargs.get("persist_checkpoint", True):
                check_tensor_db(kwargs.get("persistent_db_path") or "tensor.db")
            # Every upload is bounded by the plugin's declaration before it is taken in (see _bounded_stream).
            self.max_upload_bytes = upload_limit(config, model_shape or {}, kwargs.get("assigner"))
        except FedContrastError as exc:
            print(f"fedcontrast aggregator: error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        global MAX_MESSAGE_BYTES
        MAX_MESSAGE_BYTES = min(self.max_upload_bytes + MESSAGE_ALLOWANCE, grpc_common.MAX_MESSAGE_LENGTH_BYTES)
        self.round_timeout = float(round_timeout) if round_timeout else None
        self.min_sites = min_sites
        callbacks = list(kwargs.pop("callbacks", None) or [])  # the stock default is a shared list
        callbacks.append(self.report)
        # Set before super(): recovery may replay a whole round (its uploads were saved, its end was not).
        self.lock = threading.RLock()  # the straggler timer, the watchdog and task results share it
        aggregation.PERSONAL_DIR = report_dir
        self.round_started, self.round_open, self.quit_since = time.monotonic(), False, None
        try:
            super().__init__(callbacks=callbacks, rounds_to_train=rounds_to_train + 1, **kwargs)  # + the evaluation round
        except sqlite3.Error as exc:
            path = kwargs.get("persistent_db_path") or "tensor.db"
            print(f"fedcontrast aggregator: error: the checkpoint database {path} cannot be used ({exc}); move it "
                  "away to start the federation afresh", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        self._serve_personal_downlinks(config, model_shape or {}, report_dir)
        self.tls_log = None if cert_dir is None else self._explain_refused_connections(cert_dir)
        self.started, self.seen, self.waiting_noted = time.monotonic(), set(), time.monotonic()
        # A round's clock starts when its first task is handed out (or, if no site ever asks, at start-up):
        # the sites' own start-up time does not count against round 0.
        self.round_started, self.round_open = time.monotonic(), False
        if self.round_timeout is not None:
            threading.Thread(target=self._watchdog, name="fedcontrast-round-timeout", daemon=True).start()

    def _explain_refused_connections(self, cert_dir: Path) -> HandshakeLog:
        """Under ``fx aggregator start`` with TLS: name the certificates signed here that sites cannot
        use, and turn gRPC's handshake failures into one sentence each (:mod:`.tls_log`)."""
        problems = check_enrolled_certificates(cert_dir, list(self.authorized_cols))
        for problem in problems:
            logger.warning("%s: revoke it (`fedcontrast ca revoke WORKSPACE NAME --reason TEXT`) and sign that site a "
                           "new certificate (`fedcontrast ca sign`); until then its connections are (or will be) "
                           "refused", problem)
        unusable = [p for p in problems if " expires on " not in p]
        quiet = enable_handshake_trace()
        log = HandshakeLog(chain=str(cert_dir / "cert_chain.crt"), quiet_info=quiet, enrolled_problems=unusable)
        StderrTap(log).start()
        return log

    def _serve_personal_downlinks(self, config: RunConfig, shape: dict[str, int], report_dir: str) -> None:
        """Put this round's per-site tensors into the tensor DB: round 0's from the plugin's initial
        downlink, a resumed round's from the file the aggregation function wrote (OpenFL's own
        persistence keeps only the global model)."""
        algorithm, model = build_algorithm(config), initial_model(config, **shape)
        specs = [s for s in algorithm.download_specs(model, shape["num_classes"]) if s.per_site]
        if not specs:
            return  # the plugin sends no per-site tensors
        path = aggregation.personal_path(report_dir, self.round_number)
        if path.exists():
            personal = torch.load(path, weights_only=True)
        elif self.round_number == 0:
            server = ServerContext(model=model, round_num=0, seed=server_seed(config, 0), device=torch.device("cpu"),
                                   num_classes=shape["num_classes"], sites=site_names(config))
            personal = algorithm.initial_downlink(server).personal
            aggregation.save_personal(report_dir, 0, personal)
        else:
            personal = {}
        if personal:
            self.tensor_db.cache_tensor({TensorKey(PERSONAL_PACKED, self.uuid, self.round_number, False,
                                                   (site, PERSONAL_TAG)): pack(tensors, specs)
                                         for site, tensors in personal.items()})

    def _save_model(self, round_number, file_path):
        # With no "validate_agg" metric the best score stays None and persisting the round does
        # float(None): the round end would fail. Nothing here tracks a best model.
        if self.best_model_score is None:
            self.best_model_score = float("-inf")
        if file_path == self.last_state_path:  # the round's own files first: see RoundReport.export_round
            self.report.export_round(round_number)
        super()._save_model(round_number, file_path)

    # --- the round ------------------------------------------------------------------------------
    def send_local_task_results(self, collaborator_name, round_number, task_name, data_size, named_tensors):
        if any(t.name == FAILURE_METRIC for t in named_tensors):  # never persisted: a restart starts afresh
            with self.lock:
                self.absent.add(collaborator_name)
                self._fail(f"collaborator {collaborator_name} reported that its task {task_name!r} failed in round "
                           f"{round_number}; the reason is in that site's own log")
            return
        notice = self.stop_notice(collaborator_name)
        if notice is not None:  # the federation stopped before this upload came: not taken; the sender is told why
            raise FederationStopped(notice)
        super().send_local_task_results(collaborator_name, round_number, task_name, data_size, named_tensors)

    def process_task_results(self, collaborator_name, round_number, task_name, data_size, named_tensors):
        with self.lock:
            if (not self._time_to_quit() and collaborator_name not in self.stragglers  # results OpenFL takes
                    and round_number == self.round_number
                    and not self._collaborator_task_completed(collaborator_name, task_name, round_number)):
                # which metrics this site released (its policy may withhold some): noted before the round can end
                self.report.note_sent(round_number, collaborator_name, task_name,
                                      [t.name for t in named_tensors if t.report and "metric" in t.tags])
            super().process_task_results(collaborator_name, round_number, task_name, data_size, named_tensors)
            if (task_name == EVALUATE_TASK and round_number == self.round_number and round_number >= 1
                    and self.failure is None
                    and self.report.evaluations_complete(round_number, list(self.authorized_cols))):
                self.report.write_record(round_number)  # every site has measured the model: report it now

    def _compute_validation_related_task_metrics(self, task_name) -> dict:
        """OpenFL's, except for the metrics: each is the weighted mean over the sites that sent it, with
        their weights of today renormalised over them, and absent when none did. OpenFL averages the first
        site's metrics over every site, so a metric that another site withheld (sites release what their
        policies allow) came back as None and ``float(None)`` ended the round, and again on every restart
        that replayed the round's saved results; a metric the first site withheld was dropped. Who withheld
        what is in the round's record (:meth:`RoundReport.withheld`)."""
        round_number = self.round_number
        sites = [c for c in self.assigner.get_collaborators_for_task(task_name, round_number)
                 if c in self.collaborators_done]
        keys = {c: TaskResultKey(task_name, c, round_number) for c in sites}
        results = self.collaborator_tasks_results
        if not sites:
            return {}
        self.collaborator_tasks_results = {k: ([t for t in v if "metric" not in t.tags] if k in keys.values() else v)
                                           for k, v in results.items()}
        try:  # the tensors that are not metrics (the uploads), as OpenFL aggregates them
            logs = super()._compute_validation_related_task_metrics(task_name)
        finally:
            self.collaborator_tasks_results = results
        released: dict[TensorKey, dict[str, float]] = {}
        for site, key in keys.items():
            for tensor_key in results.get(key, []):
                if "metric" not in tensor_key.tags or not tensor_key.report:
                    continue
                value = self.tensor_db.get_tensor_from_cache(tensor_key)
                value = None if value is None else np.asarray(value, dtype=float)
                if value is None or value.size != 1 or not np.isfinite(value).all():
                    logger.warning("round %d: site %s sent %s = %s, not a finite number; left out of its average",
                                   round_number, site, tensor_key.tensor_name, value)
                    continue
                name, origin, fl_round, report, tags = tensor_key
                overall = TensorKey(name, origin, fl_round, report, change_tags(tags, remove_field=site))
                released.setdefault(overall, {})[site] = float(value.reshape(()))
        for overall, values in released.items():
            weights = {s: float(self.collaborator_task_weight[keys[s]]) for s in values}
            total = sum(weights.values())
            value = (sum(values[s] * weights[s] for s in values) / total if total
                     else float(np.mean(list(values.values()))))
            self.tensor_db.cache_tensor({overall: np.array(value)})
            self.metric_queue.put({"metric_origin": "aggregator", "task_name": task_name,
                                   "metric_name": overall.tensor_name, "metric_value": value, "round": round_number})
            logs[f"aggregator/{task_name}/{overall.tensor_name}"] = value
        return logs

    def _end_of_round_check(self):
        if self.failure is not None:
            return
        round_number = self.round_number
        missing = list(self.stragglers)
        self.report.absent = missing
        try:
            super()._end_of_round_check()
        except Exception as exc:  # raised inside an aggregation function or a callback
            self._fail(f"round {round_number} could not be aggregated: {type(exc).__name__}: {exc}")
            logger.exception("aggregation failure")
            return
        if self.round_number != round_number:  # the round ended: the next one's clock starts
            self.absent = set(missing)
            self.round_started, self.round_open = time.monotonic(), False
        if aggregation.REJECTED:
            reasons = "; ".join(aggregation.REJECTED)
            aggregation.REJECTED.clear()
            self._fail(f"rejected upload(s): {reasons}; the round was aggregated without them and the federation "
                       "stops so that the operator can look at the sender (robustness.on_rejected: stop)")

    def _watchdog(self) -> None:
        """End (or, with ``min_sites``, close without the silent sites) a round past ``round_timeout``."""
        while True:
            time.sleep(0.5)
            with self.lock:
                if self.failure is not None or self._time_to_quit():
                    return
                self._note_waiting()
                if time.monotonic() - self.round_started <= self.round_timeout:
                    continue
                done = [c for c in self.authorized_cols if c in self.collaborators_done]
                missing = [c for c in self.authorized_cols if c not in done]
                label = "the evaluation round" if self.round_number == self.rounds_to_train - 1 else \
                    f"round {self.round_number}"
                if self.min_sites is not None and done and len(done) >= self.min_sites:
                    logger.warning("%s: no answer from %s within %.0f s; aggregated without them (min_sites %d)",
                                   label, ", ".join(missing), self.round_timeout, self.min_sites)
                    self.stragglers = missing
                    self._end_of_round_check()
                else:
                    self.absent = set(missing)
                    self._fail(f"{label} did not complete within {self.round_timeout:.0f} s (the plan's "
                               f"round_timeout): no answer from {', '.join(missing)}")

    def _note_waiting(self) -> None:
        """Every :data:`WAITING_NOTICE_S` seconds, name the sites that have not connected yet (and how
        many TLS connections were refused meanwhile)."""
        now = time.monotonic()
        if now - self.waiting_noted < WAITING_NOTICE_S:
            return
        self.waiting_noted = now
        absent = [c for c in self.authorized_cols if c not in self.seen]
        if absent:
            refused = getattr(self.tls_log, "refused", 0)
            logger.info("waiting for %s: not connected in the %.0f s since the aggregator started%s", ", ".join(absent),
                        now - self.started, f" ({refused} TLS connection(s) refused meanwhile: see above)"
                        if refused else "")

    def refuse_certificate(self, name: str, context: Any) -> str | None:
        """Why the client certificate of this call may not be used as ``name`` (revoked, signed here for
        another name, or not the one signed here for ``name``: :class:`~.pki.EnrolledCertificates`), in
        one sentence, also logged (once a minute per name and reason); None when it may."""
        enrolment = getattr(self, "enrolment", None)
        if enrolment is None or getattr(self, "single_col_cert_common_name", ""):
            return None  # no TLS under fx, or OpenFL's one shared collaborator certificate
        try:
            pem = (context.auth_context().get("x509_pem_cert") or [None])[0]
        except Exception:  # a context without authentication
            pem = None
        reason = enrolment.refusal(name, pem)
        if reason is not None:
            logged = self.__dict__.setdefault("_refusals_logged", {})
            now = time.monotonic()
            if now - logged.get((name, reason), -WAITING_NOTICE_S) >= WAITING_NOTICE_S:
                logged[(name, reason)] = now
                try:
                    peer = context.peer()
                except Exception:
                    peer = "an unknown address"
                logger.error("%s (connection from %s)", reason, peer)
        return reason

    def refuse_upload(self, sender: str, received: int, context: Any = None) -> str:
        """An upload over :attr:`max_upload_bytes`, refused while it streams in (nothing of it is
        stored): stop the federation naming the sender, even under ``on_rejected: exclude`` (the sender's
        collaborator ends on the refusal, so the round could only wait for it until its timeout). The reason.
        A certificate that is not an admitted site's (not in cols.yaml, or refused by
        :meth:`refuse_certificate`) is refused without stopping the federation."""
        reason = (f"{sender}'s upload of more than {received} bytes exceeds the {self.max_upload_bytes} bytes "
                  "that the plan's declared upload allows; refused before it was stored")
        name = certificate_name(context)
        refuse = getattr(self, "refuse_certificate", None)
        if name is not None and (name not in self.authorized_cols or (refuse is not None and refuse(name, context))):
            logger.error("%s (not an admitted site of this federation, which goes on)", reason)
            return reason
        with self.lock:
            self._fail(reason)
            if name is not None:  # the refusal is its stop notice (its collaborator ends on it): not waited for
                self.stop_notice(name)
        return reason

    def _fail(self, reason: str) -> None:
        if self.failure is not None:
            return
        self.failure = reason
        self.stop_told_at = time.monotonic()
        logger.error("federation stopped: %s", reason)
        self.rounds_to_train = self.round_number  # every collaborator is now told to quit
        pending = self.report.pending.get("round")
        if pending is not None and pending > self.report.written:  # keep the last aggregated round's record,
            self.report.write_record(pending)  # with whatever evaluations of it arrived

    def get_tasks(self, collaborator_name):
        self.seen.add(collaborator_name)
        tasks, round_number, sleep_time, time_to_quit = super().get_tasks(collaborator_name)
        if time_to_quit and self.failure is not None:
            sleep_time = FAILURE_SLEEP_CODE
        if tasks and not self.round_open:
            self.round_started, self.round_open = time.monotonic(), True
        return tasks, round_number, sleep_time, time_to_quit

    def stop_notice(self, collaborator_name: str) -> str | None:
        """Once the federation has stopped: the sentence ``collaborator_name`` is answered with (the
        details of an ABORTED status, see :func:`_get_tasks_or_stop_notice`: OpenFL's quit answer has no
        field for a reason), and it counts as told; None while the federation goes on."""
        if self.failure is None:
            return None
        if collaborator_name not in self.quit_job_sent_to:
            self.quit_job_sent_to.append(collaborator_name)
        self.stop_told_at = time.monotonic()
        return STOPPED + self.failure

    def all_quit_jobs_sent(self) -> bool:  # polled by the server's main thread
        """Every site that is still there has been told to quit (a site that did not answer in the
        last round is not waited for: it may be gone for good)."""
        if not self._time_to_quit():
            return False
        if self.quit_since is None:
            self.quit_since = time.monotonic()
        live = set(self.authorized_cols) - self.absent
        done = set(self.quit_job_sent_to) >= live or time.monotonic() - self.quit_since > 60
        if done and self.failure is not None:
            # Every live site has been told why; go on answering with the reason a little longer, for a site
            # between two calls (one that was silent is not waited for: it may be gone for good).
            time.sleep(max(1.0, STOP_GRACE_S - (time.monotonic() - self.stop_told_at)))
            print(f"fedcontrast aggregator: error: federation stopped: {self.failure}", file=sys.stderr, flush=True)
            raise SystemExit(FAILURE_EXIT_CODE)
        return done


def _check_collaborators(config: RunConfig, authorized: list[str], min_sites: int | None) -> None:
    """The aggregator admits exactly the plan's sites, each once (a site's index, e.g. FedPCL's
    prototype set, is its position in the plan): a name added to cols.yaml (``fx collaborator
    certify`` appends every name it signs) or listed twice would count a site's data twice, a name
    missing would run the federation without that site."""
    names = site_names(config)
    remake = "or make a plan with the sites taking part (`fedcontrast workspace create ... --sites`)"
    strangers = [c for c in authorized if c not in names]
    if strangers:
        raise ConfigError(f"plan/cols.yaml admits {', '.join(strangers)}, which the plan does not name as a site "
                          f"({', '.join(names)}); remove them from cols.yaml {remake}")
    repeated = sorted({c for c in authorized if authorized.count(c) > 1})
    if repeated:
        raise ConfigError(f"plan/cols.yaml lists {', '.join(repeated)} more than once (its data would count twice); "
                          f"list each of the plan's sites once in cols.yaml {remake}")
    missing = [n for n in names if n not in authorized]
    if missing:
        raise ConfigError(f"plan/cols.yaml lacks {', '.join(missing)}, a site of the plan ({', '.join(names)}); add "
                          f"it back to cols.yaml {remake}")
    if min_sites is not None and not (isinstance(min_sites, int) and 1 <= min_sites <= len(names)):
        raise ConfigError(f"min_sites must be an integer between 1 and the {len(names)} sites of the plan, "
                          f"got {min_sites!r}")


def check_aggregator_plan(config: RunConfig, settings: dict[str, Any], argv: list[str] | None = None,
                          cwd: str | Path = ".") -> Path | None:
    """The aggregator runs the rounds its plan's sites agreed to: ``rounds_to_train`` is the run
    configuration's ``rounds``; under ``fx aggregator start`` the plan file gives every component the
    same settings (:func:`~.plan.check_plan_consistency`), these are its ``aggregator.settings``, and
    the aggregator's own certificate and the CA chain are within their validity dates. The
    certificate folder when the plan serves with TLS under ``fx``, else None."""
    if settings["rounds_to_train"] != config.rounds:
        raise ConfigError(f"the plan's aggregator.settings.rounds_to_train ({settings['rounds_to_train']}) differs "
                          f"from the run configuration's rounds ({config.rounds}), for which the sites' privacy "
                          "budget is planned; regenerate the plan with `fedcontrast workspace create`")
    path = fx_plan_path("aggregator", argv, cwd)
    if path is None:
        return None
    plan = load_plan_file(path)
    ours = plan["aggregator"].get("settings") or {}
    differ = [key for key, value in settings.items() if ours.get(key) != value]
    if differ:
        raise ConfigError(f"the aggregator was not given the aggregator settings of {path} (differ: "
                          f"{', '.join(differ)}); start it with that plan: fx aggregator start -p {path}")
    network = plan.get("network", {}).get("settings") or {}
    port = network.get("agg_port")
    if isinstance(port, int) and not isinstance(port, bool):
        check_port_free(port)
    if network.get("use_tls", True):  # the files `fx aggregator start` serves with (OpenFL's default paths)
        address = network.get("agg_addr")
        if address == "auto":
            from openfl.utilities.utils import getfqdn_env

            address = getfqdn_env()
        # the certificate and key `fx aggregator start` will look up for agg_addr: present, in date, fitting
        check_server_files(Path(cwd) / "cert", str(address))
        return Path(cwd) / "cert"
    return None


def check_port_free(port: int) -> None:
    """Refuse, in one sentence naming the port, to serve on a port another process already listens on:
    gRPC binds with SO_REUSEPORT, so a second aggregator would start beside the first, and sites would
    reach whichever the kernel picks (the stale one, often, and then blame a CA mismatch)."""
    import errno
    import socket

    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this machine: try IPv4
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are not "taken"
            try:
                probe.bind((host, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ConfigError(f"port {port} (the plan's network.settings.agg_port) is taken on this machine: "
                                      "another process listens on it (an aggregator still running?); stop it, or "
                                      "make the plan with another --port") from None
                continue  # e.g. IPv6 disabled: the other family decides
            return


def check_initial_model(path: str | Path, global_specs: list) -> None:
    """``save/init.pbuf`` (written by ``fx plan initialize``) holds this plan's initial downlink: a
    plan edited afterwards (another model, another plugin) needs it made again."""
    path = Path(path)
    if not path.is_file():
        return  # OpenFL names the missing file
    from openfl.pipelines import NoCompressionPipeline
    from openfl.protocols import utils

    advice = "re-run `fx plan initialize` after any change to plan/plan.yaml"
    try:
        tensors, _ = utils.deconstruct_model_proto(utils.load_proto(str(path)), NoCompressionPipeline())
    except Exception as exc:  # protobuf's DecodeError, a truncated file
        raise ConfigError(f"{path} cannot be read ({type(exc).__name__}); {advice}") from None
    expected = packed_size(global_specs)
    found = np.asarray(tensors[GLOBAL_PACKED]).size if GLOBAL_PACKED in tensors else None
    if found != expected:
        what = f"{found} values" if found is not None else f"no {GLOBAL_PACKED!r} tensor"
        raise ConfigError(f"{path} is not this plan's initial model ({what} where the plan's model has {expected}): "
                          f"it was made before the plan was edited; {advice}")


def check_tensor_db(path: str | Path) -> None:
    """OpenFL's checkpoint database opens cleanly, or one sentence naming it (a corrupt file would
    otherwise end the aggregator in a traceback on every start)."""
    path = Path(path)
    if not path.exists():
        return
    # A kill in the middle of a transaction leaves a hot journal: SQLite rolls it back on the next open
    # with write access (what OpenFL's open would do), and a read-only open fails ("attempt to write a
    # readonly database") although nothing is corrupt. Open it as OpenFL will, then.
    hot = any(path.with_name(path.name + suffix).exists() for suffix in ("-journal", "-wal"))
    try:
        with closing(sqlite3.connect(path.resolve().as_uri() + ("?mode=rw" if hot else "?mode=ro"), uri=True)) as db:
            status = db.execute("PRAGMA quick_check").fetchone()[0]
    except sqlite3.Error as exc:
        status = str(exc)
    if status != "ok":
        raise ConfigError(f"the aggregator's checkpoint database {path} is corrupt ({status}); move it away to start "
                          "the federation afresh (its rounds are lost), or put back a good copy to resume")


def upload_limit(config: RunConfig, model_shape: dict[str, int], assigner: Any = None) -> int:
    """The most bytes one upload call may carry: the plugin's declared upload, packed, plus
    :data:`UPLOAD_MARGIN` for the message around it. The declaration is read from the plan's
    aggregation functions when OpenFL has built them (``assigner.tasks``: no second build of the
    plugin, no second read of the public set), else built here."""
    for task in (getattr(assigner, "tasks", None) or {}).values():
        function = task.get("aggregation_type") if isinstance(task, dict) else None
        if isinstance(function, aggregation.PluginAggregation):
            return packed_size(function.specs) * 4 + UPLOAD_MARGIN
    algorithm = build_algorithm(config)
    if algorithm.requires_public:  # e.g. FLESD: the upload's shape depends on the public set
        attach_public(algorithm, load_public(config))
    model = initial_model(config, **model_shape)
    return packed_size(algorithm.upload_specs(model, model_shape["num_classes"])) * 4 + UPLOAD_MARGIN


def check_settings_in_effect(task_runner: Any, client: Any) -> None:
    """Behind the plan check, on the objects themselves: the connection and the training run with
    the settings this site's policy was checked against (the data loader's)."""
    from .loader import SiteDataLoader
    from .runner import PluginTaskRunner

    loader = getattr(task_runner, "data_loader", None)
    if not isinstance(task_runner, PluginTaskRunner) or not isinstance(loader, SiteDataLoader):
        raise ConfigError("the plan's task_runner or data_loader is not fedcontrast's (PluginTaskRunner, "
                          "SiteDataLoader), so this site's policy was not checked; use a plan made by "
                          "`fedcontrast workspace create`")
    checked = loader.network or {}
    problems = [f"{key} is {getattr(client, key, None)} on the connection but {checked.get(key, True)} in the "
                "settings this site's policy was checked against"
                for key in ("use_tls", "require_client_auth")
                if bool(getattr(client, key, None)) != bool(checked.get(key, True))]
    if task_runner.config != loader.config:
        a, b = task_runner.config.to_dict(), loader.config.to_dict()
        problems.append("the task runner's run configuration differs from the data loader's in: "
                        + ", ".join(k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)))
    if problems:
        raise ConfigError(f"the plan splits what runs from what was checked: {'; '.join(problems)}")


# --- uploads bounded while they stream in -------------------------------------------------------
# OpenFL reads a whole upload (2 MiB chunks) into memory and the tensor database before anything
# checks its size; the aggregator's gRPC server here stops reading at the declared size instead,
# naming the sender and the size, and gRPC takes no single message much larger than that (see
# MESSAGE_ALLOWANCE: a message over gRPC's own limit is refused before Python sees it, unnamed).
MAX_MESSAGE_BYTES: int | None = None  # set by SafeAggregator, read when the server is created


def certificate_name(context: Any) -> str | None:
    """The common name of the caller's client certificate (mutual TLS), else None."""
    try:
        names = context.auth_context().get("x509_common_name") or []
    except Exception:  # no context, or one without authentication
        names = []
    return names[0].decode() if names else None


def peer_name(context: Any) -> str:
    """The sender as its client certificate names it (mutual TLS), else its network address."""
    name = certificate_name(context)
    return f"collaborator {name}" if name is not None else f"the client at {context.peer()}"


def _bounded_stream(stream, limit: int, context: Any, aggregator: Any):
    received = 0
    try:
        for chunk in stream:
            received += len(chunk.npbytes)
            if received > limit:
                reason = aggregator.refuse_upload(peer_name(context), received, context)
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, reason)
            yield chunk
    except grpc.RpcError:  # the call ended under the stream: the sender went away, or gRPC refused a message
        logger.warning("%s's upload broke off after %d bytes: its connection ended, or it sent a single message over "
                       "gRPC's limit of %s bytes (OpenFL's client never does)", peer_name(context), received,
                       MAX_MESSAGE_BYTES if MAX_MESSAGE_BYTES is not None else grpc_common.MAX_MESSAGE_LENGTH_BYTES)
        raise


_stock_send_local_task_results = grpc_server.AggregatorGRPCServer.SendLocalTaskResults
_stock_get_tasks = grpc_server.AggregatorGRPCServer.GetTasks
_stock_create_grpc_server = grpc_server.create_grpc_server


def _bounded_send_local_task_results(self, request, context):
    limit = getattr(self.aggregator, "max_upload_bytes", None)
    if limit is not None:
        request = _bounded_stream(request, limit, context, self.aggregator)
    try:
        return _stock_send_local_task_results(self, request, context)
    except FederationStopped as stop:  # an upload after the federation stopped: the sender learns why
        context.abort(grpc.StatusCode.ABORTED, str(stop))


def _get_tasks_or_stop_notice(self, request, context):
    """OpenFL's GetTasks (the caller validated first); once the aggregator has stopped the federation,
    its quit answer becomes an ABORTED status whose details say why (:meth:`SafeAggregator.stop_notice`)."""
    response = _stock_get_tasks(self, request, context)
    notice = getattr(self.aggregator, "stop_notice", None)
    reason = notice(request.header.sender) if response.quit and notice is not None else None
    if reason is not None:
        context.abort(grpc.StatusCode.ABORTED, reason)
    return response


def _bounded_grpc_server(*args: Any, **kwargs: Any):
    """OpenFL's server, with its largest accepted message bounded by :data:`MAX_MESSAGE_BYTES`, and
    without SO_REUSEPORT: a port another process holds fails to bind instead of being shared."""
    stock = grpc_common.DEFAULT_CHANNEL_OPTIONS
    options = {"grpc.so_reuseport": 0}
    if MAX_MESSAGE_BYTES is not None:
        options["grpc.max_receive_message_length"] = MAX_MESSAGE_BYTES
    grpc_common.DEFAULT_CHANNEL_OPTIONS = [o for o in stock if o[0] not in options] + list(options.items())
    try:
        return _stock_create_grpc_server(*args, **kwargs)
    finally:
        grpc_common.DEFAULT_CHANNEL_OPTIONS = stock


grpc_server.AggregatorGRPCServer.SendLocalTaskResults = _bounded_send_local_task_results
grpc_server.AggregatorGRPCServer.GetTasks = _get_tasks_or_stop_notice
grpc_server.create_grpc_server = _bounded_grpc_server

# --- one certificate per name -------------------------------------------------------------------
# OpenFL admits any certificate of the federation's CA whose common name is the name the caller claims;
# here it must also be the very certificate signed for that name, and not revoked.
_stock_validate_collaborator = grpc_server.AggregatorGRPCServer.validate_collaborator


def _validate_enrolled_collaborator(self, request, context):
    """OpenFL's check (the certificate's common name is the sender's name, one of cols.yaml), then
    :meth:`SafeAggregator.refuse_certificate`: a refusal ends the call with UNAUTHENTICATED and its sentence."""
    _stock_validate_collaborator(self, request, context)
    refuse = getattr(self.aggregator, "refuse_certificate", None)
    if refuse is None or not (self.use_tls and self.require_client_auth):
        return
    reason = refuse(request.header.sender, context)
    if reason is not None:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)


grpc_server.AggregatorGRPCServer.validate_collaborator = _validate_enrolled_collaborator


def explain_rpc_error(error: grpc.RpcError, uri: str) -> tuple[str, bool]:
    """One sentence for a failed call to the aggregator, and whether retrying can help."""
    code = error.code() if hasattr(error, "code") else None
    details = (error.details() if hasattr(error, "details") else "") or ""
    if code == grpc.StatusCode.ABORTED and details.startswith(STOPPED):  # SafeAggregator.stop_notice's sentence
        return details.strip(), False
    if code == grpc.StatusCode.UNAUTHENTICATED and details.startswith("refused "):  # refuse_certificate's sentence
        return f"the aggregator at {uri} {details.strip()}", False
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return (f"the aggregator at {uri} refused this collaborator: its name is not in the aggregator's "
                f"plan/cols.yaml or does not match its certificate ({details.strip()})", False)
    if "does not match aggregator UUID" in details or "federation" in details.lower():
        return (f"this collaborator's plan differs from the aggregator's at {uri} (another federation id): "
                "use the exact plan/plan.yaml that the aggregator initialised", False)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return f"the aggregator at {uri} refused this collaborator's upload: {details.strip()}", False
    if code == grpc.StatusCode.UNAVAILABLE:
        return (f"cannot reach the aggregator at {uri}: it is not running, the address is wrong, or the TLS "
                "handshake failed (for example a certificate signed by another CA, or no client certificate)", True)
    return f"the aggregator at {uri} answered {code}: {details.strip()}", True


def diagnose_handshake(client: Any) -> str | None:
    """Why the TLS connection to the aggregator cannot succeed, when a certificate is the reason (its
    CA, its name, its dates, or the aggregator refusing this site's certificate); None otherwise."""
    host, _, port = client.uri.rpartition(":")
    own = bool(client.require_client_auth)
    try:
        check_aggregator_certificate(host.strip("[]"), int(port), client.root_certificate,
                                     certificate=client.certificate if own else None,
                                     private_key=client.private_key if own else None)
    except FedContrastError as exc:
        return str(exc)
    except Exception:  # a diagnosis must never hide the original failure
        logger.debug("could not diagnose the failed connection", exc_info=True)
    return None


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


class BoundedRetry:
    """Replaces the client's retry sleep (OpenFL retries a failed call forever, 1 s apart): keeps
    trying for ``wait`` seconds from the first failure in a row (the plan's ``wait_for_aggregator``:
    an aggregator's restart fits in it), waiting ``interval`` seconds after the first failure and
    twice as long after each next one, up to ``max_interval``; says why at the first failure and
    then once a minute; gives up after ``wait`` seconds (or ``max_attempts`` failures in a row, when
    given), and at once when retrying cannot help (refused identity, another federation, or a
    certificate that ``diagnose`` finds wrong after a failed connection). ``succeeded()`` ends a
    run of failures; ``clock``/``sleeper`` are for tests."""

    def __init__(self, interval: float, uri: str, max_attempts: int | None = None,
                 diagnose: Callable[[], str | None] | None = None, *, wait: float = DEFAULT_WAIT_FOR_AGGREGATOR,
                 max_interval: float = DEFAULT_RECONNECT_INTERVAL_MAX, notice_every: float = WAITING_NOTICE_S,
                 clock: Callable[[], float] = time.monotonic, sleeper: Callable[[float], None] = time.sleep) -> None:
        self.reconnect_interval, self.uri, self.max_attempts = interval, uri, max_attempts
        self.diagnose = diagnose  # a sentence when the TLS handshake cannot succeed, else None
        self.wait, self.max_interval, self.notice_every = wait, max_interval, notice_every
        self.clock, self.sleeper = clock, sleeper
        self.failures = 0
        self.first_failure = self.last_notice = 0.0

    @property
    def waiting(self) -> bool:
        """Whether the aggregator is out of reach (the last call failed and none succeeded since)."""
        return self.failures > 0

    def next_delay(self) -> float:
        """Seconds before the next attempt: ``interval`` × 2^(failures-1), at most ``max_interval``."""
        return min(self.max_interval, self.reconnect_interval * 2.0 ** min(self.failures - 1, 30))

    def succeeded(self) -> None:
        """A call went through: the next failure starts a new wait."""
        if self.failures:
            logger.info("reached the aggregator at %s again after %s", self.uri,
                        _duration(self.clock() - self.first_failure))
        self.failures = 0

    def sleep(self) -> None:
        error = sys.exc_info()[1]  # called inside the client's `except grpc.RpcError` block
        message, retryable = (explain_rpc_error(error, self.uri) if isinstance(error, grpc.RpcError)
                              else (f"lost the aggregator at {self.uri}: {error}", True))
        if (retryable and self.diagnose is not None and hasattr(error, "code")
                and error.code() == grpc.StatusCode.UNAVAILABLE):
            reason = self.diagnose()
            if reason is not None:
                message, retryable = reason, False
        if not retryable:
            raise CollaboratorStopped(f"fedcontrast collaborator: error: {message}")
        now = self.clock()
        self.failures += 1
        if self.failures == 1:
            self.first_failure = self.last_notice = now
        elapsed = now - self.first_failure
        if self.max_attempts is not None and self.failures > self.max_attempts:
            raise CollaboratorStopped(f"fedcontrast collaborator: error: {message} (gave up after "
                                      f"{self.max_attempts} retries)")
        if elapsed >= self.wait:
            raise CollaboratorStopped(f"fedcontrast collaborator: error: {message} (gave up after {_duration(elapsed)}: "
                                      f"the plan's wait_for_aggregator is {_duration(self.wait)})")
        if self.failures == 1:
            logger.warning("%s; trying again for up to %s (the plan's wait_for_aggregator)", message,
                           _duration(self.wait))
        elif now - self.last_notice >= self.notice_every:
            self.last_notice = now
            logger.warning("waiting for the aggregator at %s: not reachable for %s (gives up after %s)", self.uri,
                           _duration(elapsed), _duration(self.wait))
        self.sleeper(min(self.next_delay(), self.wait - elapsed))


class QuietClientLog(logging.Filter):
    """OpenFL's client logs every call for tasks ("Requesting tasks...": 20 lines a second while a
    site waits for its next round, see ``poll_interval``) and four lines per reconnection attempt.
    Installed on its logger: the first at most once a minute; the reconnection lines not at all
    (:class:`BoundedRetry` says once a minute that the site is waiting, and why)."""

    LOGGER = "openfl.transport.grpc.aggregator_client"
    RATE_LIMITED = ("Requesting tasks",)
    RECONNECTING = ("Failed to send data request", "Reconnecting to aggregator", "Disconnecting from gRPC server",
                    "Connecting to gRPC at", "Refetching server certificate")

    def __init__(self, every: float = WAITING_NOTICE_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.every, self.clock = every, clock
        self.last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        if text.startswith(self.RECONNECTING):
            return False
        if text.startswith(self.RATE_LIMITED):
            now, last = self.clock(), self.last.get(text)
            if last is not None and now - last < self.every:
                return False
            self.last[text] = now
        return True

    @classmethod
    def install(cls) -> None:
        target = logging.getLogger(cls.LOGGER)
        if not any(isinstance(f, cls) for f in target.filters):
            target.addFilter(cls())


def _ends_waiting(method: Callable[..., Any], retry: BoundedRetry) -> Callable[..., Any]:
    """``method`` of the client, telling ``retry`` when a call went through."""
    def call(*args: Any, **kwargs: Any) -> Any:
        result = method(*args, **kwargs)
        retry.succeeded()
        return result

    return call


class SafeCollaborator(Collaborator):
    """The stock collaborator that waits a bounded time for an unreachable aggregator (the plan's
    ``wait_for_aggregator``, with back-off; see :class:`BoundedRetry`), logs its polling at most once
    a minute, and exits with an explanation when the federation fails."""

    def __init__(self, max_retries: int | None = None, poll_interval: float = 0.05,
                 wait_for_aggregator: float = DEFAULT_WAIT_FOR_AGGREGATOR,
                 reconnect_interval_max: float = DEFAULT_RECONNECT_INTERVAL_MAX, **kwargs: Any) -> None:
        client = kwargs.get("client")
        try:
            check_wait_settings(wait_for_aggregator, reconnect_interval_max, max_retries)
            if getattr(client, "use_tls", False):  # a certificate that cannot work: say so now, not after every retry
                if client.require_client_auth:  # in date, fits its key, signed by the CA in cert_chain.crt
                    check_own_certificate(client.certificate, getattr(client, "private_key", None),
                                          client.root_certificate)
                    if kwargs.get("collaborator_name"):  # the aggregator admits a name only with its own certificate
                        check_certificate_name(client.certificate, kwargs["collaborator_name"])
                else:
                    check_certificate_dates([client.root_certificate])
            check_settings_in_effect(kwargs.get("task_runner"), client)
        except FedContrastError as exc:
            raise CollaboratorStopped(f"fedcontrast collaborator: error: {exc}") from None
        super().__init__(**kwargs)
        # The aggregator can only say "sleep N whole seconds" when it has no task yet; a site that
        # finished early would then start the next round up to a second late. Asking again sooner
        # costs one small gRPC call.
        self.poll_interval = poll_interval
        policy = self.client.sleeping_policy
        diagnose = (lambda: diagnose_handshake(self.client)) if getattr(self.client, "use_tls", False) else None
        retry = BoundedRetry(policy.reconnect_interval, policy.uri, max_retries, diagnose,
                             wait=float(wait_for_aggregator), max_interval=float(reconnect_interval_max))
        self.client.sleeping_policy = retry
        for name in ("ping", "get_tasks", "get_aggregated_tensor", "send_local_task_results"):  # a call that
            if callable(getattr(self.client, name, None)):  # went through ends a wait, whichever it was
                setattr(self.client, name, _ends_waiting(getattr(self.client, name), retry))
        QuietClientLog.install()

    def run(self) -> None:  # Collaborator.run of OpenFL 1.9, plus the lines marked below
        self.callbacks.on_experiment_begin()
        while True:
            tasks, round_number, sleep_time, time_to_quit = self.client.get_tasks()
            if time_to_quit:
                if sleep_time == FAILURE_SLEEP_CODE:  # added: the aggregator stopped the federation
                    raise CollaboratorStopped("fedcontrast collaborator: error: the aggregator stopped the "
                                              "federation (a failed round, a site that did not answer in time, "
                                              "or a failed task); its log says which")
                break
            if not tasks:
                time.sleep(min(sleep_time, self.poll_interval))  # changed: see poll_interval
                continue
            logger.info("Round: %d Received Tasks: %s", round_number, tasks)
            self.callbacks.on_round_begin(round_number)
            logs = {}
            for task in tasks:
                try:  # added: a failing task ends this collaborator with one sentence, and tells the aggregator
                    logs.update(self.do_task(task, round_number))
                except (CollaboratorStopped, KeyboardInterrupt):
                    raise
                except Exception as exc:
                    self._task_failed(task, round_number, exc)
            self.tensor_db.clean_up(self.db_store_rounds)
            self.callbacks.on_round_end(round_number, logs)
        self.callbacks.on_experiment_end()
        logger.info("Received shutdown signal. Exiting...")

    def _task_failed(self, task, round_number: int, exc: Exception) -> None:
        """Keep the traceback in this site's log folder, tell the aggregator (a number only: the reason
        stays here), and stop with one sentence."""
        name = getattr(task, "name", task)
        trace = Path("logs") / f"{self.collaborator_name}_error.txt"
        try:
            trace.parent.mkdir(exist_ok=True)
            trace.write_text("".join(traceback.format_exception(exc)))
            where = f" (traceback in {trace})"
        except OSError:
            where = ""
        try:
            key = TensorKey(FAILURE_METRIC, self.collaborator_name, round_number, True, ("metric",))
            self.client.send_local_task_results(round_number, name, -1, [self.nparray_to_named_tensor(key, np.array(1.0))])
        except (Exception, CollaboratorStopped):  # the aggregator may be gone, or stopped already: this site's own
            # failure is what it reports (a gone aggregator's round timeout covers the rest)
            logger.debug("could not tell the aggregator about the failure", exc_info=True)
        reason = str(exc) if isinstance(exc, FedContrastError) else f"{type(exc).__name__}: {exc}"
        raise CollaboratorStopped(f"fedcontrast collaborator: error: task {name!r} of round {round_number} failed: "
                                  f"{reason}{where}") from None
