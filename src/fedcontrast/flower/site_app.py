"""A site of a real Flower deployment: what it does with each message of the operator's ServerApp,
on the institution's own folder (the Flower ``ClientApp`` around it is :mod:`.client_app`; with
``fedcontrast flower supernode`` it runs in the site's long-lived worker, :mod:`.worker`).

The SuperNode is started by ``fedcontrast flower supernode`` (or by hand) with a node
configuration naming the site and its folders: ``site-name``, ``data`` (its image folder), ``workdir``
(where its state, report and final model stay), optionally ``policy`` (its site policy) and
``public`` (the public folder it holds). Three messages come from the operator's ServerApp:

* ``query`` (``hello``): the site checks the plan against its policy and runs the audit **before it
  reads any data** (:class:`~fedcontrast.site.data.SiteData`), checks files every site must share
  (FedPCL's frozen backbones, sent with the message and pinned by SHA-256 in the plan), then reads
  its folder and answers with its name;
* ``train``: what it received this round is scored on its own held-out split (its report's row),
  then the plugin's collaborator tasks run; the uploads and the aggregation weight go back, with
  the metrics the plan and its policy let leave;
* ``evaluate`` (after the last round): the final model is scored and written at the site
  (``site_report/<name>/<run>/``, one folder per run: :mod:`fedcontrast.site.report`).

The site's state (MOON's previous model, personal heads, DP accountants) never leaves it: it is
kept in the SuperNode's ``context.state`` between rounds (and a copy under ``workdir/local_state/``).
Nothing that arrives is unpickled: tensors come as Flower arrays, shared files as bytes checked
against the plan's SHA-256 pins.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..algorithms.capabilities import check_shared_files
from ..atomic import atomic_write_bytes
from ..config import RunConfig, site_names
from ..construction import (
    build_algorithm_with_public,
    data_shape,
    initial_model,
)
from ..devices import resolve_device
from ..errors import FedContrastError, SiteRefusal
from ..rounds import DiskStateStore, SiteSession
from ..site.report import REPORT_DIR, SiteReport
from ..threads import apply_threads
from .records import plan_pins

logger = logging.getLogger("fedcontrast.flower.site")

_RUNTIMES: dict[tuple[int, str], SiteRuntime] = {}  # one per (run, site) in a long-lived ClientApp process


class SiteRefused(SiteRefusal):
    """The site refuses the run (its policy, its folder, a shared file): one sentence."""


class SiteRuntime:
    """One site's side of one run: its data (read after its policy accepted the plan), the plugin,
    its report."""

    def __init__(self, config: RunConfig, settings: dict[str, str], shared: dict[str, bytes]) -> None:
        from ..privacy.releases import release_choices
        from ..site.data import SiteData

        self.name = settings["site-name"]
        self.run_id = 0  # the Flower run this runtime serves (set by :func:`runtime`)
        self.run_label = ""  # the operator's run, kept across a resumed run (set by :func:`handle`)
        self.workdir = Path(settings["workdir"]).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        os.chdir(self.workdir)  # the plan's relative paths (public folder, shared files) are the site's own
        if self.name not in site_names(config):
            raise SiteRefused(f"this site is {self.name!r}, which is not one of the plan's sites "
                              f"({', '.join(site_names(config))})")
        if settings.get("public") and config.public_data is not None:  # else the plan needs none
            config = config.replace(public_data=type(config.public_data)(config.public_data.sha256,
                                                                         str(Path(settings["public"]).resolve())))
        self._write_shared(shared, plan_pins(config))
        self.config = config
        self.shape = data_shape(config)
        # Flower's transport as this SuperNode was started: TLS to the SuperLink, and its own key (the
        # SuperLink admits only registered keys); the site's policy is checked against these facts.
        network = {"use_tls": settings.get("tls", "true") == "true",
                   "require_client_auth": settings.get("node-auth", "true") == "true"}
        policy_path = Path(settings["policy"]).resolve() if settings.get("policy") else None  # else site_policy.yaml
        try:
            self.data = SiteData(data_path=str(Path(settings["data"]).resolve()), run_config=config.to_dict(),
                                 network=network, model_shape=self.shape, policy_path=policy_path)
        except SiteRefusal as exc:  # the sentence goes to the operator
            raise SiteRefused(str(exc)) from None
        self.releases = release_choices(config.privacy, self.data.site_policy)
        self.device = resolve_device(config.device)
        self.model = initial_model(config, **self.shape).to(self.device)
        self.algorithm = build_algorithm_with_public(config, self.data.public)
        check_shared_files(self.algorithm, self.workdir)
        self.index = site_names(config).index(self.name)  # one of the plan's sites (checked above)
        data = self.data
        self.session = SiteSession(self.name, self.index, config, self.algorithm, self.model, self.device,
                                   self.releases, data.train, data.test, data.validation, data.public)
        self.network, self.data_path = network, str(Path(settings["data"]).resolve())
        self._report: SiteReport | None = None  # this run's, made once its label is known (:attr:`report`)

    @property
    def report(self) -> SiteReport:
        """This run's report, ``WORKDIR/site_report/<name>/<run>/``: the operator's run label (kept
        across a resumed run) in its path and in every row, so that no two experiments share a table."""
        if self._report is None:
            policy = self.data.site_policy
            self._report = SiteReport(self.workdir / REPORT_DIR / self.name, self.name, self.config.rounds,
                                      getattr(policy, "max_epsilon", None), threads=torch.get_num_threads(),
                                      run=self.label(), facts={"engine": "flower", "flower_run": self.run_id},
                                      plan={"run_config": self.config.to_dict(), "network": self.network,
                                            "model_shape": self.shape, "data": self.data_path})
        return self._report

    def label(self) -> str:
        """The run's label as a name on this site's disk (the operator's label, else Flower's run id)."""
        return "".join(c for c in self.run_label if c.isalnum() or c in "-_") or str(self.run_id)

    def _write_shared(self, shared: dict[str, bytes], pins: dict[str, str]) -> None:
        """Files the plan pins by SHA-256 (FedPCL's backbones), received as bytes: written only if
        the plan names them and their hash matches (the plugin checks them again when it loads them)."""
        for rel, data in shared.items():
            if rel not in pins:
                raise SiteRefused(f"the operator sent a file {rel!r} that the plan does not pin; refused")
            if hashlib.sha256(data).hexdigest() != pins[rel]:
                raise SiteRefused(f"the shared file {rel!r} the operator sent does not match the plan's SHA-256 pin")
            target = (self.workdir / rel).resolve()
            if not target.is_relative_to(self.workdir):
                raise SiteRefused(f"the shared file {rel!r} would be written outside this site's folder; refused")
            target.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(target, data)

    def store(self, latest: bytes | None = None) -> DiskStateStore:
        """The site's state in this run, on its own disk (the SuperNode's context.state holds it too,
        ``latest``; a restarted SuperNode has lost that): ``local_state/<name>.run<label>.pt``, one file
        per run, so a new run starts afresh, and a resumed run (a new Flower run carrying the operator's
        run label) finds its own again, and redoes the round it was stopped in from the state that round
        began with, as an OpenFL collaborator does (:class:`~fedcontrast.rounds.DiskStateStore`)."""
        return DiskStateStore(self.workdir / "local_state", f"{self.name}.run{self.label()}", self.device, latest)

    # --- the round ----------------------------------------------------------------------------------
    def evaluate(self, round_num: int, received: dict[str, torch.Tensor], store: DiskStateStore) -> dict[str, float]:
        """What it received at the start of ``round_num`` (the model after round ``round_num - 1``; the
        final model when ``round_num`` is ``rounds + 1``, the evaluation after the last round) on its
        own held-out split: its report's row ``round_num - 1``, now complete."""
        test = self.data.test
        assert test is not None  # a site's data: its training and held-out splits
        measured = self.session.evaluate(round_num, received, store, self.report, shape=self.shape)
        return {**measured, "samples": float(len(test))} if self.releases.evaluation_metrics else {}

    def train(self, round_num: int, received: dict[str, torch.Tensor], store: DiskStateStore, nbytes: int):
        """The plugin's tasks of ``round_num``, from the state the round first started from; the state
        after them is saved. Returns (uploads, weight, released metrics per task)."""
        tasks = self.session.run_round(round_num, received, store, finished=lambda done: self.report.trained(
            round_num, done.task, done.result.metrics, nbytes, done.bytes_sent, done.epsilon))
        uploads = {name: value for done in tasks for name, value in done.uploads.items()}
        return uploads, float(tasks[-1].weight), {done.task: done.released for done in tasks}


