"""The collaborator of the plan (``collaborator.template``): OpenFL's, plus a bounded wait for an
unreachable aggregator (with back-off), quiet polling logs, and one sentence when a task fails."""

from __future__ import annotations

import logging
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from openfl.component.collaborator.collaborator import Collaborator
from openfl.utilities import TensorKey

from ..deploy.certificates import (
    check_aggregator_certificate,
    check_certificate_dates,
    check_certificate_name,
    check_own_certificate,
)
from ..errors import FedContrastError
from .ending import site_outputs
from .plan import DEFAULT_RECONNECT_INTERVAL_MAX, DEFAULT_WAIT_FOR_AGGREGATOR, check_wait_settings
from .protocol import (
    FAILURE_METRIC,
    FAILURE_SLEEP_CODE,
    SECAGG_REFUSED,
    STOPPED,
    WAITING_NOTICE_S,
    CollaboratorStopped,
    failure_values,
)
from .startup_checks import check_settings_in_effect

# one logger for the plan's components, as log lines name it
logger = logging.getLogger("fedcontrast.openfl.components")

def explain_rpc_error(error: grpc.RpcError, uri: str) -> tuple[str, bool]:
    """One sentence for a failed call to the aggregator, and whether retrying can help."""
    code = error.code() if hasattr(error, "code") else None
    details = (error.details() if hasattr(error, "details") else "") or ""
    if code == grpc.StatusCode.ABORTED and details.startswith(STOPPED):  # SafeAggregator.stop_notice's sentence
        return details.strip(), False
    if code == grpc.StatusCode.ABORTED and details.startswith(SECAGG_REFUSED):  # dropped from a secure sum
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
    if code == grpc.StatusCode.UNAVAILABLE and "connection refused" in details.lower():  # nothing listens there:
        # not a TLS matter (a site started after its federation finished meets this)
        return f"the aggregator at {uri} is not listening (it may have finished or not started yet)", True
    if code == grpc.StatusCode.UNAVAILABLE and "dns resolution failed" in details.lower():
        return (f"the aggregator's host {uri.rpartition(':')[0]} does not resolve (DNS): check the plan's agg_addr "
                "and this machine's network", True)
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
        error: Any = sys.exc_info()[1]  # called inside the client's `except grpc.RpcError` block
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
            raise CollaboratorStopped(f"fedcontrast collaborator: error: {message} (gave up after "
                                      f"{_duration(elapsed)}: the plan's wait_for_aggregator is "
                                      f"{_duration(self.wait)})")
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
        client: Any = kwargs.get("client")
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
        if kwargs.get("federation_uuid") and self.task_runner is not None:  # the run its site report is kept under
            self.task_runner.federation_id = str(kwargs["federation_uuid"])
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
        if getattr(getattr(self.task_runner, "config", None), "secure_aggregation", None) is not None:
            from .secure import OpenFLChannel  # the site's side of the secure sum, over this client

            try:
                self.task_runner.secure_channel = OpenFLChannel(self)
            except (FedContrastError, OSError, ValueError) as exc:
                raise CollaboratorStopped("fedcontrast collaborator: error: "
                                          f"secure aggregation cannot start: {exc}") from None

    # A copy of OpenFL 1.9's Collaborator.run (it has no hook for these): the same loop, except the
    # places marked "added"/"changed" — a quit with FAILURE_SLEEP_CODE ends this site with the reason,
    # an idle wait is capped at poll_interval, a failing task goes to _task_failed, and the end names
    # this site's outputs (or says that the federation had finished before its first task).
    def run(self) -> None:
        self.callbacks.on_experiment_begin()
        worked = False  # added: told to quit before any task, the federation had finished already
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
            worked = True
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
        site_outputs(self, finished_already=not worked)  # added: where this site's outputs are

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
        reason = str(exc) if isinstance(exc, FedContrastError) else f"{type(exc).__name__}: {exc}"
        try:  # the sentence travels in the failure metric: the aggregator names it to the operator and every site
            key = TensorKey(FAILURE_METRIC, self.collaborator_name, round_number, True, ("metric",))
            self.client.send_local_task_results(round_number, name, -1,
                                                [self.nparray_to_named_tensor(key, failure_values(reason))])
        except (Exception, CollaboratorStopped):  # the aggregator may be gone, or stopped already: this site's own
            # failure is what it reports (a gone aggregator's round timeout covers the rest)
            logger.debug("could not tell the aggregator about the failure", exc_info=True)
        raise CollaboratorStopped(f"fedcontrast collaborator: error: task {name!r} of round {round_number + 1} failed: "
                                  f"{reason}{where}") from None
