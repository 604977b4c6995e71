"""The simulator's sites on Ray: a round's sites run as Ray tasks, on any core, GPU or machine of a Ray
cluster; everything else (the round loop, aggregation, evaluation, checkpoints, outputs) stays
the simulator's own, on the driver.

A site's task depends only on the configuration, the site's state and what it received, so a run on
Ray equals the sequential run at the same threads per site, bit for bit on the CPU. What travels:

* the configuration, once (``ray.put``); each worker process builds the federation's data from it
  (its shards, test and public sets) once and keeps it: no file is shared with the driver;
* per round, the global downlink once (``ray.put``) and each site's personal part;
* each site's state (MOON's previous model, personal heads, DP accountants) to its task and back.

A round's sites go out as two tasks per site slot of the cluster (a slot: ``site_cpus`` CPUs, and
``site_gpus`` of a GPU where used), or tasks of about ``executor.sites_per_task`` sites, each task
running its group of sites one after another in one worker process (the model and data built once per
process, each site's state swapped in), groups balanced by samples: Ray's cost per task (a few
milliseconds) is then paid a few times per round, not once per site. Each site measures its uploads
for the aggregator's screen where it trains (digest, sketch, update norm: ``SiteOutcome.measured``), so
that the driver does not.

A worker that dies mid-task is retried once (Ray's ``max_retries``: the same inputs give the same
result). If it dies again, each site of the task is sent alone (retried once too), so that a second
death names the site at fault and stops the run, with every finished round kept (the checkpoint is
written after each round). A task's own error stops the run as in the sequential engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from ..config import RunConfig
from ..errors import ConfigError, FedContrastError
from .transfer import pack, pack_flat, unpack

logger = logging.getLogger(__name__)


class SiteTaskFailed(FedContrastError):
    """A site's task could not be run on the cluster (its worker died twice); names the site."""


class _WorkerDied(Exception):
    """A task of several sites lost its worker twice: its sites are sent again one by one."""


TASKS_PER_SLOT = 2  # Ray tasks per site slot and round: few enough to cost little, enough to balance

