"""The aggregator's round, engine-free: what every engine's server did in its own copy before — set
up the plugin, its model, context, declarations, upload screen and secure-sum layout; then per round
validate every upload against the declaration, screen it (bounds, the plugin's checks, replays,
clipping), decide what to do with the rejected ones (``robustness.on_rejected``), aggregate through
the screen (blame), or take the secure sum's downlink. An engine hands in what arrived and gets the
downlink and what was excluded, with the reasons, to carry and record.

Rounds are numbered 1 … ``rounds`` in code, records and logs alike (``round_num``); 0 is the initial
model, before the first round. An engine that counts from 0 (OpenFL) converts once, where it calls in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..algorithms import Downlink, InvalidUploadError, ServerContext, validate_uploads
from ..config import RunConfig, site_names
from ..construction import build_algorithm_with_public, initial_model, server_seed, upload_screen
from ..devices import resolve_device
from ..privacy.secagg_terms import SumLayout
from ..robust import RejectedUpload


@dataclass
class RoundOutcome:
    """What a round of the aggregator produced: the next ``downlink``; the uploads it aggregated
    (``accepted``, site → tensors; empty under secure aggregation); every site left out, with the
    sentence the records carry (``excluded``); and, when the round went on without some, the one line
    the engine reports (``note``)."""

    downlink: Downlink
    accepted: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)
    note: str | None = None
    stop: str | None = None  # under ``on_rejected: stop``: why the federation stops after this round

    def stopped(self, round_num: int) -> RejectedUpload:
        """The sentence an engine stops with, once it recorded the round."""
        return RejectedUpload(f"rejected upload(s): {self.stop}; round {round_num} was aggregated without them "
                              "and the federation stops so that the operator can look at the sender "
                              "(robustness.on_rejected: stop)")


class AggregatorRound:
    """The aggregator of a federation under ``config``: ``shape`` (in_channels, image_size,
    num_classes) builds the model; ``public`` is the public data set where the plugin needs one (on
    ``device``); ``labelled`` the labelled data a simulator's evaluation may use."""

    def __init__(self, config: RunConfig, shape: dict[str, int], *, public: Any = None,
                 device: torch.device | None = None, labelled: Any = None) -> None:
        self.config = config
        self.sites = site_names(config)
        self.algorithm = build_algorithm_with_public(config, public)
        self.device = device if device is not None else resolve_device(config.device)
        model = initial_model(config, in_channels=shape["in_channels"], image_size=shape["image_size"],
                              num_classes=shape["num_classes"]).to(self.device)
        self.server = ServerContext(model=model, round_num=0, seed=server_seed(config, 0), device=self.device,
                                    num_classes=shape["num_classes"], public=public, sites=list(self.sites),
                                    labelled=labelled)
        self.specs = self.algorithm.upload_specs(model, shape["num_classes"])
        downloads = self.algorithm.download_specs(model, shape["num_classes"])
        self.global_specs = [s for s in downloads if not s.per_site]
        self.personal_specs = [s for s in downloads if s.per_site]
        self.screen = upload_screen(config, self.algorithm)
        secure = config.secure_aggregation  # the layout of the secure sum, agreed before any round
        self.sum_layout = None if secure is None else SumLayout.of(self.algorithm, self.specs, secure)

    @property
    def model(self) -> torch.nn.Module:
        return self.server.model

    def initial_downlink(self) -> Downlink:
        return self.algorithm.initial_downlink(self.server)

    # --- one round ---------------------------------------------------------------------------------
    def begin(self, round_num: int, previous: dict[str, torch.Tensor] | None) -> None:
        """What the plugin's aggregator task sees of round ``round_num``: its seed, every site of the
        federation, and the global downlink the round's sites received."""
        self.server.round_num = round_num
        self.server.seed = server_seed(self.config, round_num)
        self.server.sites = list(self.sites)
        self.server.previous = previous

    def aggregate(self, round_num: int, uploads: dict[str, dict[str, torch.Tensor]], weights: dict[str, float],
                  previous: dict[str, torch.Tensor] | None, *, rejected: dict[str, str] | None = None,
                  facts: dict[str, Any] | None = None) -> RoundOutcome:
        """Round ``round_num`` from the sites' ``uploads`` (on this aggregator's device, in the order
        they are to be summed) and ``weights``; ``rejected``: sites the engine already refused (e.g. an
        upload it could not unpack). Raises :class:`~fedcontrast.robust.RejectedUpload` when the plan
        stops on a rejection, or nothing is left to aggregate. ``facts``: site → its upload as its site
        measured it for the screen (:class:`~fedcontrast.robust.screen.UploadFacts`): the simulator's
        sites, which run this code; a deployed engine passes none and the screen measures what arrived."""
        valid, invalid = self.validate(round_num, uploads, weights, facts)
        rejected = {**(rejected or {}), **invalid}
        self.begin(round_num, previous)
        accepted, kept, refused = self.screen.screen(round_num, valid, weights, previous, facts)
        rejected.update(refused)
        excluded, note = self._settle(round_num, rejected, accepted)
        downlink, blamed = self.screen.aggregate(lambda u, w: self.algorithm.aggregate(u, w, self.server),
                                                 accepted, kept, self.server.state, round_num)
        blamed_excluded, blamed_note = self._settle(round_num, blamed, accepted)
        excluded.update(blamed_excluded)
        notes = "; ".join(n for n in (note, blamed_note) if n) or None
        stop = notes if notes and self.config.robustness.on_rejected == "stop" else None
        return RoundOutcome(downlink, {s: u for s, u in accepted.items() if s not in blamed},
                            dict(sorted(excluded.items())), None if stop else notes, stop)

    def validate(self, round_num: int, uploads: dict[str, dict[str, torch.Tensor]], weights: dict[str, float],
                 facts: dict[str, Any] | None = None) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, str]]:
        """The uploads as the plugin declares them (names, shapes, dtypes, finite values) with a weight,
        and the others, each with the sentence the records carry. ``facts``: as in :meth:`aggregate`
        (values its site found finite are not checked again)."""
        valid, rejected = {}, {}
        facts = facts or {}
        for site, upload in uploads.items():
            try:
                if site not in weights:
                    raise InvalidUploadError(f"site {site!r} sent no aggregation weight; rejected")
                validate_uploads(site, upload, self.specs, finite=getattr(facts.get(site), "finite", False))
            except InvalidUploadError as exc:
                rejected[site] = f"round {round_num}: {exc}"
                continue
            valid[site] = upload
        return valid, rejected

    def settle(self, round_num: int, rejected: dict[str, str],
               accepted: Mapping[str, Mapping[str, torch.Tensor]]) -> tuple[dict[str, str], str | None]:
        """Sites refused before a secure round: the sentences the records carry, and their reasons in
        one line (raises :class:`RejectedUpload` when none is left)."""
        return self._settle(round_num, rejected, accepted)

    def aggregate_secure(self, round_num: int, total: np.ndarray, previous: dict[str, torch.Tensor] | None, *,
                         rejected: dict[str, str] | None = None, note: str | None = None,
                         survivors: int | None = None) -> RoundOutcome:
        """Round ``round_num`` from the unmasked secure sum of the survivors' terms (``total``, float64);
        ``rejected``: sites left out (refused before the protocol, withdrawn, a bad share), with the
        reason; ``note``: the refusals' reasons in one line (:meth:`settle`), which stop the federation
        under ``on_rejected: stop`` as in :meth:`aggregate`; ``survivors``: how many sites' terms are in
        the sum (a count sum they could not have sent is refused, :meth:`SumLayout.downlink`)."""
        if self.sum_layout is None:
            raise RejectedUpload("secure aggregation is off in this plan; there is no secure sum to aggregate")
        self.begin(round_num, previous)
        downlink = self.sum_layout.downlink(self.algorithm, total, self.server, survivors=survivors)
        stop = note if note and self.config.robustness.on_rejected == "stop" else None
        return RoundOutcome(downlink, {}, dict(sorted((rejected or {}).items())), None if stop else note, stop)

    def _settle(self, round_num: int, rejected: dict[str, str],
                accepted: Mapping[str, Mapping[str, torch.Tensor]]) -> tuple[dict[str, str], str | None]:
        """The rejections explained (the likely cause where the global model may explain them) and their
        reasons in one line; raises :class:`RejectedUpload` when nothing is left to aggregate."""
        if not rejected:
            return {}, None
        explained, hint = self.screen.explain(round_num, rejected, bool(accepted))
        reasons = "; ".join(explained[s] for s in sorted(explained))
        if not accepted:
            raise RejectedUpload(reasons + "; no upload left to aggregate" + hint)
        return explained, reasons

    # --- state an engine keeps between rounds (checkpoints, a restarted aggregator) -----------------
    def state_dict(self) -> dict[str, Any]:
        return {"server_state": self.server.state, "upload_digests": self.screen.digests}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.server.state = state.get("server_state", {})
        self.screen.digests = dict(state.get("upload_digests", {}))  # older checkpoints have none
