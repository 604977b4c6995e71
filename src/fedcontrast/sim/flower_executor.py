"""The simulator's sites on Flower's simulation runtime (``flwr`` 1.42, the extra ``[flower]``, in an
environment of its own: it needs a grpcio that OpenFL 1.9 refuses).

The simulator's round loop runs inside a Flower ``ServerApp``: everything but the sites' training
(the upload screen, aggregation, evaluation, checkpoints, metrics, plots) is the simulator's own
code, as with the Ray executor. A round's sites go to Flower ``SuperNode``\\ s as ``train`` messages
through the ServerApp's grid; the ``ClientApp`` runs the site's collaborator tasks
(:meth:`~.federation.Federation.train_site`, on the federation it builds from the configuration
carried by the message) and replies. What travels, as Flower records:

* to the site: the configuration and the round (``ConfigRecord`` ``task``), the downlink, global
  and the site's personal part (``ArrayRecord`` ``received``: weights, prototypes, class
  representations, similarity targets alike), its state (``ConfigRecord`` ``state``, bytes);
* back: its uploads (``ArrayRecord`` ``uploads``), its weight, metric rows and state (``ConfigRecord``
  ``outcome``).

In this simulation runtime the site's state goes back to the simulated server with the outcome, as
with the Ray executor, so that central evaluation and checkpoints work as in the in-process
simulator and results are bit-identical to it at the same threads per site.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import RunConfig
from ..errors import ConfigError, FedContrastError

MESSAGE_TYPE = "train"


def flwr_modules():
    """``flwr``'s app and simulation modules, or one sentence saying how to install them."""
    try:
        import flwr.app as app
        import flwr.clientapp as clientapp
        import flwr.serverapp as serverapp
        import flwr.simulation as simulation
    except ImportError:
        raise ConfigError("the Flower engine needs flwr 1.42, which is not installed: in an environment without "
                          "OpenFL (their grpcio versions conflict), pip install -e \".[flower]\"") from None
    return app, clientapp, serverapp, simulation


class SiteFailed(FedContrastError):
    """A site's train message came back with an error; names the site."""


# --- records ---------------------------------------------------------------------------------------
def to_array_record(tensors: dict[str, torch.Tensor]):
    app = flwr_modules()[0]
    return app.ArrayRecord(array_dict={k: app.Array.from_numpy_ndarray(v.detach().cpu().numpy())
                                       for k, v in tensors.items()})


