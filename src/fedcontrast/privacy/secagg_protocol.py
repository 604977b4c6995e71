"""Secure aggregation between processes: the aggregator's relay and a site's side of one round, as
messages any engine can carry (:mod:`.secagg` has the cryptography; this module the order, checks and
dropouts of Bonawitz et al.'s protocol against an actively lying server, with its consistency round).

The aggregator (:class:`~.secagg_relay.SecAggRelay`) only routes and sums. Each phase collects one
message from every site still in the round and closes when all have arrived, or when the engine's
deadline closes it with those present (fewer than the threshold ends the round). A site sends, then
fetches: *advert* (its signed keys, seed commitment and graph commitment; or a withdrawal) →
``commitments``; *graph* (SecAgg+ only: its graph randomness) → ``adverts`` (every site's randomness
and its neighbourhood's adverts, U1); *boxes* (its encrypted shares and its signed deal) → ``boxes``
(those addressed to it, their deals, U2); *masked* → ``survivors`` (U3); *consistency* (its
signature over U3) → ``signatures``; *reveal* (shares of ``b`` for U3, of the ``s`` key for U2 − U3,
each with its path to its dealer's signed root).

A site never trusts the relay's sets: each must be a subset of the one before, hold the site itself
and at least the threshold (in SecAgg+, ``t_k`` of its neighbourhood), or the site stops with one
sentence; it reveals only once enough members of U3 signed that very U3, and works out U2 − U3
itself. Every signature is bound to the session (:func:`session_digest`), the round, the threshold
and the signer; a peer's long-term key is checked by the engine and the site's pinned roster
(:class:`~.secagg_keys.PinnedKeys`) before a share is sent. Messages are JSON (bytes in base64)
except the masked vector (raw ring words); a malformed one raises :class:`SecureAggregationError`
naming the sender. The guarantee is in docs/privacy.md.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..config.sections import minimum_threshold
from .secagg import (
    MAX_DEPTH,
    Quantizer,
    SecAggSite,
    SecureAggregationError,
    graph_commitment,
    tree_depth,
)
from .secagg_graph import Graph, graph_for, graph_seed, neighbourhood_size, neighbourhood_threshold
from .secagg_keys import PinnedKeys, public_key_of  # noqa: F401 (re-exported)
from .shamir import share_size

PHASES = ("advert", "graph", "boxes", "masked", "consistency", "reveal")
# what a site fetches → the phase that closed before it
ANSWERS = {"commitments": 1, "adverts": 2, "boxes": 3, "survivors": 4, "signatures": 5}
KEY_BYTES = 32
ADVERT_FIELDS = ("c_pk", "s_pk", "commit", "graph", "signature", "certificate")
MAX_SIGNATURE, MAX_CERTIFICATE, MAX_REASON = 1024, 16384, 500


def share_bytes(full: bool) -> int:
    """A share's bytes: of a 32-byte secret in the full graph, of a 16-byte one in SecAgg+'s
    (:meth:`~.secagg.SecAggSite.short_secrets`); 17 bytes per 16 (:func:`~.shamir.share_size`)."""
    return share_size(32 if full else 16)


def box_bytes(full: bool, holders: int) -> int:
    """A box's bytes for a dealer with ``holders`` holders (itself included): the index (2 bytes),
    the ``b`` share, the ``s`` share, the Merkle path to the dealer's signed root and the Poly1305 tag."""
    return 2 + 2 * share_bytes(full) + 32 * tree_depth(holders) + 16


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: Any, size: int | None, what: str) -> bytes:
    if not isinstance(text, str):
        raise SecureAggregationError(f"{what} is not base64 text")
    try:
        data = base64.b64decode(text, validate=True)
    except (TypeError, ValueError):
        raise SecureAggregationError(f"{what} is not base64") from None
    if size is not None and len(data) != size:
        raise SecureAggregationError(f"{what} has {len(data)} bytes, not {size}")
    return data


def _json(payload: bytes, sender: str, kind: str) -> Any:
    try:
        return json.loads(payload.decode())
    except (UnicodeDecodeError, ValueError, AttributeError):
        raise SecureAggregationError(f"{sender}'s secure-aggregation {kind} message is not JSON; refused") from None


def _names(value: Any, what: str) -> list[str]:
    if not (isinstance(value, list) and all(isinstance(s, str) for s in value) and len(set(value)) == len(value)):
        raise SecureAggregationError(f"{what} is not a list of distinct site names; refused")
    return value


