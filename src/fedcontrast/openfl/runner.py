"""OpenFL TaskRunner that exposes the configured plugin's collaborator tasks as OpenFL tasks."""

from __future__ import annotations

import fcntl
import functools
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from openfl.federated.task.runner import TaskRunner
from openfl.utilities import TensorKey

from ..algorithms import ServerContext
from ..config import RunConfig
from ..construction import (
    build_algorithm_with_public,
    initial_model,
    server_seed,
    site_index,
)
from ..devices import resolve_device
from ..errors import ConfigError, FedContrastError
from ..rounds import DiskStateStore, SiteSession
from ..site.report import REPORT_DIR, SiteReport
from .packing import GLOBAL_PACKED, PERSONAL_PACKED, UPLOAD_PACKED, pack, unpack
from .plan import EVALUATE_TASK

logger = logging.getLogger(__name__)

WEIGHT_METRIC = "fedcontrast_aggregation_weight"  # n_k, sent as a metric so the aggregator has it exactly
PERSONAL_TAG = "personal"  # tags (site, "personal"): a downlink tensor meant for that site only
EVAL_SAMPLES = "samples"  # metric of the evaluate task: the size of the site's held-out split
_HELD_LOCKS: dict[Path, Any] = {}  # state-folder locks this process holds (open files, kept for its life)