def from_array_record(record, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    out = {k: torch.from_numpy(np.array(a.numpy(), copy=True)) for k, a in record.items()}
    return out if device is None else {k: v.to(device) for k, v in out.items()}


def to_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> Any:
    """A site's state as :func:`to_bytes` wrote it. Simulation only: every party is this process's own
    code; a deployment keeps a site's state at its SuperNode and never unpickles what arrives."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


# --- the ClientApp: one site's round on a SuperNode ------------------------------------------------
def train_message(msg, context):
    """The ClientApp's ``train`` handler."""
    from .federation import worker_federation

    app = flwr_modules()[0]
    task = msg.content["task"]
    torch.set_num_threads(int(task["threads"]))
    federation = worker_federation(json.loads(task["config"]))
    index = int(task["site"])
    outcome = federation.train_away(index, int(task["round"]),
                                    from_array_record(msg.content["received"], federation.device),
                                    from_bytes(msg.content["state"]["state"]))
    reply = app.RecordDict({
        "uploads": to_array_record(outcome.uploads),
        "outcome": app.ConfigRecord({"site": federation.sites[index].name, "weight": float(outcome.weight),
                                     "rows": json.dumps(outcome.rows), "state": to_bytes(outcome.state)})})
    return app.Message(content=reply, reply_to=msg)


def client_app():
    """The ``ClientApp`` of every plugin."""
    clientapp = flwr_modules()[1]
    app = clientapp.ClientApp()
    app.train()(train_message)
    return app


# --- on the ServerApp: the simulator's executor ----------------------------------------------------
class FlowerExecutor:
    """Trains a round's sites through a Flower grid (site ``i`` on the ``i``-th node, modulo the
    nodes: in simulation every node can build every site's data)."""

    name = "flower"

    def __init__(self, grid, *, nodes: int = 1, threads: int = 1, timeout: float | None = None,
                 wait_s: float = 60.0, progress: Callable[[int, int], None] | None = None) -> None:
        """Waits up to ``wait_s`` seconds for ``nodes`` SuperNodes to connect."""
        self.grid, self.threads, self.timeout, self.progress = grid, threads, timeout, progress
        deadline = time.monotonic() + wait_s
        while len(grid.get_node_ids()) < nodes and time.monotonic() < deadline:
            time.sleep(0.2)
        self.nodes = sorted(grid.get_node_ids())
        if len(self.nodes) < nodes:
            raise ConfigError(f"only {len(self.nodes)} of {nodes} Flower SuperNodes connected within {wait_s:.0f} s")

    def train_sites(self, federation, sites, round_num: int) -> dict[str, Any]:
        from .federation import SiteOutcome

        app = flwr_modules()[0]
        config = json.dumps(federation.config.to_dict(), sort_keys=True)
        messages = []
        for site in sites:
            content = app.RecordDict({
                "task": app.ConfigRecord({"config": config, "site": site.index, "round": round_num,
                                          "threads": self.threads}),
                "received": to_array_record(federation.downlink.for_site(site.name)),
                "state": app.ConfigRecord({"state": to_bytes(site.state)})})
            messages.append(app.Message(content, dst_node_id=self.nodes[site.index % len(self.nodes)],
                                        message_type=MESSAGE_TYPE, group_id=str(round_num)))
        ids, replies = self._exchange(messages)
        site_of = dict(zip(ids, sites))  # message id → site
        outcomes: dict[str, Any] = {}
        for reply in replies:
            if reply.has_error():
                site = site_of.get(reply.metadata.reply_to_message_id)
                raise SiteFailed(f"site {site.name if site else '?'}'s round {round_num} failed on its Flower "
                                 f"node: {reply.error.reason}")
            record = reply.content["outcome"]
            outcomes[record["site"]] = SiteOutcome(from_array_record(reply.content["uploads"], federation.device),
                                                   float(record["weight"]), json.loads(record["rows"]),
                                                   from_bytes(record["state"]))
        missing = sorted(s.name for s in sites if s.name not in outcomes)
        if missing:
            raise SiteFailed(f"no reply from site(s) {', '.join(missing)} in round {round_num} within "
                             f"{self.timeout or 0:g} s; the run stops here, every finished round is kept")
        return outcomes

    def _exchange(self, messages: list) -> tuple[list, list]:
        """Pushes ``messages`` and pulls the replies as they come (the progress bar counts them), until
        all are in or ``timeout`` seconds have passed: the messages' ids (in order) and the replies."""
        ids = list(self.grid.push_messages(messages))
        pending = set(ids)
        total, replies = len(pending), []
        if self.progress is not None:
            self.progress(0, total)
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while pending and (deadline is None or time.monotonic() < deadline):
            pulled = list(self.grid.pull_messages(pending))
            pending.difference_update(m.metadata.reply_to_message_id for m in pulled)
            replies += pulled
            if pulled and self.progress is not None:
                self.progress(len(replies), total)
            if pending:
                time.sleep(0.02)
        return ids, replies

    def close(self) -> None:
        pass


def run_on_flower(config: RunConfig, run_dir: str | Path, **simulation_args: Any) -> dict:
    """``config`` with the simulator's round loop in a Flower ServerApp and the sites on Flower's
    simulation runtime (one SuperNode per site, ``executor.site_cpus`` CPUs each, default 1); the
    summary. ``simulation_args`` as :func:`~.simulator.run_simulation`'s."""
    return run_many_on_flower([(config, Path(run_dir))], **simulation_args)[0]


def run_many_on_flower(jobs: list[tuple[RunConfig, Path]], *, site_timeout: float | None = None,
                       **simulation_args: Any) -> list[dict]:
    """Several runs one after another in one Flower simulation (the runtime starts once; as many
    SuperNodes as the largest run has sites); their summaries."""
    _, _, serverapp, simulation = flwr_modules()
    summaries: list[dict] = []
    errors: list[BaseException] = []
    threads = max(config.executor.threads or 1 for config, _ in jobs)
    nodes = max(config.clients for config, _ in jobs)
    server = serverapp.ServerApp()

    @server.main()
    def main(grid, context) -> None:
        from .simulator import run_simulation

        try:
            from .ray_executor import site_progress

            progress = site_progress() if simulation_args.get("progress") is not None else None
            executor = FlowerExecutor(grid, nodes=nodes, threads=threads, timeout=site_timeout, progress=progress)
            for config, run_dir in jobs:
                summaries.append(run_simulation(config, run_dir, executor=executor, **simulation_args))
        except BaseException as exc:  # the ServerApp runs in a thread of its own: carried to the caller
            errors.append(exc)

    t0 = time.perf_counter()
    with _quiet_flower():
        simulation.run_simulation(server_app=server, client_app=client_app(), num_supernodes=nodes,
                                  backend_config={"client_resources": {"num_cpus": threads, "num_gpus": 0.0}})
    if errors:
        raise errors[0]
    if len(summaries) != len(jobs):
        raise FedContrastError(f"the Flower simulation ended after {time.perf_counter() - t0:.0f} s without finishing "
                               f"the run(s): {len(summaries)} of {len(jobs)} done")
    return summaries


@contextlib.contextmanager
def _quiet_flower():
    """Flower's deprecation notice for its Python simulation entry point, and Ray's tip about GPU
    variables, are not for our users: silenced for the call."""
    logger = logging.getLogger("flwr")
    level = logger.level
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        logger.setLevel(level)
