"""The simulator's sites on Ray: each site's work of a round is one Ray task, on any core, GPU or machine
of a Ray cluster; everything else (the round loop, aggregation, evaluation, checkpoints, outputs) stays
the simulator's own, on the driver.

A site's task depends only on the configuration, the site's state and what it received, so a run on
Ray equals the sequential run at the same threads per site, bit for bit on the CPU. What travels:

* the configuration, once (``ray.put``); each worker process builds the federation's data from it
  (its shards, test and public sets) once and keeps it: no file is shared with the driver;
* per round, the global downlink once (``ray.put``) and each site's personal part;
* each site's state (MOON's previous model, personal heads, DP accountants) to its task and back.

A worker that dies mid-task is retried once (Ray's ``max_retries``: the same inputs give the same
result); a second death, or a task's own error, stops the run naming the site, with every finished
round kept (the checkpoint is written after each round).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from ..config import RunConfig
from ..errors import ConfigError, FedContrastError

logger = logging.getLogger(__name__)


class SiteTaskFailed(FedContrastError):
    """A site's task could not be run on the cluster (its worker died twice); names the site."""


def ray_module():
    """``ray``, or one sentence saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError("executor ray needs Ray, which is not installed: pip install -e \".[ray]\" "
                          "(or pip install 'ray==2.60.*')") from None
    return ray


# --- on the worker -------------------------------------------------------------------------------------
_FEDERATIONS: dict[str, Any] = {}  # one federation per configuration, per worker process


def _worker_federation(config: dict[str, Any]):
    from .federation import Federation

    key = json.dumps(config, sort_keys=True)
    if key not in _FEDERATIONS:
        _FEDERATIONS.clear()  # one run at a time per worker: the previous run's data is dropped
        sequential = RunConfig.from_dict({**config, "executor": {"kind": "sequential"}})
        _FEDERATIONS[key] = Federation(sequential)
    return _FEDERATIONS[key]


def train_site_task(config: dict[str, Any], site_index: int, round_num: int, received: dict[str, torch.Tensor],
                    personal: dict[str, torch.Tensor], state: dict[str, Any], threads: int):
    """The Ray task: one site's round on a worker. Returns its :class:`~.federation.SiteOutcome`
    (tensors on the CPU, for the trip back)."""
    torch.set_num_threads(threads)
    federation = _worker_federation(config)
    site = federation.sites[site_index]
    site.state = state
    device = federation.device
    outcome = federation.train_site(site, round_num, {k: v.to(device) for k, v in {**received, **personal}.items()})
    outcome.uploads = {k: v.cpu() for k, v in outcome.uploads.items()}
    outcome.state = _to_cpu(outcome.state)
    return outcome


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


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
        if spec.address and not ray.is_initialized():
            _check_reachable(spec.address)
        try:
            if not ray.is_initialized():
                if spec.address:
                    ray.init(address=spec.address, logging_level=logging.ERROR, log_to_driver=False,
                             include_dashboard=False)
                else:
                    ray.init(num_cpus=spec.cpus or os.cpu_count() or 1, num_gpus=torch.cuda.device_count(),
                             logging_level=logging.ERROR, log_to_driver=False, include_dashboard=False)
                self.started = True
        except ConnectionError as exc:
            raise ConfigError(f"cannot reach the Ray cluster at {spec.address}: {str(exc).splitlines()[0]}; start its "
                              "head with `ray start --head` or leave executor.address out for a local Ray") from None
        except (ValueError, RuntimeError) as exc:
            raise ConfigError(f"cannot start Ray (executor.address {spec.address!r}): "
                              f"{str(exc).splitlines()[0]}") from None
        total = ray.cluster_resources()
        cpus, gpus = total.get("CPU", 0), total.get("GPU", 0)
        if cpus < self.threads:
            self.close()
            raise ConfigError(f"the Ray cluster has {cpus:g} CPU(s), fewer than one site needs "
                              f"(executor.site_cpus {self.threads})")
        self.site_gpus = spec.site_gpus if (gpus > 0 and config.device != "cpu") else 0.0
        self.config_ref, self.config_of = None, None  # the run's configuration, put once per run
        self.remote = self.remote_of(train_site_task)
        where = spec.address or f"local, {cpus:g} CPUs"
        print(f"executor: ray ({where}{f', {gpus:g} GPUs' if gpus else ''}); each site {self.threads} CPU thread(s)"
              f"{f', {self.site_gpus:g} GPU' if self.site_gpus else ''}; {int(cpus // self.threads)} site(s) at once",
              file=sys.stderr, flush=True)

    def remote_of(self, task: Callable[..., Any]):
        """``task`` as this executor runs a site: its CPUs and GPU share, one retry if its worker dies
        (the same inputs give the same result), none for the task's own errors."""
        return self.ray.remote(task).options(num_cpus=self.threads, num_gpus=self.site_gpus, max_retries=1,
                                             retry_exceptions=False)

    def train_sites(self, federation, sites, round_num: int) -> dict[str, Any]:
        ray = self.ray
        if self.config_of is not federation.config:  # `compare` runs several configurations on one executor
            self.config_ref, self.config_of = ray.put(federation.config.to_dict()), federation.config
        downlink = federation.downlink
        received = ray.put({k: v.detach().cpu() for k, v in downlink.global_tensors.items()})
        pending = {}
        for site in sites:
            personal = {k: v.detach().cpu() for k, v in downlink.personal.get(site.name, {}).items()}
            ref = self.remote.remote(self.config_ref, site.index, round_num, received, personal, site.state,
                                     self.threads)
            pending[ref] = site
        outcomes, done = {}, 0
        if self.progress is not None:
            self.progress(0, len(sites))
        waiting = list(pending)
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1)
            site = pending[ready[0]]
            outcomes[site.name] = self._result(ready[0], site.name, round_num)
            done += 1
            if self.progress is not None:
                self.progress(done, len(sites))
        device = federation.device
        for outcome in outcomes.values():
            outcome.uploads = {k: v.to(device) for k, v in outcome.uploads.items()}
        return outcomes

    def _result(self, ref, site: str, round_num: int):
        ray = self.ray
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as exc:  # the task's own error: raised as in the sequential engine
            cause = getattr(exc, "cause", None)
            raise (cause if isinstance(cause, BaseException) else exc.as_instanceof_cause()) from None
        except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError, ray.exceptions.RaySystemError,
                ray.exceptions.ObjectLostError) as exc:
            raise SiteTaskFailed(f"site {site}'s task of round {round_num + 1} failed twice on the Ray cluster (its "
                                 f"worker died: {type(exc).__name__}); the run stops here, every finished round is "
                                 "kept: continue with --resume") from None

    def close(self) -> None:
        if self.started:
            self.started = False
            self.ray.shutdown()


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


def make_executor(config: RunConfig, *, progress: Callable[[int, int], None] | None = None):
    """The executor ``config.executor`` names."""
    from .federation import SequentialExecutor

    if config.executor.kind == "ray":
        return RayExecutor(config, progress=progress)
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