def session_digest(config: Mapping[str, Any], sites: list[str], run: str = "") -> bytes:
    """What every party derives from its own copy of the plan (its run configuration ``config`` as a
    mapping, the federation's ``sites`` in order, the engine's run label): every signature is bound
    to it, so nothing signed for one federation, plan or run verifies in another."""
    text = json.dumps({"config": config, "sites": list(sites), "run": str(run)}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).digest()


def check_advert(site: str, advert: Any, what: str) -> dict[str, str]:
    """An advert of ``site`` in its exact shape (each key and the commitment 32 bytes, a signature, a
    certificate or key as text); raises naming ``what`` it came from."""
    if not isinstance(advert, dict) or set(advert) != set(ADVERT_FIELDS):
        raise SecureAggregationError(f"{what}: site {site}'s advert does not carry exactly its keys, commitment, "
                                     f"signature and certificate ({', '.join(ADVERT_FIELDS)})")
    try:
        for name in ("c_pk", "s_pk", "commit", "graph"):
            _unb64(advert[name], KEY_BYTES, name)
        if len(_unb64(advert["signature"], None, "its signature")) > MAX_SIGNATURE:
            raise SecureAggregationError("its signature is too long")
    except SecureAggregationError as exc:
        raise SecureAggregationError(f"{what}: site {site}'s advert is malformed ({exc})") from None
    if not isinstance(advert["certificate"], str) or not advert["certificate"] \
            or len(advert["certificate"]) > MAX_CERTIFICATE:
        raise SecureAggregationError(f"{what}: site {site}'s advert carries no certificate or key (text)")
    return advert


# The graph seeds drawn from commitments and revealed randomness that checked out, by the SHA-256 of
# both (the session and round included): in the simulator every site draws the same graph in one
# process, and the n checks of every reveal against its commitment are made once, not n times.
_DRAWN: dict[bytes, bytes] = {}


# --- a site --------------------------------------------------------------------------------------
def _answer(payload: bytes | None) -> Any:
    """The relay's answer; a site the relay dropped raises (the sentence says why)."""
    if payload is None:
        raise SecureAggregationError("the aggregator sent no secure-aggregation answer")
    answer = _json(payload, "the aggregator", "answer")
    if isinstance(answer, dict) and set(answer) == {"dropped"} and isinstance(answer["dropped"], str):
        raise SecureAggregationError(answer["dropped"][:MAX_REASON])
    if not isinstance(answer, dict):
        raise SecureAggregationError("the aggregator's secure-aggregation answer is not a mapping; refused")
    return answer


