"""An in-process federation: the sites, the server and one round, driven through the plugin calls.

This is the whole engine of the simulator; it holds no algorithm logic. The OpenFL and Flower glue
drive the same plugin calls (``run_task``, ``aggregate``) across processes.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..algorithms import (
    Downlink,
    PersonalEvaluation,
    SiteContext,
    load_weights,
    nbytes,
)
from ..algorithms.base import WEIGHT_PREFIX
from ..config import RunConfig, site_names
from ..construction import (
    build_algorithm,
    derive_seed,
    load_splits,
    partition,
    site_validation,
)
from ..devices import resolve_device
from ..errors import ConfigError
from ..evaluation import linear_probe, local_model_accuracy, own_accuracy
from ..outputs import GLOBAL_SITE, metric_row
from ..privacy.releases import release_choices
from ..robust import RejectedUpload
from ..rounds import AggregatorRound, MemoryStateStore, RoundOutcome, SiteSession
from ..rounds.transport import Replies, SecureSum, run_round

__all__ = ["Federation", "build_algorithm", "derive_seed"]

logger = logging.getLogger(__name__)

NOISE_STREAM = 0xD9  # derive_seed(task seed, NOISE_STREAM): the simulated DP noise, apart from batch order


class RoundStopped(RejectedUpload):
    """The round was aggregated without rejected uploads and the run stops (``robustness.on_rejected:
    stop``): ``rows``, the round's metrics, for the run's records."""

    def __init__(self, message: str, rows: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.rows = rows


@dataclass
class Site:
    name: str
    index: int
    data: Any  # ArrayDataset
    state: dict[str, Any] = field(default_factory=dict)


@dataclass
class SiteOutcome:
    """One site's round: its uploads (on the run's device), aggregation weight, metrics rows, and
    its state afterwards (MOON's previous model, personal heads, DP accountants…); ``measured``: its
    uploads as the aggregator's screen measures them, measured where they were made (None: not
    measured there, the aggregator measures them)."""

    uploads: dict[str, torch.Tensor]
    weight: float
    rows: list[dict[str, Any]]
    state: dict[str, Any]
    measured: Any = None  # fedcontrast.robust.screen.UploadFacts


class Federation:
    """Sites holding their shards and state, a server holding the downlink, one plugin."""

    def __init__(self, config: RunConfig, *, local_evaluation: bool | None = None, linear_probe: bool = False) -> None:
        """``local_evaluation``: evaluate every site's uploaded local model each round (default: when
        the plugin asks for it, :attr:`Algorithm.evaluates_local_models`). ``linear_probe``: also
        report the linear-probe accuracy of the global model's encoder (``probe_accuracy``)."""
        self.config = config
        self.executor: Any = SequentialExecutor()  # who trains a round's sites (run_simulation sets the run's)
        self.last_round: int | None = None  # the last round this process will run: none sent beyond
        self.ahead: tuple[int, Any] | None = None  # (round, the executor's handle) of sites sent ahead
        self.before_aggregate: Callable[[], None] | None = None  # once a round's sites are in, before it changes
        self.device = resolve_device(config.device)
        splits = self.splits = load_splits(config)
        parts = self.partition = partition(config, splits)
        def on_device(data):
            return data.to(self.device)

        self.test = on_device(splits.test)
        self.public = on_device(splits.public) if splits.public is not None else None
        # each site's shard: the part it trains on and the validation part it holds out (construction.site_validation)
        shards = [np.asarray(p, dtype=np.int64) for p in parts]
        kept_held = [site_validation(config, splits.train.y[p], i) for i, p in enumerate(shards)]
        self.site_validations = [on_device(splits.train.subset(p[h])) if h.size else None
                                 for p, (_, h) in zip(shards, kept_held)]
        held_out = np.concatenate([p[h] for p, (_, h) in zip(shards, kept_held)] or [np.empty(0, dtype=np.int64)])
        # the sites' validation parts together: the global model's validation split (tuning, the best round)
        self.validation = on_device(splits.train.subset(held_out)) if held_out.size else None
        shape = {"in_channels": splits.in_channels, "image_size": splits.image_size, "num_classes": splits.num_classes}
        labelled = splits.train.subset(np.setdiff1d(np.arange(len(splits.train)), held_out)) if held_out.size \
            else splits.train  # a linear probe never trains on validation samples
        self.core = AggregatorRound(config, shape, public=self.public, device=self.device,
                                    labelled=on_device(labelled))  # the aggregator's round (fedcontrast.rounds)
        self.algorithm, self.server, self.screen = self.core.algorithm, self.core.server, self.core.screen
        self.sites = [Site(name, i, on_device(splits.train.subset(p[k])))
                      for i, (name, p, (k, _)) in enumerate(zip(site_names(config), shards, kept_held))]
        # a data set with sites of its own (fedprox_synthetic) holds out each site's own test samples:
        # a site's own model is scored on those, not on the shared test split re-weighted to its labels
        self.site_tests = (None if splits.site_test is None
                           else [on_device(splits.test.subset(splits.site_test[s.index])) for s in self.sites])
        model = self.server.model
        self.site_model = copy.deepcopy(model)  # scratch network the site tasks load weights into
        self.upload_specs = self.core.specs
        self.downlink: Downlink = self.core.initial_downlink()
        self.releases = release_choices(config.privacy)  # a simulated site releases what a deployed one would
        self.local_evaluation = (self.algorithm.evaluates_local_models if local_evaluation is None
                                 else local_evaluation)
        if self.local_evaluation and not any(s.name.startswith(WEIGHT_PREFIX) for s in self.upload_specs):
            raise ConfigError(f"{config.algorithm} uploads no model weights: there is no local model to evaluate")
        self.linear_probe = linear_probe
        downloads = self.algorithm.download_specs(model, splits.num_classes)
        if linear_probe and not any(s.name.startswith(WEIGHT_PREFIX) for s in downloads):
            raise ConfigError(f"{config.algorithm} has no global model: there is no encoder to probe")

    # --- state for checkpoints ----------------------------------------------------------------
    def state_dict(self, *, digests: bool = True) -> dict[str, Any]:
        """What a checkpoint holds; ``digests`` False: without the digests of earlier uploads (the
        simulator keeps each round's beside its checkpoint, :func:`~.checkpoint.append_round_rows`)."""
        return {"downlink": {"global": self.downlink.global_tensors, "personal": self.downlink.personal,
                             "metrics": self.downlink.metrics},
                "server_state": self.server.state,
                "site_states": {s.name: s.state for s in self.sites},
                "upload_digests": self.screen.digests if digests else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        d = state["downlink"]
        self.downlink = Downlink(dict(d["global"]), dict(d["personal"]), dict(d["metrics"]))
        self.server.state = state["server_state"]
        for site in self.sites:
            site.state = state["site_states"][site.name]
        self.screen.digests = dict(state.get("upload_digests", {}))  # older checkpoints have none

    # --- one round ----------------------------------------------------------------------------
    def select_sites(self, round_num: int) -> list[Site]:
        k = len(self.sites)
        m = max(1, int(round(self.config.sample_fraction * k)))
        if m == k:
            return list(self.sites)
        rng = np.random.default_rng([self.config.seed, round_num, 7919])
        return [self.sites[i] for i in sorted(rng.choice(k, m, replace=False))]

    def session(self, site: Site) -> SiteSession:
        """``site``'s side of the run (:class:`~fedcontrast.rounds.SiteSession`). Simulation only: DP
        noise is seeded from each task's seed, so that runs are reproducible."""
        test = self.test if self.site_tests is None else self.site_tests[site.index]
        return SiteSession(site.name, site.index, self.config, self.algorithm, self.site_model, self.device,
                           self.releases, site.data, test, self.site_validations[site.index], self.public,
                           noise_stream=NOISE_STREAM)

    def site_context(self, site: Site, round_num: int, seed: int) -> SiteContext:
        return self.session(site).context(round_num, seed, site.state)

    def personalized_evaluation(self, round_num: int, *, validation: bool = False) -> dict[str, float]:
        """Each site's own model on the test split (the site's own held-out samples where the data set
        has them), or on its own validation part (``validation``; a site that holds none out is left
        out): mean ("accuracy") and spread over sites."""
        algorithm = self.algorithm
        assert isinstance(algorithm, PersonalEvaluation)
        held = [(site, self.site_validations[site.index] if validation else
                 self.test if self.site_tests is None else self.site_tests[site.index]) for site in self.sites]
        per_site = [algorithm.evaluate_site(self.site_context(site, round_num, 0),
                                            self.downlink.for_site(site.name), data)
                    for site, data in held if data is not None]
        if not per_site:
            return {}
        out: dict[str, float] = {}
        for key in per_site[0]:
            out[key], out[f"{key}_std"] = _mean_std([m[key] for m in per_site])
        return out

    def validation_evaluation(self, round_num: int) -> dict[str, float]:
        """The round's model on the sites' validation parts, as the test split is scored (``val_``
        before each name): what tuning and the best round look at, never the test split."""
        if self.validation is None:
            return {}
        measured = self.algorithm.evaluate(self.downlink, self.server, self.validation)
        if isinstance(self.algorithm, PersonalEvaluation):
            measured.update(self.personalized_evaluation(round_num, validation=True))
        return {f"val_{k}": v for k, v in measured.items()}

    def local_model_evaluation(self, uploads: dict[str, dict[str, torch.Tensor]]) -> dict[str, float]:
        """Each site's uploaded local model on the test split, on the site's own label distribution
        (``local_accuracy``) and as it is (``local_balanced_accuracy``); mean and spread over sites."""
        if self.site_tests is not None:  # its own held-out samples: local_accuracy on those
            out = local_model_accuracy(self.site_model, uploads, self.test, self.device)
            own = [own_accuracy(self.site_model, uploads[s.name], self.site_tests[s.index], self.device)
                   for s in self.sites if s.name in uploads]
            out["local_accuracy"], out["local_accuracy_std"] = _mean_std(own)
            return out
        counts = {s.name: torch.bincount(s.data.y, minlength=self.server.num_classes) for s in self.sites}
        return local_model_accuracy(self.site_model, uploads, self.test, self.device, class_counts=counts)

    def train_site(self, site: Site, round_num: int, received: dict[str, torch.Tensor],
                   reference: dict[str, torch.Tensor] | None = None) -> SiteOutcome:
        """Every collaborator task of ``site`` in round ``round_num`` on what it ``received``: what an
        executor dispatches. Depends only on the configuration, the site's state and ``received``.
        ``reference``: the global downlink among what it received; given, the site measures its uploads
        against it for the aggregator's screen (:meth:`~fedcontrast.robust.UploadScreen.measure`), in
        its own process, so that the driver does not measure each site's upload again."""
        down = nbytes(received)
        store = MemoryStateStore(site.state)
        tasks = self.session(site).run_round(round_num, received, store)
        merged = {k: v.to(self.device) for done in tasks for k, v in done.uploads.items()}
        rows = [metric_row(round_num, site.name, done.task, len(site.data),
                           {**done.result.metrics, **done.epsilon},  # a simulation records everything a site measured
                           done.bytes_sent, down if t == 0 else 0) for t, done in enumerate(tasks)]
        facts = (self.screen.measure(merged, reference)
                 if reference is not None and self.config.secure_aggregation is None else None)
        # the weight: the count as a deployment releases it (noised once under DP)
        return SiteOutcome(merged, tasks[-1].weight, rows, store.state, facts)

    def train_away(self, index: int, round_num: int, received: dict[str, torch.Tensor],
                   state: dict[str, Any], reference: dict[str, torch.Tensor] | None = None) -> SiteOutcome:
        """Site ``index``'s round where its state is not kept (a Ray worker, a Flower node in
        simulation): ``state`` comes in, goes back in the outcome, and none stays here."""
        site = self.sites[index]
        site.state = state
        try:
            return self.train_site(site, round_num, received, reference)
        finally:
            site.state = {}

    # --- the round: this federation is its own transport (rounds/transport.py) and recorder ---------
    def exchange(self, round_num: int, downlink: Downlink) -> Replies:
        """Round ``round_num``'s sites, trained by the executor on ``downlink`` (sent ahead, while the
        round before was recorded, where the executor trains them elsewhere): their uploads, weights,
        uploads as each site measured them, and metrics rows."""
        replies = Replies()
        selected = self.select_sites(round_num)
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[0] == round_num:  # sent while the previous round was evaluated
            outcomes = self.executor.collect(ahead[1])
        else:
            outcomes = self.executor.train_sites(self, selected, round_num)
        if self.before_aggregate is not None:  # e.g. the previous round's checkpoint, written meanwhile
            self.before_aggregate()
        for site in selected:
            outcome = outcomes[site.name]
            site.state = outcome.state
            replies.weights[site.name] = outcome.weight
            replies.rows.extend(outcome.rows)
            replies.uploads[site.name] = outcome.uploads
            if outcome.measured is not None:
                replies.facts[site.name] = outcome.measured
        return replies

    def secure_sum(self, round_num: int, replies: Replies, uploads: dict[str, dict[str, torch.Tensor]]) -> SecureSum:
        """The secure sum of the plugin's terms over ``uploads``, every party in this process (each site
        masks, say, ``n_k·u_k`` and ``n_k``: :meth:`~fedcontrast.algorithms.Algorithm.secure_terms`); its
        cost goes into the round's rows."""
        from ..privacy.secagg_protocol import session_digest
        from ..privacy.secagg_sim import secure_terms_sum

        session = session_digest(self.config.to_dict(), site_names(self.config), "simulator")
        assert self.core.sum_layout is not None  # secure aggregation is on
        total, cost = secure_terms_sum(self.algorithm, uploads, replies.weights, self.config.secure_aggregation,
                                       round_num, self.core.sum_layout, session=session)
        replies.rows.append(metric_row(round_num, "aggregator", "secure_aggregation", len(uploads),
                                       {"bytes_per_site": cost.bytes_per_site,
                                        "plain_bytes_per_site": cost.plain_bytes_per_site,
                                        "threshold": cost.threshold, "neighbours": cost.neighbours,
                                        "site_cpu_s": cost.site_seconds, "aggregator_cpu_s": cost.aggregator_seconds}))
        return SecureSum(total, len(uploads))

    def prepare(self, round_num: int, downlink: Downlink) -> None:
        """The downlink of round ``round_num`` exists: kept, and sent ahead where the executor trains
        sites elsewhere (:class:`~.ray_executor.RayExecutor`), so that they train while this process
        evaluates the round before, writes its checkpoint and metrics. The sites' work depends only on
        the downlink and their states, both final by now: results are equal."""
        self.downlink = downlink
        start = getattr(self.executor, "start", None)
        if start is not None and self.last_round is not None and round_num <= self.last_round:
            self.ahead = (round_num, start(self, self.select_sites(round_num), round_num))

    def cancel_ahead(self) -> None:
        """Drops work sent ahead for a round that will not run here (the run stopped)."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            self.executor.cancel(ahead[1])

    def received(self, site: Site) -> dict[str, torch.Tensor]:
        """What ``site`` receives this round, on the run's device."""
        return {k: v.to(self.device) for k, v in self.downlink.for_site(site.name).items()}

    def run_round(self, round_num: int) -> list[dict[str, Any]]:
        """Run round ``round_num`` (1 … rounds); returns its metrics rows."""
        replies, outcome = run_round(self.core, self, round_num, self.downlink)
        self.record(round_num, replies, outcome)
        if outcome.stop:  # on_rejected: stop — the round was aggregated without them; the run stops here
            raise RoundStopped(str(outcome.stopped(round_num)), replies.rows)
        return replies.rows

    def record(self, round_num: int, replies: Replies, outcome: RoundOutcome) -> None:
        """Round ``round_num``'s rows after its sites': who was left out and why, and the evaluation of
        the new model (the test split, each site's own model, the uploaded local models, the sites'
        validation parts, the linear probe)."""
        rows = replies.rows
        if outcome.note:
            logger.warning("round %d aggregated without rejected upload(s): %s", round_num, outcome.note)
        rows.extend(metric_row(round_num, site, "rejected", 0, {}) for site in outcome.excluded)
        rows.extend(metric_row(round_num, site, "likely_cause", 0,
                               {"moved_round": m.round, "update_ratio": m.update_ratio, "spread": m.spread,
                                "share": m.share, "move_ratio": m.move_ratio})
                    for site, m in sorted(self.screen.causes.get(round_num, {}).items()))
        evaluation = self.algorithm.evaluate(self.downlink, self.server, self.test)
        if isinstance(self.algorithm, PersonalEvaluation):  # the capability: each site's own model
            evaluation.update(self.personalized_evaluation(round_num))
        if self.local_evaluation:
            evaluation.update(self.local_model_evaluation(outcome.accepted))
        evaluation.update(self.validation_evaluation(round_num))
        if self.linear_probe and "probe_accuracy" not in evaluation:
            load_weights(self.server.model, self.downlink.global_tensors)
            evaluation.update(linear_probe(self.server.model.encoder, self.server.labelled, self.test, self.device,
                                           module=self.server.model))
        rows.append(metric_row(round_num, GLOBAL_SITE, "evaluate", len(self.test),
                               {**evaluation, **self.downlink.metrics}))


_FEDERATIONS: dict[str, Federation] = {}  # one federation per configuration, per worker process


def worker_federation(config: dict[str, Any]) -> Federation:
    """The federation ``config`` describes, built once per worker process (its data, shards, public
    set) for the executors that train sites away from the driver."""
    import json

    key = json.dumps(config, sort_keys=True)
    if key not in _FEDERATIONS:
        _FEDERATIONS.clear()  # one run at a time per worker: the previous run's data is dropped
        _FEDERATIONS[key] = Federation(RunConfig.from_dict({**config, "executor": {"kind": "sequential"}}))
    return _FEDERATIONS[key]


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    return mean, (sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)) ** 0.5


class SequentialExecutor:
    """The reference executor: a round's sites one after another, in this process."""

    name = "sequential"

    def train_sites(self, federation: Federation, sites: list[Site], round_num: int) -> dict[str, SiteOutcome]:
        reference = federation.downlink.global_tensors
        return {site.name: federation.train_site(site, round_num, federation.received(site), reference)
                for site in sites}

    def close(self) -> None:
        pass
