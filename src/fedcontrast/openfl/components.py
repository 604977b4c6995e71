"""Aggregator and collaborator classes for the plan (``aggregator.template``/``collaborator.template``).

OpenFL 1.9 hangs when an aggregation function raises, retries an unreachable aggregator forever and
saves ``last.pbuf`` from the model that went *into* the last round. These subclasses change only
that: a failed round ends the federation (aggregator exit code 3, every collaborator told to stop
with a reason), collaborators give up after a bounded number of retries with one clear sentence,
and every round's true global model is exported and evaluated.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import torch
from openfl.callbacks import Callback
from openfl.component.aggregator.aggregator import Aggregator
from openfl.component.collaborator.collaborator import Collaborator
from openfl.utilities import TensorKey

from ..algorithms import Downlink, ServerContext, load_weights
from ..algorithms.base import WEIGHT_PREFIX
from ..atomic import atomic_torch_save
from ..config import RunConfig
from ..construction import build_algorithm, initial_model, load_splits, resolve_device, server_seed
from ..errors import FedContrastError
from ..evaluation import local_model_accuracy
from . import aggregation
from .packing import GLOBAL_PACKED, PERSONAL_PACKED, pack, unpack
from .runner import PERSONAL_TAG

logger = logging.getLogger(__name__)

FAILURE_SLEEP_CODE = 97  # sent in GetTasksResponse.sleep_time with quit: "the federation failed"
FAILURE_EXIT_CODE = 3
ROUNDS_FILE = "rounds.jsonl"
FINAL_MODEL = "final_model.pt"
FINAL_DOWNLINK = "final_downlink.pt"

# OpenFL calls Aggregator._get_sleep_time() through the class name, so a subclass override would be
# ignored; it tells an idle collaborator to sleep 10 s. One second keeps rounds moving (an int is
# required: it travels in an int32 protobuf field).
Aggregator._get_sleep_time = staticmethod(lambda: 1)


class RoundReport(Callback):
    """After each round: export the new global model (a torch state_dict) and evaluate it on the
    test split when this machine has it; one JSON line per round in ``rounds.jsonl``."""

    def __init__(self, config: RunConfig, model_shape: dict[str, int], out_dir: str | Path) -> None:
        super().__init__()
        self.config = config
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.algorithm = build_algorithm(config)
        device = resolve_device(config.device)
        self.model = initial_model(config, **model_shape).to(device)
        self.global_specs = [s for s in self.algorithm.download_specs(self.model, model_shape["num_classes"])
                             if not s.per_site]
        self.server = ServerContext(model=self.model, round_num=0, seed=server_seed(config, 0), device=device,
                                    num_classes=model_shape["num_classes"])
        try:
            splits = load_splits(config)
            self.test = splits.test
            self.server.public = splits.public  # labelled: linear probes train on it here
        except FedContrastError as exc:  # e.g. the sites' own folders: no test data here
            logger.warning("no test data on the aggregator (%s): rounds are not evaluated here", exc)
            self.test = None

    def on_round_end(self, round_num: int, logs: dict | None = None) -> None:
        tensors = self.tensor_db.get_tensors_by_round_and_tags(round_num + 1, ("model",))
        packed = next(v for k, v in tensors.items() if k.tensor_name == GLOBAL_PACKED)
        weights = unpack(packed, self.global_specs)
        atomic_torch_save(weights, self.out_dir / FINAL_DOWNLINK)  # everything the sites receive (e.g. prototypes)
        if any(name.startswith(WEIGHT_PREFIX) for name in weights):
            load_weights(self.model, weights)
            atomic_torch_save(self.model.state_dict(), self.out_dir / FINAL_MODEL)
        record: dict[str, Any] = {"round": round_num + 1, "rounds": self.config.rounds, "time": time.time()}
        if self.test is not None:
            record.update(self.algorithm.evaluate(Downlink(weights), self.server, self.test))
            if aggregation.LOCAL_MODELS:  # the sites' local models (the aggregator does not know their label
                # distributions, so only the balanced accuracy; the simulator also reports the weighted one)
                record.update(local_model_accuracy(self.model, aggregation.LOCAL_MODELS, self.test, self.server.device))
                aggregation.LOCAL_MODELS.clear()
                load_weights(self.model, weights)
        record["site_metrics"] = {k: float(v) for k, v in (logs or {}).items()}
        with open(self.out_dir / ROUNDS_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")
        logger.info("round %d/%d: global test accuracy %s", round_num + 1, self.config.rounds,
                    f"{record['accuracy']:.4f}" if "accuracy" in record else "n/a")


class SafeAggregator(Aggregator):
    """The stock aggregator, plus: a failed round stops the federation cleanly with exit code 3."""

    def __init__(self, run_config: dict[str, Any] | None = None, model_shape: dict[str, int] | None = None,
                 report_dir: str = "save", **kwargs: Any) -> None:
        self.failure: str | None = None  # set before super(): recovery may replay a round end
        callbacks = list(kwargs.pop("callbacks", None) or [])  # the stock default is a shared list
        config = RunConfig.from_dict(run_config or {})
        callbacks.append(RoundReport(config, model_shape or {}, report_dir))
        super().__init__(callbacks=callbacks, **kwargs)
        aggregation.PERSONAL_DIR = report_dir
        self._serve_personal_downlinks(config, model_shape or {}, report_dir)

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
                                   num_classes=shape["num_classes"], sites=list(self.authorized_cols))
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
        super()._save_model(round_number, file_path)

    def _end_of_round_check(self):
        if self.failure is not None:
            return
        round_number = self.round_number
        try:
            super()._end_of_round_check()
        except Exception as exc:  # raised inside an aggregation function or a callback
            self._fail(f"round {round_number} could not be aggregated: {type(exc).__name__}: {exc}")
            logger.exception("aggregation failure")
            return
        if aggregation.REJECTED:
            reasons = "; ".join(aggregation.REJECTED)
            aggregation.REJECTED.clear()
            self._fail(f"round {round_number} was aggregated without rejected upload(s) ({reasons}); "
                       "the federation stops so that the operator can look at the sender")

    def _fail(self, reason: str) -> None:
        self.failure = reason
        logger.error("federation stopped: %s", reason)
        self.rounds_to_train = self.round_number  # every collaborator is now told to quit

    def get_tasks(self, collaborator_name):
        tasks, round_number, sleep_time, time_to_quit = super().get_tasks(collaborator_name)
        if time_to_quit and self.failure is not None:
            sleep_time = FAILURE_SLEEP_CODE
        return tasks, round_number, sleep_time, time_to_quit

    def all_quit_jobs_sent(self) -> bool:  # polled by the server's main thread
        done = super().all_quit_jobs_sent()
        if done and self.failure is not None:
            time.sleep(1)  # let the last quit message reach its collaborator
            print(f"fedcontrast aggregator: error: federation stopped: {self.failure}", file=sys.stderr, flush=True)
            raise SystemExit(FAILURE_EXIT_CODE)
        return done


def explain_rpc_error(error: grpc.RpcError, uri: str) -> tuple[str, bool]:
    """One sentence for a failed call to the aggregator, and whether retrying can help."""
    code = error.code() if hasattr(error, "code") else None
    details = (error.details() if hasattr(error, "details") else "") or ""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return (f"the aggregator at {uri} refused this collaborator: its name is not in the aggregator's "
                f"plan/cols.yaml or does not match its certificate ({details.strip()})", False)
    if "does not match aggregator UUID" in details or "federation" in details.lower():
        return (f"this collaborator's plan differs from the aggregator's at {uri} (another federation id): "
                "use the exact plan/plan.yaml that the aggregator initialised", False)
    if code == grpc.StatusCode.UNAVAILABLE:
        return (f"cannot reach the aggregator at {uri}: it is not running, the address is wrong, or the TLS "
                "handshake failed (for example a certificate signed by another CA, or no client certificate)", True)
    return f"the aggregator at {uri} answered {code}: {details.strip()}", True


class CollaboratorStopped(SystemExit):
    """Ends ``fx collaborator start`` with a message and a non-zero code."""


class BoundedRetry:
    """Replaces the client's endless retry sleep: gives up after ``max_attempts`` failures in a row,
    and at once when retrying cannot help (refused identity, another federation)."""

    def __init__(self, interval: float, uri: str, max_attempts: int) -> None:
        self.reconnect_interval, self.uri, self.max_attempts = interval, uri, max_attempts
        self.failures = 0

    def sleep(self) -> None:
        error = sys.exc_info()[1]  # called inside the client's `except grpc.RpcError` block
        message, retryable = (explain_rpc_error(error, self.uri) if isinstance(error, grpc.RpcError)
                              else (f"lost the aggregator at {self.uri}: {error}", True))
        self.failures += 1
        if not retryable or self.failures > self.max_attempts:
            suffix = "" if not retryable else f" (gave up after {self.max_attempts} retries)"
            raise CollaboratorStopped(f"fedcontrast collaborator: error: {message}{suffix}")
        logger.warning("%s; retry %d/%d", message, self.failures, self.max_attempts)
        time.sleep(self.reconnect_interval)


class SafeCollaborator(Collaborator):
    """The stock collaborator with bounded retries and an explained exit when the federation fails."""

    def __init__(self, max_retries: int = 30, poll_interval: float = 0.05, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # The aggregator can only say "sleep N whole seconds" when it has no task yet; a site that
        # finished early would then start the next round up to a second late. Asking again sooner
        # costs one small gRPC call.
        self.poll_interval = poll_interval
        policy = self.client.sleeping_policy
        self.client.sleeping_policy = BoundedRetry(policy.reconnect_interval, policy.uri, max_retries)

    def run(self) -> None:  # Collaborator.run of OpenFL 1.9, plus the lines marked below
        self.callbacks.on_experiment_begin()
        while True:
            tasks, round_number, sleep_time, time_to_quit = self.client.get_tasks()
            self.client.sleeping_policy.failures = 0  # added: a successful call resets the budget
            if time_to_quit:
                if sleep_time == FAILURE_SLEEP_CODE:  # added: the aggregator stopped the federation
                    raise CollaboratorStopped("fedcontrast collaborator: error: the aggregator stopped the "
                                              "federation after a failed round; see the aggregator's log")
                break
            if not tasks:
                time.sleep(min(sleep_time, self.poll_interval))  # changed: see poll_interval
                continue
            logger.info("Round: %d Received Tasks: %s", round_number, tasks)
            self.callbacks.on_round_begin(round_number)
            logs = {}
            for task in tasks:
                logs.update(self.do_task(task, round_number))
            self.tensor_db.clean_up(self.db_store_rounds)
            self.callbacks.on_round_end(round_number, logs)
        self.callbacks.on_experiment_end()
        logger.info("Received shutdown signal. Exiting...")