class SecAggSteps:
    """One site's side of one round, one step per message of the aggregator (an engine that pushes
    messages, like Flower's, calls them in turn; :class:`SecAggClient` drives them by polling):
    :meth:`advert` → :meth:`boxes` (given every site's advert) → :meth:`masked` (given the shares
    addressed to it) → :meth:`consistency` (given the survivors) → :meth:`reveal` (given their
    signatures). ``peer_key(site, certificate)``: that site's long-term public key once checked
    (:class:`PinnedKeys`); raises otherwise. ``session``: :func:`session_digest` of this site's plan.
    ``neighbours``: the plan's ``secure_aggregation.neighbours``; above a few dozen sites (SecAgg+,
    :mod:`.secagg_graph`) the site sees only its neighbourhood's adverts, shares and signatures, and
    refuses any set of the relay that names a site outside it."""

    def __init__(self, name: str, sites: list[str], threshold: int, round_num: int, signing_key: Any,
                 certificate: str, peer_key: Callable[[str, str], Any], vector: np.ndarray, quantizer: Quantizer,
                 session: bytes = b"", neighbours: str | int = "full") -> None:
        if name not in sites:
            raise SecureAggregationError(f"site {name} is not a site of this plan ({', '.join(sites)})")
        if not minimum_threshold(len(sites)) <= threshold <= len(sites):
            raise SecureAggregationError(f"the plan's secure-aggregation threshold {threshold} of {len(sites)} sites "
                                         "is "
                                         f"outside {minimum_threshold(len(sites))}..{len(sites)}: below a majority an "
                                         "operator that lies could unmask this site; this site takes no part")
        members, agreed = (peer_key.members, peer_key.threshold) if isinstance(peer_key, PinnedKeys) else (None, None)
        if (members is not None and set(members) != set(sites)) or (agreed is not None and agreed != threshold):
            raise SecureAggregationError(f"the plan's secure sum ({', '.join(sites)}; threshold {threshold}) is not "
                                         f"the roster this site's policy pins ({', '.join(members or sites)}; "
                                         f"threshold {agreed if agreed is not None else threshold}): this site takes "
                                         "no part")
        self.plan_sites, self.threshold, self.neighbours = list(sites), threshold, neighbours
        self.session, self.round_num = session, round_num
        self.site = SecAggSite(name, list(sites), threshold, round_num, signing_key, session)
        k = neighbourhood_size(len(sites), neighbours)
        self.full = k >= len(sites) - 1
        self.drawn: Graph | None = None  # SecAgg+: drawn once every site's randomness is revealed (:meth:`boxes`)
        self.around: frozenset[str] = frozenset(sites)  # this site and its neighbours (everyone in the full graph)
        self.t_k = threshold if self.full else neighbourhood_threshold(k)
        self.commitments: dict[str, bytes] = {}  # SecAgg+: every advert's commitment to its graph randomness
        if self.full:
            self.drawn = graph_for(list(sites), threshold, neighbours, session, round_num)
        else:
            self.site.share_threshold = self.t_k
            self.site.graph_terms = ("neighbours", k, self.t_k)
            self.site.short_secrets()
        self.certificate, self.peer_key, self.vector, self.quantizer = certificate, peer_key, vector, quantizer
        self.keys: dict[str, Any] = {name: signing_key.public_key()}
        self.u1: list[str] = []
        self.u2: list[str] = []
        self.u3: list[str] = []
        self.sent_advert: dict[str, str] = {}

    @property
    def name(self) -> str:
        return self.site.name

    def _round(self) -> str:
        return f"round {self.site.round_num}"

    def _members(self, names: list[str], within: list[str], what: str, threshold: int | None = None) -> list[str]:
        """``names`` (the relay's set) checked: within the previous set, holding this site, at least the
        threshold (in SecAgg+, ``t_k`` of this site's neighbourhood)."""
        threshold = self.t_k if threshold is None else threshold
        strangers = sorted(set(names) - set(within))
        if strangers:
            where = ("the sites of the phase before" if self.full or set(strangers) <= self.around
                     else f"this site's neighbourhood in {self._round()}'s graph")
            raise SecureAggregationError(f"the aggregator's {what} of {self._round()} names {', '.join(strangers)}, "
                                         f"outside {where}: refused, nothing more is sent")
        if self.name not in names:
            raise SecureAggregationError(f"the aggregator left this site ({self.name}) out of {self._round()}'s {what}")
        if len(names) < threshold:
            mine = "" if self.full else " of this site's neighbourhood"
            raise SecureAggregationError(f"the aggregator's {what} of {self._round()} has {len(names)} sites{mine}, "
                                         "fewer than "
                                         f"the threshold {threshold}: refused, nothing more is sent (fewer would "
                                         "let it unmask a single site)")
        named = set(names)
        return [s for s in within if s in named]  # in the plan's order

    def advert(self) -> bytes:
        advert = self.site.advertise()
        self.sent_advert = {**{k: _b64(v) for k, v in advert.items()}, "certificate": self.certificate}
        return json.dumps(self.sent_advert).encode()

    def graph(self, answer: bytes | None) -> bytes:
        """SecAgg+: given every advert's commitment to its graph randomness (the relay's set U1, fixed
        before any site reveals), this site's own randomness; the round's graph is drawn from all of
        them (:meth:`boxes`), so no party, the operator included, can choose or search it."""
        told = _answer(answer)
        if set(told) != {"commitments"} or not isinstance(told["commitments"], dict):
            raise SecureAggregationError("the aggregator's graph commitments are malformed; refused")
        names = self._members(list(told["commitments"]), self.plan_sites, "key adverts", self.threshold)
        self.commitments = {s: _unb64(told["commitments"][s], KEY_BYTES, f"site {s}'s graph commitment")
                            for s in names}
        if _b64(self.commitments[self.name]) != self.sent_advert["graph"]:
            raise SecureAggregationError(f"the aggregator's graph commitments of {self._round()} carry one for this "
                                         f"site ({self.name}) other than the one it sent: refused")
        return json.dumps({"randomness": _b64(self.site.graph_randomness)}).encode()

    def _draw_graph(self, reveals: Any) -> None:
        """The round's graph from every committed site's revealed randomness, each checked against its
        commitment (one missing or wrong: refused, nothing more is sent)."""
        if not isinstance(reveals, dict) or set(reveals) != set(self.commitments):
            raise SecureAggregationError(f"the aggregator's graph randomness of {self._round()} is not that of "
                                         "exactly the sites whose commitments it sent: refused, nothing more is sent")
        if not all(isinstance(v, str) for v in reveals.values()):
            raise SecureAggregationError("the aggregator's graph randomness is malformed; refused")
        key = hashlib.sha256(b"|".join([self.session, str(self.round_num).encode()]
                                       + [f"{s}:{self.commitments[s].hex()}:{reveals[s]}".encode()
                                          for s in sorted(reveals)])).digest()
        seed = _DRAWN.get(key)
        if seed is None:
            randomness = {}
            for site, text in reveals.items():
                value = _unb64(text, KEY_BYTES, f"site {site}'s graph randomness")
                if graph_commitment(self.session, self.round_num, site, value) != self.commitments[site]:
                    raise SecureAggregationError(f"site {site}'s graph randomness of {self._round()} does not match "
                                                 "its commitment: refused, nothing more is sent")
                randomness[site] = value
            seed = graph_seed(self.session, self.round_num, randomness)
            _DRAWN[key] = seed
            while len(_DRAWN) > 64:
                del _DRAWN[next(iter(_DRAWN))]
        self.drawn = graph_for(self.plan_sites, self.threshold, self.neighbours, seed, self.round_num)
        self.around = self.drawn.closed(self.name)
        self.site.graph_seed = seed

    def boxes(self, answer: bytes | None) -> bytes:
        told = _answer(answer)
        if set(told) != {"reveals", "adverts"} or not isinstance(told["adverts"], dict):
            raise SecureAggregationError("the aggregator's adverts are malformed; refused")
        adverts = told["adverts"]
        if not self.full:
            self._draw_graph(told["reveals"])
        elif told["reveals"] != {}:
            raise SecureAggregationError("the aggregator sent graph randomness for a round on the full graph; refused")
        self.u1 = self._members(list(adverts), [s for s in self.plan_sites if s in self.around], "key adverts")
        for peer in self.u1:
            check_advert(peer, adverts[peer], "the aggregator's adverts")
        if adverts[self.name] != self.sent_advert:
            raise SecureAggregationError(f"the aggregator's adverts of {self._round()} carry keys for this site "
                                         f"({self.name}) other than the ones it sent: refused")
        for peer in self.u1:
            if not self.full and adverts[peer]["graph"] != _b64(self.commitments.get(peer, b"")):
                raise SecureAggregationError(f"site {peer}'s advert commits to other graph randomness than the "
                                             f"aggregator's list of {self._round()}: refused")
            if peer != self.name:
                self.keys[peer] = self.peer_key(peer, adverts[peer]["certificate"])
        self.site.sites = list(self.u1)
        boxes = self.site.share({p: {k: _unb64(adverts[p][k], None, k) for k in ("c_pk", "s_pk", "commit", "graph",
                                                                                  "signature")}
                                 for p in self.u1}, self.keys)
        assert self.site.deal is not None  # signed by share()
        return json.dumps({"boxes": {p: _b64(b) for p, b in boxes.items()},
                           "deal": [_b64(self.site.deal[0]), _b64(self.site.deal[1])]}).encode()

    def masked(self, answer: bytes | None) -> bytes:
        mine = _answer(answer)
        if set(mine) != {"peers", "boxes", "deals"} or not isinstance(mine["boxes"], dict) \
                or not isinstance(mine["deals"], dict):
            raise SecureAggregationError(f"the aggregator's shares for {self.name} are malformed; refused")
        self.u2 = self._members(_names(mine["peers"], "the aggregator's list of sites that shared"), self.u1,
                                "list of sites that shared keys")
        if set(mine["boxes"]) != set(self.u2) - {self.name} or set(mine["deals"]) != set(mine["boxes"]):
            raise SecureAggregationError(f"the aggregator's shares for {self.name} do not match {self._round()}'s "
                                         "sites")
        boxes, deals = {}, {}
        smallest = box_bytes(self.full, 1)
        for p, b in mine["boxes"].items():
            box = _unb64(b, None, f"the shares from {p}")
            if len(box) < smallest or (len(box) - smallest) % 32 or len(box) > smallest + 32 * MAX_DEPTH:
                raise SecureAggregationError(f"the shares from {p} have {len(box)} bytes; refused")
            deal = mine["deals"][p]
            if not (isinstance(deal, list) and len(deal) == 2):
                raise SecureAggregationError(f"the aggregator's copy of site {p}'s signed deal is malformed; refused")
            boxes[p] = box
            deals[p] = (_unb64(deal[0], KEY_BYTES, f"site {p}'s root"), _unb64(deal[1], None, f"site {p}'s signature"))
        self.site.receive(boxes, deals, self.keys)
        return self.site.mask(self.vector, self.quantizer, self.u2).tobytes()

    def consistency(self, answer: bytes | None) -> bytes:
        told = _answer(answer)
        if set(told) != {"survivors"}:
            raise SecureAggregationError("the aggregator's survivor set is malformed; refused")
        survivors = _names(told["survivors"], "the aggregator's survivor set")
        if self.full:
            self.u3 = self._members(survivors, self.u2, "survivor set")
        else:  # SecAgg+: U3 is global (≥ the plan's threshold); its part in this neighbourhood within U2 (≥ t_k)
            self._members([s for s in survivors if s in self.around], self.u2, "survivor set")
            self._members(survivors, self.plan_sites, "survivor set", self.threshold)
            told = set(survivors)
            self.u3 = [s for s in self.plan_sites if s in told]
        return json.dumps({"signature": _b64(self.site.sign_survivors(self.u3))}).encode()

    def reveal(self, answer: bytes | None) -> bytes:
        told = _answer(answer)
        if set(told) != {"signatures"} or not isinstance(told["signatures"], dict):
            raise SecureAggregationError("the aggregator's consistency signatures are malformed; refused")
        signatures = {}
        for signer, text in told["signatures"].items():
            try:
                signatures[str(signer)] = _unb64(text, None, "a signature")
            except SecureAggregationError:
                continue  # not counted: check_consistency names who is missing
        self.site.check_consistency(signatures, self.keys)
        dropped = [s for s in self.u2 if s not in self.u3]  # worked out here, never taken from the relay
        reveal = self.site.reveal(self.u3, dropped)
        return json.dumps({t: list(entry) if entry[0] == "withheld" else
                           [entry[0], entry[1], _b64(entry[2]), _b64(entry[3]), _b64(entry[4])]
                           for t, entry in reveal.items()}).encode()


