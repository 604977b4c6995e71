"""The aggregator of the plan (``aggregator.template``): OpenFL's, plus a federation that stops
cleanly (a failed round, a round past its timeout, a failed task) with every site told why."""

from __future__ import annotations

import logging
import sqlite3
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from openfl.component.aggregator.aggregator import Aggregator
from openfl.transport.grpc import common as grpc_common
from openfl.utilities import TaskResultKey, TensorKey, change_tags

from ..algorithms import ServerContext
from ..config import RunConfig, site_names
from ..construction import build_algorithm, initial_model, server_seed
from ..errors import FedContrastError
from ..privacy.secagg_relay import relay_for
from ..privacy.secagg_terms import SumLayout
from . import aggregation, grpc_bounds
from .attendance import AttendanceRounds
from .ending import EndingLines
from .enrolment import EnrolledCertificates, check_enrolled_certificates
from .grpc_bounds import certificate_name
from .packing import PERSONAL_PACKED, pack
from .plan import DEFAULT_ROUND_TIMEOUT, EVALUATE_TASK
from .protocol import (
    FAILURE_EXIT_CODE,
    FAILURE_SLEEP_CODE,
    MESSAGE_ALLOWANCE,
    STOP_GRACE_S,
    STOPPED,
    WAITING_NOTICE_S,
    FederationStopped,
    failure_sentence,
)
from .records import RoundReport
from .runner import PERSONAL_TAG
from .secure import SECAGG_TASK, SecureRounds, kind_of
from .startup_checks import (
    _check_collaborators,
    check_aggregator_plan,
    check_initial_model,
    check_tensor_db,
    declared_uploads,
    upload_limit,
)
from .tls_log import HandshakeLog, StderrTap, enable_handshake_trace

# one logger for the plan's components, as log lines name it
logger = logging.getLogger("fedcontrast.openfl.components")


# OpenFL calls Aggregator._get_sleep_time() through the class name, so a subclass override would be
# ignored; it tells an idle collaborator to sleep 10 s. One second keeps rounds moving (an int is
# required: it travels in an int32 protobuf field).
Aggregator._get_sleep_time = staticmethod(lambda: 1)