def ray_module():
    """``ray``, or one sentence saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError("executor ray needs Ray, which is not installed: pip install -e \".[ray]\" "
                          "(or pip install 'ray==2.60.*')") from None
    return ray


# --- on the worker -------------------------------------------------------------------------------------
def train_sites_task(config: dict[str, Any], round_num: int, received: dict[str, torch.Tensor],
                     jobs: list[tuple[int, dict[str, torch.Tensor], dict[str, Any]]], threads: int):
    """The Ray task: the round of a few sites, one after another on one worker. ``jobs`` holds each
    site's ``(index, personal downlink, state)``. Returns their :class:`~.federation.SiteOutcome` objects
    (tensors on the CPU, for the trip back), the Ray node that ran them and the seconds they took."""
    start = time.perf_counter()
    torch.set_num_threads(threads)
    from .federation import worker_federation

    federation = worker_federation(config)
    device = federation.device
    shared = unpack(received, device)
    outcomes = []
    for index, personal, state in jobs:
        outcome = federation.train_away(index, round_num, {**shared, **unpack(personal, device)}, unpack(state),
                                        reference=shared)  # the site measures its uploads for the screen here
        outcome.uploads, outcome.state = pack_flat(outcome.uploads), pack(outcome.state)  # an upload: one array
        outcome.measured = pack(outcome.measured)
        outcomes.append(outcome)
    return outcomes, _node_id(), time.perf_counter() - start


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"  # "local": a direct call


def plan_tasks(sites: list, tasks: int, fixed: int = 32) -> list[list]:
    """``sites`` in at most ``tasks`` groups of about equal work (the heaviest first, each to the
    lightest group; a site's work: its samples plus ``fixed`` for what every site costs, such as
    building its optimiser): fewer, larger Ray tasks cost less per site than one task per site."""
    groups: list[list] = [[] for _ in range(max(1, min(tasks, len(sites))))]
    loads = [0] * len(groups)
    for site in sorted(sites, key=lambda s: (-len(s.data), s.index)):
        i = min(range(len(groups)), key=loads.__getitem__)
        groups[i].append(site)
        loads[i] += len(site.data) + fixed
    return [sorted(g, key=lambda s: s.index) for g in groups if g]


# --- on the driver -------------------------------------------------------------------------------------
class RayExecutor:
    """Dispatches a round's sites as Ray tasks (``executor.kind: ray``). Joins the cluster at
    ``executor.address``, else starts a local Ray on ``executor.cpus`` cores (default: all) and stops
    it in :meth:`close`. ``progress(done, total)`` is called as sites finish."""

    name = "ray"

    def __init__(self, config: RunConfig, *, progress: Callable[[int, int], None] | None = None) -> None:
        ray = self.ray = ray_module()
        spec = config.executor
        self.threads = spec.threads or 1
        self.progress = progress
        self.started = False
        self.nodes: set[str] = set()  # the Ray nodes that have run sites
        if not ray.is_initialized():
            check_ray_token()  # a token Ray would refuse or choke on: one sentence, before Ray starts
        if spec.address and not ray.is_initialized():
            _check_reachable(spec.address)
        try:
            if not ray.is_initialized():
                with _quiet_stderr():  # Ray logs each retry of a failing connection: we say what failed, once
                    self._init(ray, spec)
                self.started = True
        except ConnectionError as exc:
            if "InvalidAuthToken" in str(exc.__cause__) or "AuthenticationError" in str(exc.__cause__):
                raise ConfigError(f"the Ray cluster at {spec.address} refused this machine: it asks for its token; set "
                                  "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH to a copy of the cluster's token file "
                                  "(`ray get-auth-token` on its head)") from None
            raise ConfigError(f"cannot reach the Ray cluster at {spec.address}: {str(exc).splitlines()[0]}; start its "
                              "head with `ray start --head` or leave executor.address out for a local Ray") from None
        except (ValueError, RuntimeError) as exc:
            raise ConfigError(f"cannot start Ray (executor.address {spec.address!r}): "
                              f"{str(exc).splitlines()[0]}") from None
        except Exception as exc:
            if type(exc).__name__ != "AuthenticationError":  # ray.exceptions.AuthenticationError: its token refused
                raise
            raise ConfigError(f"Ray refused this machine's token (executor.address {spec.address!r}): "
                              f"{str(getattr(exc, 'message', exc)).splitlines()[0]}; use the cluster's token "
                              "(RAY_AUTH_TOKEN_PATH: a copy of `ray get-auth-token` on its head)") from None
        total = ray.cluster_resources()
        cpus, gpus = total.get("CPU", 0), total.get("GPU", 0)
        if cpus < self.threads:
            self.close()
            raise ConfigError(f"the Ray cluster has {cpus:g} CPU(s), fewer than one site needs "
                              f"(executor.site_cpus {self.threads})")
        self.site_gpus = spec.site_gpus if (gpus > 0 and config.device != "cpu") else 0.0
        self.config_ref, self.config_of = None, None  # the run's configuration, put once per run
        self.slots = max(1, int(cpus // self.threads))  # sites that run at once
        if self.site_gpus:
            self.slots = min(self.slots, max(1, int(gpus / self.site_gpus)))
        self.remote = self.remote_of(train_sites_task)
        self.isolated: set = set()  # tasks of one site, sent again after their group's worker died twice
        self.last_round: dict[str, Any] = {}
        self.last_tasks: dict[str, Any] = {}  # how the last round's sites went out (summary())
        where = spec.address or f"local, {cpus:g} CPUs"
        print(f"executor: ray ({where}{f', {gpus:g} GPUs' if gpus else ''}); each site {self.threads} CPU thread(s)"
              f"{f', {self.site_gpus:g} GPU' if self.site_gpus else ''}; {self.slots} site(s) at once",
              file=sys.stderr, flush=True)

    @staticmethod
    def _init(ray, spec) -> None:
        if spec.address:
            ray.init(address=spec.address, logging_level=logging.ERROR, log_to_driver=False, include_dashboard=False)
        else:
            ray.init(num_cpus=spec.cpus or os.cpu_count() or 1, num_gpus=torch.cuda.device_count(),
                     logging_level=logging.ERROR, log_to_driver=False, include_dashboard=False)

    def remote_of(self, task: Callable[..., Any]):
        """``task`` as this executor runs a site: its CPUs and GPU share, one retry if its worker dies
        (the same inputs give the same result), none for the task's own errors."""
        return self.ray.remote(task).options(num_cpus=self.threads, num_gpus=self.site_gpus, max_retries=1,
                                             retry_exceptions=False)

    def train_sites(self, federation, sites, round_num: int) -> dict[str, Any]:
        """Every selected site's round; outcomes by site name."""
        return self.collect(self.start(federation, sites, round_num))

    def tasks_for(self, config: RunConfig, sites: int) -> int:
        """How many Ray tasks a round of ``sites`` sites goes out as: about ``sites_per_task`` sites each
        where the plan sets it, else :data:`TASKS_PER_SLOT` per site slot of the cluster."""
        per_task = config.executor.sites_per_task
        return -(-sites // per_task) if per_task else TASKS_PER_SLOT * self.slots

    def summary(self) -> dict[str, Any]:
        """What the run's summary.json records of this executor: its site slots and how the last round's
        sites went out (tasks, sites per task)."""
        return {"kind": "ray", "site_slots": self.slots, **self.last_tasks}

    def start(self, federation, sites, round_num: int) -> dict[str, Any]:
        """Sends round ``round_num`` of ``sites`` as Ray tasks of a group of sites each (:meth:`tasks_for`;
        groups balanced by :func:`plan_tasks`; each trains its sites one after another in one worker
        process, on the federation that process built once) and returns at once: a handle for
        :meth:`collect`."""
        ray = self.ray
        if self.config_of is not federation.config:  # `compare` runs several configurations on one executor
            self.config_ref, self.config_of = ray.put(federation.config.to_dict()), federation.config
        received = ray.put(pack(federation.downlink.global_tensors))

        def send(group, isolated=False):
            return self._submit(federation, group, round_num, received, isolated=isolated)

        groups = plan_tasks(sites, self.tasks_for(federation.config, len(sites)))
        self.last_tasks = {"sites_per_task": federation.config.executor.sites_per_task or "automatic",
                           "tasks_per_round": len(groups), "most_sites_in_a_task": max(map(len, groups), default=0)}
        pending = {send(group): group for group in groups}
        return {"pending": pending, "send": send, "sites": len(sites), "round": round_num,
                "device": federation.device, "start": time.perf_counter()}

    def collect(self, handle: dict[str, Any]) -> dict[str, Any]:
        """The outcomes of the sites sent by :meth:`start`, as they finish (with the progress bar)."""
        ray, pending, total = self.ray, handle["pending"], handle["sites"]
        outcomes: dict[str, Any] = {}
        seconds: list[float] = []
        if self.progress is not None:
            self.progress(0, total)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            group = pending.pop(ready[0])
            try:
                done, node, took = self._result(ready[0], group, handle["round"])
            except _WorkerDied:  # the group's worker died twice: each site on its own, to name the one at fault
                for site in group:
                    pending[handle["send"]([site], True)] = [site]
                continue
            self.nodes.add(node)
            seconds.append(took)
            for outcome in done:  # as each task returns, while the others still train: off the round's path
                outcome.uploads, outcome.state = unpack(outcome.uploads, handle["device"]), unpack(outcome.state)
                outcome.measured = unpack(outcome.measured)
            outcomes.update((site.name, outcome) for site, outcome in zip(group, done))
            if self.progress is not None:
                self.progress(len(outcomes), total)
        self.last_round = {"seconds": time.perf_counter() - handle["start"], "task_seconds": seconds}
        return outcomes

    def cancel(self, handle: dict[str, Any]) -> None:
        """Stops the tasks of a handle whose round will not be collected."""
        for ref in handle["pending"]:
            self.ray.cancel(ref, force=True)

    def _submit(self, federation, group, round_num: int, received, *, isolated: bool = False):
        personal = federation.downlink.personal
        jobs = [(site.index, pack(personal.get(site.name, {})), pack(site.state)) for site in group]
        ref = self.remote.remote(self.config_ref, round_num, received, jobs, self.threads)
        if isolated:
            self.isolated.add(ref)
        return ref

    def _result(self, ref, group, round_num: int):
        ray = self.ray
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as exc:  # the task's own error: raised as in the sequential engine
            cause = getattr(exc, "cause", None)
            raise (cause if isinstance(cause, BaseException) else exc.as_instanceof_cause()) from None
        except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError, ray.exceptions.RaySystemError,
                ray.exceptions.ObjectLostError) as exc:
            if len(group) > 1 or ref not in self.isolated:
                raise _WorkerDied from None
            raise SiteTaskFailed(f"site {group[0].name}'s task of round {round_num} failed twice on the Ray "
                                 f"cluster (its worker died: {type(exc).__name__}); the run stops here, every "
                                 "finished round is kept: continue with --resume") from None

    def close(self) -> None:
        if self.nodes:
            print(f"executor: sites ran on {len(self.nodes)} Ray node(s)", file=sys.stderr, flush=True)
            self.nodes = set()
        if self.started:
            self.started = False
            self.ray.shutdown()