STEPS = (("advert", "commitments", "graph"), ("graph", "adverts", "boxes"), ("boxes", "boxes", "masked"),
         ("masked", "survivors", "consistency"),
         ("consistency", "signatures", "reveal"))  # what a site sends, what it fetches next, its next step
FULL_STEPS = (("advert", "adverts", "boxes"), *STEPS[2:])  # the full graph: no graph to draw


def steps_for(full: bool) -> tuple[tuple[str, str, str], ...]:
    """A site's steps: with the graph phase in SecAgg+, without it in the full graph."""
    return FULL_STEPS if full else STEPS


def withdrawal(reason: str) -> bytes:
    """The advert-phase message of a site whose own input failed its checks: it takes no part in the
    round (the relay drops it at once, naming the reason, instead of waiting for its deadline)."""
    return json.dumps({"withdraw": reason[:MAX_REASON]}).encode()


class SecAggClient:
    """One site's side of one round over a polling transport: ``send(kind, payload)`` and
    ``fetch(kind) -> bytes | None`` (None: not ready yet, asked again every ``poll`` seconds)."""

    def __init__(self, name: str, sites: list[str], threshold: int, round_num: int, signing_key: Any,
                 certificate_pem: str, peer_key: Callable[[str, str], Any], send: Callable[[str, bytes], None],
                 fetch: Callable[[str], bytes | None], *, poll: float = 0.1, session: bytes = b"",
                 neighbours: str | int = "full") -> None:
        self.args = name, sites, threshold, round_num, signing_key, certificate_pem, peer_key
        self.session, self.neighbours = session, neighbours
        self.send, self.fetch, self.poll = send, fetch, poll

    def withdraw(self, reason: str) -> None:
        """Tell the relay this site takes no part in the round, and why."""
        self.send("advert", withdrawal(reason))

    def run(self, vector: np.ndarray, quantizer: Quantizer) -> dict[str, float]:
        """Takes part in the round with ``vector``; returns the bytes it sent (``secagg_bytes``), the
        wall-clock seconds from its first message to its last (``secagg_s``, waits for the others
        included) and the CPU seconds of its own protocol work (``secagg_cpu_s``: keys, shares, masks)."""
        began, cpu, self.waited_cpu, sent = time.perf_counter(), time.process_time(), 0.0, 0
        steps = SecAggSteps(*self.args, vector, quantizer, self.session, self.neighbours)
        payload = steps.advert()
        for kind, answer, step in steps_for(steps.full):
            self.send(kind, payload)
            sent += len(payload)
            payload = getattr(steps, step)(self._wait(answer))
        self.send("reveal", payload)
        sent += len(payload)
        return {"secagg_bytes": float(sent), "secagg_s": time.perf_counter() - began,
                "secagg_cpu_s": max(0.0, time.process_time() - cpu - self.waited_cpu)}

    def _wait(self, kind: str) -> bytes:
        cpu = time.process_time()  # the process's CPU while this site waits (polls, others' threads): not its work
        try:
            while True:
                payload = self.fetch(kind)
                if payload:
                    return payload
                time.sleep(self.poll)
        finally:
            self.waited_cpu += time.process_time() - cpu
