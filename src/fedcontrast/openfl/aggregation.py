"""OpenFL aggregation function that runs the plugin's aggregator task over the whole round.

A plugin's rule may need every tensor of every site at once (dual aggregation, prototype fill,
distillation). Each site uploads everything it declares as one packed vector (see ``packing``), so
OpenFL calls this function once per round with every site's upload: it unpacks and validates each
one against the plugin's declaration, runs ``algorithm.aggregate`` once, stores per-site downlinks
for the next round, and returns the packed global downlink, which OpenFL serves as next round's
model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from openfl.interface.aggregation_functions.core import AggregationFunction

from ..algorithms import InvalidUploadError
from ..algorithms.base import WEIGHT_PREFIX
from ..atomic import atomic_torch_save
from ..config import RunConfig
from ..construction import algorithm_class, load_public
from ..devices import resolve_device
from ..errors import FedContrastError
from ..outputs import write_json
from ..robust import RejectedUpload
from ..rounds import AggregatorRound
from .packing import GLOBAL_PACKED, PERSONAL_PACKED, pack, unpack
from .runner import PERSONAL_TAG, WEIGHT_METRIC

if TYPE_CHECKING:
    from ..privacy.secagg_relay import SecAggRelay

logger = logging.getLogger(__name__)

@dataclasses.dataclass
class AggregatorLink:
    """What OpenFL's aggregator (openfl/aggregator.py) and the aggregation function it builds on its
    own from the plan (:class:`PluginAggregation`, a singleton) share within one aggregator process;
    the aggregator opens a fresh one when it starts (:func:`open_link`)."""

    report_dir: str | None = None  # where per-site downlinks and upload digests are kept for a restart
    relay: SecAggRelay | None = None  # under secure aggregation: the relay holding the round's unmasked sum
    # under on_rejected: stop, why the federation stops after this round (the aggregator reads and clears it)
    stop: list[str] = dataclasses.field(default_factory=list)
    # every upload the round left out, site → reason (the round's record takes and clears them)
    excluded: dict[str, str] = dataclasses.field(default_factory=dict)
    # the round's uploaded local models (site → model.* tensors) of a plugin asking for their evaluation
    local_models: dict[str, dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)


LINK = AggregatorLink()


def open_link(report_dir: str | None, relay: SecAggRelay | None) -> AggregatorLink:
    """A fresh link for the aggregator starting in this process."""
    global LINK
    LINK = AggregatorLink(report_dir, relay)
    return LINK


class AggregationFailure(FedContrastError):
    """The plugin's aggregator task cannot produce this round's result."""


class PluginAggregation(AggregationFunction):
    """``tasks.<task>.aggregation_type: {template: fedcontrast.openfl.aggregation.PluginAggregation,
    settings: {run_config: ..., model_shape: ...}}``."""

    def __init__(self, run_config: dict[str, Any] | None = None, model_shape: dict[str, int] | None = None) -> None:
        super().__init__()
        self._privileged = True  # receives the tensor database itself (OpenFL holds its lock)
        try:
            self._build(run_config, model_shape)
        except FedContrastError as exc:  # e.g. the public folder missing here: one sentence, no traceback
            print(f"fedcontrast aggregator: error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    def _build(self, run_config: dict[str, Any] | None, model_shape: dict[str, int] | None) -> None:
        self.config = RunConfig.from_dict(run_config or {})
        shape = model_shape or {}
        device = resolve_device(self.config.device)
        public = None
        if algorithm_class(self.config).requires_public:  # e.g. FLESD distils on the public set here
            public = load_public(self.config)  # the plan's public folder (fingerprint checked)
            public = public.to(device) if public is not None else None
        self.core = AggregatorRound(self.config, shape, public=public, device=device)  # fedcontrast.rounds
        self.algorithm, self.server, self.specs = self.core.algorithm, self.core.server, self.core.specs
        self.sum_layout, self.screen = self.core.sum_layout, self.core.screen
        self.digests_loaded = False
        self.global_specs, self.personal_specs = self.core.global_specs, self.core.personal_specs

    def call(self, local_tensors, tensor_db, tensor_name: str, fl_round: int, tags: tuple[str, ...]) -> np.ndarray:
        """Called once per round, for the packed upload of the round's last task."""
        if tensor_name != GLOBAL_PACKED:
            raise AggregationFailure(f"unexpected tensor {tensor_name!r}: fedcontrast sends one packed tensor")
        return self._aggregate_round(tensor_db, fl_round, {lt.col_name: lt.tensor for lt in local_tensors})

    def _save_digests(self) -> None:
        if LINK.report_dir is not None and self.config.robustness.reject_replays:  # nothing hashed otherwise
            write_json(digests_path(LINK.report_dir), self.screen.digests)

    def received_downlink(self, db, fl_round: int) -> dict[str, torch.Tensor] | None:
        """The global downlink the sites received for ``fl_round`` (OpenFL's stored model of that
        round, which survives an aggregator restart), or None when the database lacks it."""
        rows = db[(db["tensor_name"] == GLOBAL_PACKED) & (db["round"] == fl_round) & (db["tags"] == ("model",))]
        if len(rows) == 0:
            return None
        tensors = unpack(rows["nparray"].iloc[-1], self.global_specs)
        return {k: v.to(self.server.device) for k, v in tensors.items()}

    def _aggregate_round(self, db, fl_round: int, packed: dict[str, np.ndarray]) -> np.ndarray:
        """OpenFL's round ``fl_round`` (counted from 0, as its tensor database keys it) is round
        ``fl_round + 1`` for everything of fedcontrast: the round core, records and sentences."""
        round_num = fl_round + 1
        if self.config.secure_aggregation is not None:
            return self._aggregate_secure_sum(db, fl_round)
        sites = tuple(sorted(packed))
        weights = read_weights(db, fl_round, sites)
        unpacked, rejected = {}, {}
        for site in sites:
            try:
                uploads = unpack(packed[site], self.specs, sender=f"site {site!r}")
                unpacked[site] = {k: v.to(self.server.device) for k, v in uploads.items()}
            except InvalidUploadError as exc:
                logger.error("round %d: %s", round_num, exc)
                rejected[site] = f"round {round_num}: {exc}"
        kept = LINK.report_dir
        if not self.digests_loaded and kept is not None and digests_path(kept).exists():
            self.screen.digests = json.loads(digests_path(kept).read_text())  # a restarted aggregator
        self.digests_loaded = True
        previous = self.received_downlink(db, fl_round)
        try:  # validation, the screen (bounds, the plugin's checks, replays, clipping), blame: the core's
            outcome = self.core.aggregate(round_num, unpacked, weights, previous, rejected=rejected)
        except RejectedUpload as exc:  # nothing left to aggregate
            raise AggregationFailure(f"round {round_num}: {exc}") from None
        LINK.excluded.update(outcome.excluded)
        if outcome.stop:  # on_rejected: stop — aggregated without them; the aggregator stops after this round
            LINK.stop.append(outcome.stop)
        elif outcome.note:
            logger.warning("aggregated without rejected upload(s): %s", outcome.note)
        self._save_digests()
        if self.algorithm.evaluates_local_models:
            LINK.local_models.clear()
            LINK.local_models.update({site: {k: v for k, v in up.items() if k.startswith(WEIGHT_PREFIX)}
                                 for site, up in outcome.accepted.items()})
        return self._store_downlink(db, fl_round, outcome.downlink)

    def _store_downlink(self, db, fl_round: int, downlink) -> np.ndarray:
        """Per-site downlinks into the database (and a file, for a restart), keyed as OpenFL keys the
        next round (``fl_round + 1``, counted from 0); the packed global one."""
        if downlink.personal:
            origin = aggregator_origin(db)
            for site, tensors in downlink.personal.items():
                db.store(tensor_name=PERSONAL_PACKED, origin=origin, fl_round=fl_round + 1, tags=(site, PERSONAL_TAG),
                         nparray=pack(tensors, self.personal_specs))
            if LINK.report_dir is not None:
                save_personal(LINK.report_dir, fl_round + 1, downlink.personal)
        return pack(downlink.global_tensors, self.global_specs)

    def _aggregate_secure_sum(self, db, fl_round: int) -> np.ndarray:
        """The downlink from the relay's unmasked sum of the survivors' secure-sum terms (the
        plugin's :meth:`~fedcontrast.algorithms.Algorithm.aggregate_secure`); the aggregator saw no upload alone."""
        relay = LINK.relay
        if relay is None:
            raise AggregationFailure("secure aggregation is on but the aggregator has no relay")
        round_num = fl_round + 1  # fedcontrast's count (OpenFL's database counts from 0)
        outcome = self.core.aggregate_secure(round_num, relay.total(round_num), self.received_downlink(db, fl_round),
                                             rejected={**relay.withdrawn, **relay.blamed},
                                             survivors=len(relay.survivors))
        LINK.excluded.update(outcome.excluded)
        logger.info("round %d: aggregated the secure sum of %s (unmasking: %.3f s of CPU)", round_num,
                    ", ".join(relay.survivors), relay.unmask_cpu_s)
        for site, why in sorted(relay.blamed.items()):
            logger.warning("round %d: site %s sent a bad secure-aggregation share: %s", round_num, site, why)
        for site, why in sorted(relay.withdrawn.items()):
            logger.warning("round %d: site %s took no part in the secure sum: %s", round_num, site, why)
        return self._store_downlink(db, fl_round, outcome.downlink)