def runtime(run_id: int, run_config: str, settings: dict[str, str], shared: dict[str, bytes]) -> SiteRuntime:
    """This site's runtime for run ``run_id`` (built at its first message; kept by a long-lived
    process, the site's worker)."""
    apply_threads(settings.get("threads") or None)  # the SuperNode's --threads, else the cores it may use
    key = (int(run_id), settings["site-name"])
    if key not in _RUNTIMES:
        _RUNTIMES[key] = SiteRuntime(RunConfig.from_dict(json.loads(run_config)), settings, shared)
        _RUNTIMES[key].run_id = int(run_id)
    return _RUNTIMES[key]


def refusal(exc: BaseException) -> str:
    """The one sentence an exception becomes for both parties."""
    if isinstance(exc, FedContrastError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


REFUSAL_RECORD = "refusal"  # a reply's record when the site refused or failed: {"kind", "site", "sentence"}


def refusal_reply(site: str, exc: BaseException | str) -> dict[str, Any]:
    """A refusal (its policy, its folder, a shared file: ``refused``) or a failure (anything else:
    ``failed``) as the site's reply, which the operator's ServerApp reads and names within seconds."""
    kind = "refused" if isinstance(exc, (FedContrastError, str)) else "failed"
    return {REFUSAL_RECORD: {"kind": kind, "site": site, "sentence": exc if isinstance(exc, str) else refusal(exc)}}


def answer(**request: Any) -> tuple[dict[str, Any], bytes | None]:
    """:func:`handle`, where a refusal or a failure becomes the site's reply (one sentence, printed on
    the site's terminal too) instead of a ClientApp that stops without one."""
    try:
        return handle(**request)
    except Exception as exc:  # noqa: BLE001 - every failure reaches the operator as one sentence
        name = str((request.get("settings") or {}).get("site-name") or "this site")
        reply = refusal_reply(name, exc)
        print(f"fedcontrast flower site: error: site {name} {reply[REFUSAL_RECORD]['kind']}: "
              f"{reply[REFUSAL_RECORD]['sentence']}", flush=True)
        return reply, None


def _tensors(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.array(v, copy=True)).to(device) for k, v in arrays.items()}


