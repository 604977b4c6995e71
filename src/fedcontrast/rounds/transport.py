"""The seam between the round and an engine: a :class:`SiteTransport` carries a round's downlink to
its sites and their replies back (and, under secure aggregation, runs the protocol that yields only
the sum); a :class:`RoundRecorder` keeps what the engine records of a finished round. The loop that
joins them to the aggregator's round (:class:`~.server.AggregatorRound`) exists once, here:
:func:`run_round` for one round, :func:`run_rounds` for a run.

The simulator's executors (sequential, Ray, Flower's simulation) and the Flower deployment are
transports; OpenFL, which owns its loop, calls the same :class:`~.server.AggregatorRound` steps from
its aggregator. A new engine implements :class:`SiteTransport` (two methods) and, for its records,
:class:`RoundRecorder`; docs/layout.md, "Adding an engine", walks through one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from ..algorithms import Downlink
from .server import AggregatorRound, RoundOutcome

Tensors = dict[str, torch.Tensor]


@dataclass
class Replies:
    """What came back from a round's sites. ``uploads`` and ``weights``: each answering site's
    uploads (on the aggregator's device) and released aggregation weight — empty under secure
    aggregation where the engine never holds an upload alone; ``facts``: each upload as its site
    measured it for the screen (the simulator; a deployed engine leaves it empty and the screen
    measures what arrived); ``rejected``: sites the engine already refused, with the sentence its
    records carry (an upload it could not unpack); ``rows``: the engine's metric rows of the round so
    far; ``messages``: the engine's own replies, for its secure sum and its records."""

    uploads: dict[str, Tensors] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    messages: dict[str, Any] = field(default_factory=dict)


@dataclass
class SecureSum:
    """The unmasked secure sum of the survivors' terms (``total``, float64, laid out as
    :class:`~fedcontrast.privacy.secagg_terms.SumLayout` says), how many sites' terms are in it
    (``survivors``), and the sites the protocol left out, with the reason (withdrawn, a bad share)."""

    total: np.ndarray
    survivors: int
    rejected: dict[str, str] = field(default_factory=dict)


class SiteTransport(Protocol):
    """How an engine reaches its sites."""

    def exchange(self, round_num: int, downlink: Downlink) -> Replies:
        """Sends each site of round ``round_num`` what it receives of ``downlink``
        (:meth:`Downlink.for_site`), has it run the plugin's tasks and returns what came back. A site
        that fails is the engine's to report: it raises, or leaves the site out of the replies."""
        ...

    def secure_sum(self, round_num: int, replies: Replies, uploads: dict[str, Tensors]) -> SecureSum:
        """Under secure aggregation only: the sum of the terms of the sites in ``uploads`` (those the
        aggregator validated, where the engine holds them; else every site that answered), by the
        protocol in :mod:`fedcontrast.privacy`; the engine may add its cost rows to ``replies.rows``."""
        ...

    def prepare(self, round_num: int, downlink: Downlink) -> None:
        """Round ``round_num``'s ``downlink`` exists (the round before was aggregated): a transport
        that trains sites elsewhere may send them now, while the engine records the round before."""
        ...


class RoundRecorder(Protocol):
    """What an engine keeps of each round: rows, evaluations, checkpoints, progress."""

    def record(self, round_num: int, replies: Replies, outcome: RoundOutcome) -> None:
        """Round ``round_num`` is aggregated (``outcome``): record it. Called before the run stops on
        a rejection (``outcome.stop``), so that the stopping round is on record."""
        ...


def run_round(core: AggregatorRound, transport: SiteTransport, round_num: int,
              downlink: Downlink) -> tuple[Replies, RoundOutcome]:
    """Round ``round_num`` (1 … rounds) from ``downlink`` (the model after the round before): the
    sites' replies through ``transport``, then the aggregator's decisions (validation, the upload
    screen, blame; or, under secure aggregation, validation and the protocol's sum), then the next
    round's downlink offered to the transport. Raises :class:`~fedcontrast.robust.RejectedUpload`
    when nothing is left to aggregate."""
    if round_num < 1:
        raise ValueError(f"round {round_num}: rounds count from 1 (0 is the initial model)")
    replies = transport.exchange(round_num, downlink)
    previous = downlink.global_tensors
    if core.sum_layout is None:
        outcome = core.aggregate(round_num, replies.uploads, replies.weights, previous,
                                 rejected=replies.rejected, facts=replies.facts)
    else:  # the aggregator sees only the sum (fedcontrast.privacy.secagg*)
        valid, invalid = core.validate(round_num, replies.uploads, replies.weights)
        excluded, note = core.settle(round_num, {**replies.rejected, **invalid}, valid)
        summed = transport.secure_sum(round_num, replies, valid)
        outcome = core.aggregate_secure(round_num, summed.total, previous, rejected={**excluded, **summed.rejected},
                                        note=note, survivors=summed.survivors)
        outcome.accepted = valid
    transport.prepare(round_num + 1, outcome.downlink)
    return replies, outcome


def run_rounds(core: AggregatorRound, transport: SiteTransport, recorder: RoundRecorder, downlink: Downlink,
               first: int, last: int) -> Downlink:
    """Rounds ``first`` … ``last`` from ``downlink``, each recorded by ``recorder``; returns the
    downlink after the last. Under ``robustness.on_rejected: stop`` a round that left a site out is
    aggregated and recorded, then the run stops with the sentence that says why."""
    for round_num in range(first, last + 1):
        replies, outcome = run_round(core, transport, round_num, downlink)
        downlink = outcome.downlink
        recorder.record(round_num, replies, outcome)
        if outcome.stop:
            raise outcome.stopped(round_num)
    return downlink