def check_ray_token(environ: Any = None) -> None:
    """Under ``RAY_AUTH_MODE=token``, the token Ray will present — ``RAY_AUTH_TOKEN``, else the file
    ``RAY_AUTH_TOKEN_PATH``, else Ray's ``~/.ray/auth_token`` — exists, can be read and is one
    non-empty line; else one sentence naming it (Ray itself ends in a traceback)."""
    from pathlib import Path

    environ = os.environ if environ is None else environ
    if str(environ.get("RAY_AUTH_MODE", "")).strip().lower() != "token":
        return
    fix = "copy the cluster's token there (`ray get-auth-token` on its head), or unset RAY_AUTH_MODE for a local Ray"
    if "RAY_AUTH_TOKEN" in environ:
        if not str(environ["RAY_AUTH_TOKEN"]).strip():
            raise ConfigError("RAY_AUTH_MODE=token, but RAY_AUTH_TOKEN is set and empty: set it to the cluster's token "
                              "(`ray get-auth-token` on its head), or unset it to use a token file")
        return
    given = environ.get("RAY_AUTH_TOKEN_PATH")
    path = Path(given or Path.home() / ".ray" / "auth_token").expanduser()
    where = f"the token file {path} ({'RAY_AUTH_TOKEN_PATH' if given else 'Ray default'})"
    if not path.is_file():
        raise ConfigError(f"RAY_AUTH_MODE=token, but {where} "
                          f"{'is not a file' if path.exists() else 'does not exist'}: {fix}")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"RAY_AUTH_MODE=token, but {where} cannot be read ({exc.strerror or exc}): make it "
                          "readable by this user") from None
    try:
        words = data.decode("ascii").split()
    except UnicodeDecodeError:
        words = None
    if not words:
        raise ConfigError(f"RAY_AUTH_MODE=token, but {where} is "
                          f"{'empty' if not data.strip() else 'not a token (not text)'}: {fix}")
    if len(words) != 1:
        raise ConfigError(f"RAY_AUTH_MODE=token, but {where} holds {len(words)} words, not one token: {fix}")


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """A Ray address (``HOST:PORT`` of its head's GCS, or ``ray://HOST:PORT``) that answers a TCP
    connection within ``timeout`` seconds; else one sentence (Ray itself would retry for minutes)."""
    import socket

    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"executor.address must be HOST:PORT of the Ray cluster's head (e.g. 10.0.0.1:6379), "
                          f"got {address!r}")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ConfigError(f"cannot reach the Ray cluster at {address}: {exc.strerror or exc}; start its head with "
                          "`ray start --head` there, or leave executor.address out for a local Ray") from None


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null for the block (Ray's C++ core writes there directly)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def make_executor(config: RunConfig, *, progress: Callable[[int, int], None] | None = None):
    """The executor ``config.executor`` names."""
    from .federation import SequentialExecutor

    if config.executor.kind == "ray":
        return RayExecutor(config, progress=progress)
    if config.executor.kind == "flower":
        raise ConfigError("the flower executor runs the round loop inside a Flower ServerApp: use `fedcontrast "
                          "simulate --executor flower` (or fedcontrast.sim.flower_executor.run_on_flower); compare "
                          "runs on the sequential or ray executor")
    return SequentialExecutor()


class Threads:
    """``torch.set_num_threads(n)`` for the length of a run (n None: unchanged), then back."""

    def __init__(self, n: int | None) -> None:
        self.n, self.before = n, torch.get_num_threads()

    def __enter__(self) -> Threads:
        if self.n is not None:
            torch.set_num_threads(self.n)
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.set_num_threads(self.before)


def site_progress(stream=sys.stderr) -> Callable[[int, int], None]:
    """A one-line progress bar of a round's sites (sites done / sites), redrawn in place."""
    start = [time.monotonic()]

    def show(done: int, total: int) -> None:
        if done == 0:  # the round's sites were just sent
            start[0] = time.monotonic()
        width = 20
        filled = int(width * done / max(total, 1))
        stream.write(f"\r  sites [{'#' * filled}{'.' * (width - filled)}] {done}/{total}"
                     f" {time.monotonic() - start[0]:.1f} s" + ("\n" if done == total else ""))
        stream.flush()

    return show