def _arrays(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() for k, v in tensors.items()}


def handle(kind: str, run_id: int, run_config: str, settings: dict[str, str], content: dict[str, Any],
           state: bytes | None) -> tuple[dict[str, Any], bytes | None]:
    """One message, in plain data: ``content`` maps each record's name to its values (arrays as
    numpy); returns the reply's records and the site's state afterwards (None: unchanged)."""
    site = runtime(run_id, run_config, settings, content.get("shared") or {})
    task = content.get("task") or {}
    if "run" in task:  # the operator's run label: the same in a resumed run, whose Flower run id is new
        site.run_label = str(task["run"])
    if kind == "query":
        return {"site": {"site": site.name}}, None
    if kind == "secagg":  # a step of the round's secure aggregation (flower/secure.py)
        from .secure import site_step

        return site_step(site, content), None
    round_num = int(content["task"]["round"])
    received = _tensors(content["received"], site.device)
    nbytes = sum(v.numel() * v.element_size() for v in received.values())
    store = site.store(state)
    evaluation = site.evaluate(round_num, received, store)
    if kind == "evaluate":
        return {"outcome": {"site": site.name, "evaluation": json.dumps(evaluation)}}, None
    uploads, weight, metrics = site.train(round_num, received, store, nbytes)
    saved = store.path.read_bytes()  # the SuperNode's context.state: the copy on the site's disk, byte for byte
    if site.config.secure_aggregation is not None:  # its keys instead of its uploads; its count is inside the sum
        from .secure import begin_site_round

        advert = begin_site_round(site, round_num, uploads, weight, settings)
        return ({"secagg": {"payload": advert},
                 "outcome": {"site": site.name, "metrics": json.dumps(metrics), "evaluation": json.dumps(evaluation)}},
                saved)
    return ({"uploads": _arrays(uploads),
             "outcome": {"site": site.name, "weight": weight, "metrics": json.dumps(metrics),
                         "evaluation": json.dumps(evaluation)}}, saved)