class SafeAggregator(EndingLines, AttendanceRounds, SecureRounds, Aggregator):
    """The stock aggregator, plus: a failed round, a round past ``round_timeout`` seconds (unless ``min_sites``
    sites answered: then it is aggregated without the others, named and not waited for later: :mod:`.attendance`)
    or a site's failed task stops the federation cleanly with exit code 3; the sites' evaluations are recorded
    per site; one evaluation-only round follows the ``rounds_to_train`` training rounds (:mod:`.ending`)."""

    seen: set[str]
    quit_since: float | None
    best_model_score: float | None  # OpenFL's
    collaborator_tasks_results: dict[Any, Any]  # OpenFL's

    def __init__(self, run_config: dict[str, Any] | None = None, model_shape: dict[str, int] | None = None,
                 report_dir: str = "save", round_timeout: float | None = DEFAULT_ROUND_TIMEOUT,
                 min_sites: int | None = None, rounds_to_train: int = 1, **kwargs: Any) -> None:
        self.failure: str | None = None  # set before super(): recovery may replay a round end
        self.absent: set[str] = set()  # sites that did not answer in the last round that ended
        from ..threads import apply_threads

        self.threads = apply_threads()  # its launcher's share (`fedcontrast federation`), else the cores it may use
        logger.info("%s", self.threads.line())
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
            # Secure aggregation: the relay between the sites (openfl/secure.py), which the aggregation sums through.
            secure = config.secure_aggregation  # its graph from the plan and run every site holds (secagg_graph.py)
            self.relay = None if secure is None else relay_for(site_names(config), secure, SumLayout.of(
                *declared_uploads(config, model_shape or {}, kwargs.get("assigner")), secure),
                config.to_dict(), str(kwargs.get("federation_uuid", "")))
        except FedContrastError as exc:
            print(f"fedcontrast aggregator: error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        grpc_bounds.MAX_MESSAGE_BYTES = min(self.max_upload_bytes + MESSAGE_ALLOWANCE,
                                            grpc_common.MAX_MESSAGE_LENGTH_BYTES)
        self.round_timeout = float(round_timeout) if round_timeout else None
        self.min_sites = min_sites
        if self.relay is not None:  # a site that withdraws counts against min_sites as a silent one does
            self.relay.at_least = min_sites or len(site_names(config))
        callbacks = list(kwargs.pop("callbacks", None) or [])  # the stock default is a shared list
        callbacks.append(self.report)
        # Set before super(): recovery may replay a whole round (its uploads were saved, its end was not).
        self.lock = threading.RLock()  # the straggler timer, the watchdog and task results share it
        self.link = aggregation.open_link(report_dir, self.relay)  # shared with the aggregation function
        self.round_started, self.round_open, self.quit_since = time.monotonic(), False, None
        try:
            # rounds_to_train + the evaluation round
            super().__init__(callbacks=callbacks, rounds_to_train=rounds_to_train + 1, **kwargs)
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
        if kind_of(task_name, SECAGG_TASK) is not None:  # a secure-aggregation message, for the relay
            return self.secure_message(collaborator_name, round_number, task_name, named_tensors)
        notice = self.stop_notice(collaborator_name)
        if notice is not None:  # the federation stopped before this upload came: not taken; the sender is told why
            raise FederationStopped(notice)
        if (said := failure_sentence(named_tensors, self.tensor_codec)) is not None:  # never persisted (a restart
            # starts afresh); the site's sentence travels in its failure metric
            with self.lock:
                self.absent.add(collaborator_name)
                self._fail(f"collaborator {collaborator_name} reported that its task {task_name!r} failed in round "
                           f"{round_number + 1}: {said}")
            return
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
            self.end_secure_round()  # sites dropped from the secure sum never answer: not waited for

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
                                   round_number + 1, site, tensor_key.tensor_name, value)
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
            self._fail(f"round {round_number + 1} could not be aggregated: {type(exc).__name__}: {exc}")
            logger.exception("aggregation failure")
            return
        if self.round_number != round_number:  # the round ended: the next one's clock starts
            self.absent = set(missing)
            self.round_started, self.round_open = time.monotonic(), False
        if self.link.stop:
            reasons = "; ".join(self.link.stop)
            self.link.stop.clear()
            self._fail(f"rejected upload(s): {reasons}; the round was aggregated without them and the federation "
                       "stops so that the operator can look at the sender (robustness.on_rejected: stop)")

    def _watchdog(self) -> None:
        """End (or, with ``min_sites``, close without the silent sites) a round past ``round_timeout``."""
        timeout = self.round_timeout
        if timeout is None:  # started only with a round_timeout
            return
        while True:
            time.sleep(0.5)
            with self.lock:
                if self.failure is not None or self._time_to_quit():
                    return
                self._note_waiting()
                if time.monotonic() - self.round_started <= timeout:
                    continue
                if self.secure_deadline():  # a secure-aggregation phase closed without its silent sites
                    continue
                done = [c for c in self.authorized_cols if c in self.collaborators_done]
                missing = [c for c in self.authorized_cols if c not in done]
                label = "the evaluation round" if self.round_number == self.rounds_to_train - 1 else \
                    f"round {self.round_number + 1}"
                if self.min_sites is not None and done and len(done) >= self.min_sites:
                    logger.warning("%s: no answer from %s within %.0f s; aggregated without them (min_sites %d)",
                                   label, ", ".join(missing), self.round_timeout, self.min_sites)
                    self.drop_silent(missing)  # its stragglers, left out of the later rounds too
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
        another name, or not the one signed here for ``name``:
        :class:`fedcontrast.openfl.enrolment.EnrolledCertificates`), in one sentence, also logged (once a
        minute per name and reason); None when it may."""
        enrolment = getattr(self, "enrolment", None)
        if enrolment is None or getattr(self, "single_col_cert_common_name", None):
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
        return done and self.ended()  # where the outputs are (openfl/ending.py)