class PluginTaskRunner(TaskRunner):
    """One OpenFL task per plugin task (``tasks.<name>.function: <name>`` in the plan).

    Inputs are the plugin's declared downloads (GLOBAL ``model`` tensors of this round); outputs are
    its uploads, tagged ``trained``, plus its metrics. Per-site state (MOON's previous model) is kept
    in ``state_dir/<collaborator>.pt`` on the site's disk, so a restarted collaborator keeps it; the
    state each task started from is kept too (``<collaborator>.round<r>.<task>.pt``) until the next
    task starts, so that a task redone after a crash starts from the same state as the lost attempt.
    What the site takes home (its per-round report, the final model) goes to
    ``report_dir/<collaborator>/`` (default: ``site_report/`` beside the state folder; see
    :mod:`fedcontrast.site.report`).
    """

    def __init__(self, data_loader=None, run_config: dict[str, Any] | None = None,
                 state_dir: str = "local_state/sites", report_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(data_loader, **kwargs)
        from ..threads import apply_threads

        self.threads = apply_threads()  # --threads of `fedcontrast site start`, its launcher's share, or the cores
        logger.info("%s", self.threads.line())
        try:
            self._build(data_loader, run_config)
        except FedContrastError as exc:  # e.g. no public set for FLESD: one sentence, no traceback
            from .protocol import stopped

            raise stopped(exc) from None
        self._pending: dict[str, dict[str, torch.Tensor]] = {}  # uploads of earlier tasks of the round
        self.state_dir = Path(state_dir)
        self.report_dir = Path(report_dir) if report_dir else self.state_dir.parent / REPORT_DIR
        self._reports: dict[str, SiteReport] = {}
        self.required_tensorkeys_for_function: dict[str, list[TensorKey]] = {}
        self.initialize_tensorkeys_for_functions()
        for task in self.algorithm.tasks:
            setattr(self, task, functools.partial(self.run_plugin_task, task))
        setattr(self, EVALUATE_TASK, self.run_site_evaluation)

    def _build(self, data_loader, run_config: dict[str, Any] | None) -> None:
        from ..privacy.releases import release_choices

        self.config = RunConfig.from_dict(run_config or {})
        # What this site lets leave besides its uploads (the plan's DP, the site's own policy).
        self.releases = release_choices(self.config.privacy, getattr(data_loader, "site_policy", None))
        self.device = resolve_device(self.config.device)
        shape = data_loader.shape
        self.model = initial_model(self.config, **shape).to(self.device)
        self.algorithm = build_algorithm_with_public(self.config, data_loader.public)
        server = ServerContext(model=self.model, round_num=0, seed=server_seed(self.config, 0),
                               device=self.device, num_classes=shape["num_classes"], public=data_loader.public)
        specs = self.algorithm.download_specs(self.model, shape["num_classes"])
        self.global_specs = [s for s in specs if not s.per_site]
        self.personal_specs = [s for s in specs if s.per_site]
        self.upload_specs = self.algorithm.upload_specs(self.model, shape["num_classes"])
        self.initial_packed = pack(self.algorithm.initial_downlink(server).global_tensors, self.global_specs)

    # --- what OpenFL calls ----------------------------------------------------------------------
    def get_tensor_dict(self, with_opt_vars: bool = False) -> dict[str, np.ndarray]:
        """The round-0 downlink, packed; ``fx plan initialize`` writes it to ``save/init.pbuf``."""
        return {GLOBAL_PACKED: self.initial_packed.copy()}

    def initialize_tensorkeys_for_functions(self, with_opt_vars: bool = False) -> None:
        keys = [TensorKey(GLOBAL_PACKED, "GLOBAL", 0, False, ("model",))]
        if self.personal_specs:  # OpenFL asks for (this collaborator, "personal") and serves only its own
            keys.append(TensorKey(PERSONAL_PACKED, "GLOBAL", 0, False, (PERSONAL_TAG,)))
        for task in (EVALUATE_TASK, *self.algorithm.tasks):
            self.required_tensorkeys_for_function[task] = keys

    def get_required_tensorkeys_for_function(self, func_name: str, **kwargs: Any) -> list[TensorKey]:
        return self.required_tensorkeys_for_function[func_name]

    def site_index(self, col_name: str) -> int:
        """The site's position in the plan's list of sites (the shard's index for an unlisted
        ``shard:N`` site; such a collaborator is refused by the aggregator anyway)."""
        index = site_index(self.config, col_name)
        if index is None:
            index = self.data_loader.site_index if self.data_loader.site_index is not None else 0
        return index

    def _received(self, input_tensor_dict: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        received = unpack(input_tensor_dict[GLOBAL_PACKED], self.global_specs)
        if self.personal_specs:
            received.update(unpack(input_tensor_dict[PERSONAL_PACKED], self.personal_specs))
        return {k: v.to(self.device) for k, v in received.items()}

    def run_site_evaluation(self, col_name: str, round_num: int, input_tensor_dict: dict[str, np.ndarray],
                            **kwargs: Any):
        """The engine's ``evaluate`` task: the plugin's :meth:`~Algorithm.evaluate_at_site` on this
        site's held-out split, for what the site received at the start of the round (the model after the
        previous one). Metrics only; state unchanged. ``round_num`` is OpenFL's, counted from 0."""
        fl_round, round_num = round_num, round_num + 1  # fedcontrast counts rounds from 1
        loader = self.data_loader
        self._claim(col_name)
        received = self._received(input_tensor_dict)
        released = self.releases.evaluation_metrics  # else kept on the site (its log, its report); nothing leaves
        measured = self._session(col_name).evaluate(round_num, received, self._store(col_name), self._report(col_name),
                                                    shape=loader.shape,  # what leaves: float64 scalars
                                                    sent_bytes=lambda m: 8 * (len(m) + 1) if released else 0)
        out = {}
        if released:
            out = {TensorKey(f"{EVALUATE_TASK}_{key}", col_name, fl_round, True, ("metric",)): np.array(value)
                   for key, value in {**measured, EVAL_SAMPLES: float(len(loader.test))}.items()}
        return out, {}

    def run_plugin_task(self, task: str, col_name: str, round_num: int,
                        input_tensor_dict: dict[str, np.ndarray], **kwargs: Any):
        """A plugin task of the round (``round_num`` is OpenFL's, counted from 0)."""
        fl_round, round_num = round_num, round_num + 1  # fedcontrast counts rounds from 1
        self._claim(col_name)
        received = self._received(input_tensor_dict)
        done = self._session(col_name).run_task(round_num, task, received, self._store(col_name))
        result, weight, metrics, epsilon = done.result, done.weight, done.released, done.epsilon
        self.data_loader.reported_train_size = weight  # OpenFL also sends a "train" task's data size: the same value
        if self.config.privacy is not None:
            logger.info("%s, round %d: ε spent so far %.4g (δ = %g)", col_name, round_num,
                        epsilon.get("dp_epsilon", 0.0), self.config.privacy.delta)
        # One packed upload per round, sent with the round's last task (two tasks uploading the
        # same tensor name in one round would confuse OpenFL's aggregation).
        pending = self._pending.setdefault(col_name, {})
        pending.update(result.uploads)
        uploads = {}
        if task == self.algorithm.tasks[-1]:
            missing = [s.name for s in self.upload_specs if s.name not in pending]
            if missing:
                raise ValueError(f"{self.algorithm.name} did not produce its declared upload(s) {missing[:3]}")
            if self.config.secure_aggregation is not None:  # the aggregator gets only the sum (openfl/secure.py)
                uploads[TensorKey(UPLOAD_PACKED, col_name, fl_round, False, ("trained",))] = \
                    self._secure_upload(col_name, round_num, pending, weight)
            else:
                uploads[TensorKey(UPLOAD_PACKED, col_name, fl_round, False, ("trained",))] = \
                    pack(pending, self.upload_specs)
                uploads[TensorKey(WEIGHT_METRIC, col_name, fl_round, True, ("metric",))] = np.array(weight)
            del self._pending[col_name]
        for key, value in metrics.items():
            uploads[TensorKey(f"{task}_{key}", col_name, fl_round, True, ("metric",))] = np.array(value)
        report = self._report(col_name)  # everything the site measured, whatever left it
        report.trained(round_num, task, result.metrics, _nbytes(input_tensor_dict), _nbytes(uploads),
                       epsilon)
        return uploads, {}

    def _secure_upload(self, col_name: str, round_num: int, uploads: dict[str, torch.Tensor], weight: float):
        """Takes part in the round's secure sum with this site's terms; the task's own upload is a
        placeholder (and its sample count is not sent: it is inside the sum)."""
        from ..privacy.secagg_terms import checked_vector
        from ..tensors import InvalidUploadError
        from .protocol import stopped
        from .secure import DroppedFromRound

        channel = getattr(self, "secure_channel", None)
        if channel is None:
            raise ConfigError("secure aggregation needs fedcontrast's collaborator (the plan's SafeCollaborator)")
        self.data_loader.reported_train_size = 1.0
        try:  # the checks the aggregator cannot make on a masked vector, made here before masking
            vector, reason = checked_vector(col_name, self.algorithm, uploads, weight, self.config.secure_aggregation,
                                            self.upload_specs), ""
        except InvalidUploadError as exc:
            vector, reason = None, str(exc)
            logger.error("%s, round %d: %s; this site withdraws from the round's secure sum", col_name, round_num, exc)
        try:
            cost = channel.run(col_name, round_num, vector, self.config, reason)
        except DroppedFromRound as exc:  # the federation goes on without this site: not a failed task
            raise stopped(exc) from None
        if vector is not None:
            logger.info("%s, round %d: took part in the secure sum (%d bytes sent; %.3f s of CPU, %.2f s in all)",
                        col_name, round_num, cost["secagg_bytes"], cost["secagg_cpu_s"], cost["secagg_s"])
        return np.zeros(1, dtype=np.float32)

    def _report(self, col_name: str) -> SiteReport:
        if col_name not in self._reports:
            policy = getattr(self.data_loader, "site_policy", None)
            self._reports[col_name] = SiteReport(self.report_dir / col_name, col_name, self.config.rounds,
                                                 getattr(policy, "max_epsilon", None), threads=self.threads.threads,
                                                 run=self.run_id(), facts={"engine": "openfl"})
        return self._reports[col_name]

    def run_id(self) -> str:
        """The federation this site's report belongs to: OpenFL's federation id (the plan's name and
        hash, set by fedcontrast's collaborator), else the run configuration's digest."""
        given = getattr(self, "federation_id", None)
        if given:
            return str(given)
        import hashlib
        import json

        return "plan_" + hashlib.sha256(json.dumps(self.config.to_dict(), sort_keys=True,
                                                   default=str).encode()).hexdigest()[:8]

    # --- the site's session, its state on the site's disk ----------------------------------------
    def _session(self, col_name: str) -> SiteSession:
        """``col_name``'s side of the run; DP noise from the operating system: the aggregator knows the
        plan's seed."""
        loader = self.data_loader
        return SiteSession(col_name, self.site_index(col_name), self.config, self.algorithm, self.model, self.device,
                           self.releases, loader.train, loader.test, loader.validation, loader.public)

    def _store(self, col_name: str) -> DiskStateStore:
        """``col_name``'s state in ``state_dir`` (its files: the class's docstring)."""
        return DiskStateStore(self.state_dir, col_name, self.device)

    def _claim(self, col_name: str) -> None:
        """One process per collaborator name: a second one would train on the same state file."""
        path = (self.state_dir / f"{col_name}.lock").resolve()
        if path in _HELD_LOCKS:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path, "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.seek(0)
            pid = lock.read().strip() or "unknown"
            lock.close()
            from .protocol import stopped

            raise stopped(f"another collaborator process named {col_name} is running in this workspace (pid {pid}); "
                          "stop it before starting this one") from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        _HELD_LOCKS[path] = lock


def _nbytes(tensors: dict[Any, Any]) -> int:
    """Bytes of the arrays of a task's input or output (the packed downlink, the upload, metrics)."""
    return sum(np.asarray(v).nbytes for v in tensors.values())