def aggregator_origin(db) -> str:
    """The aggregator's id, as the origin of the global model rows it wrote."""
    rows = db[db["tags"] == ("model",)]
    if len(rows) == 0:
        raise AggregationFailure("the tensor database holds no global model rows; cannot address per-site tensors")
    return rows["origin"].iloc[0]


def digests_path(directory: str) -> Path:
    """What each site has sent (SHA-256 per upload, and its round), so that a restarted aggregator
    still recognises a replay."""
    return Path(directory) / "upload_digests.json"


def personal_path(directory: str, round_number: int) -> Path:
    return Path(directory) / f"personal_round_{round_number}.pt"


def save_personal(directory: str, round_number: int, personal: dict[str, dict[str, torch.Tensor]]) -> None:
    """Per-site downlinks are not in OpenFL's persistent DB: keep them so a restart can serve them."""
    atomic_torch_save({s: {k: v.detach().cpu() for k, v in t.items()} for s, t in personal.items()},
                      personal_path(directory, round_number))


def read_weights(db, fl_round: int, sites: tuple[str, ...]) -> dict[str, float]:
    """Each site's aggregation weight (its sample count, sent as a metric) for ``fl_round``.

    Collaborator rows carry the site name among their tags (in no fixed order).
    """
    weights: dict[str, float] = {}
    wanted = set(sites)
    rows = db[(db["round"] == fl_round) & (db["tensor_name"] == WEIGHT_METRIC)]
    for row_tags, array in zip(rows["tags"], rows["nparray"]):
        owners = set(row_tags) & wanted
        if len(owners) == 1 and set(row_tags) - owners == {"metric"}:
            weights[owners.pop()] = float(np.asarray(array))
    return weights
