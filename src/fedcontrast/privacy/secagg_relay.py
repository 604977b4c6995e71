"""The aggregator's side of secure aggregation (:mod:`.secagg_protocol` has the messages and a site's
side): :class:`SecAggRelay` routes each phase's messages, closes phases at the engine's deadlines,
and unmasks only the sum, checking every rebuilt secret against what its site committed to
(:func:`unmask`, :func:`rebuild`)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric import x25519

from .secagg import Quantizer, SecAggSite, SecureAggregationError, _combine, commitment, expand, prg, s_public
from .secagg_graph import Graph, graph_for
from .secagg_protocol import (
    ANSWERS,
    KEY_BYTES,
    MAX_REASON,
    MAX_SIGNATURE,
    PHASES,
    _json,
    _unb64,
    box_bytes,
    check_advert,
    session_digest,
    share_bytes,
)
from .secagg_terms import SumLayout


# --- the aggregator --------------------------------------------------------------------------------
def rebuild(target: str, what: str, shares: list[tuple[str, int, bytes]], threshold: int,
            valid: Callable[[bytes], bool]) -> tuple[bytes, dict[str, str]]:
    """``target``'s secret from ``shares`` (sender, index, share), checked by ``valid`` (its
    commitment or public key), and the senders whose shares disagree with it (sender → sentence).

    A secret rebuilt from ``t`` shares equals the committed one only if every one of those shares is
    right (each enters the interpolation with a non-zero coefficient), so checking the first ``t``
    and the last ``t`` — together every share, since ``2t > n`` — checks them all at twice the cost of
    one rebuild. A window that fails is searched for a subset that rebuilds the commitment; the
    shares off it are named. When no subset works, the round ends and the suspects are named."""
    m = len(shares)
    if m < threshold:
        raise SecureAggregationError(f"only {m} shares of site {target}'s {what} arrived, fewer than the "
                                     f"threshold {threshold}")

    def combine(window: list[tuple[str, int, bytes]]) -> bytes | None:
        try:
            return _combine([(i, s) for _, i, s in window])
        except ValueError:  # repeated x-coordinates: not shares of one polynomial
            return None

    def checked(window: list[tuple[str, int, bytes]]) -> bytes | None:
        secret = combine(window)
        return secret if secret is not None and valid(secret) else None

    secret = checked(shares[:threshold])
    if secret is not None and (m == threshold or combine(shares[m - threshold:]) == secret):
        return secret, {}
    good = shares[:threshold] if secret is not None else None
    for start in range(1, m if good is None else 0):
        window = [shares[(start + j) % m] for j in range(threshold)]
        secret = checked(window)
        if secret is not None:
            good = window
            break
    if good is None or secret is None:
        raise SecureAggregationError(
            f"the {m} shares of site {target}'s {what} from {', '.join(sorted(s for s, _, _ in shares))} do not "
            "rebuild "
            f"what {target} committed to, and no {threshold} of them do (a garbage share; with more than {threshold} "
            "shares its sender is named): the round ends without a sum")
    base = good[:-1]
    bad = {sender: f"its share of site {target}'s {what} does not match what {target} committed to; left out"
           for sender, i, share in shares
           if (sender, i, share) not in good and checked(base + [(sender, i, share)]) is None}
    return secret, bad


def unmask(masked: dict[str, np.ndarray], reveals: dict[str, dict[str, tuple[str, int, bytes]]],
           adverts: dict[str, dict[str, bytes]], sites: list[str], threshold: int, quantizer: Quantizer,
           blamed: dict[str, str] | None = None, graph: Graph | None = None) -> np.ndarray:
    """The sum of the survivors' vectors from their masked vectors (``masked``: survivor → vector) and
    the survivors' reveals (survivor → its :meth:`SecAggSite.reveal`). Every rebuilt secret is checked
    against the advert (``commit`` for a self-mask seed, ``s_pk`` for a dropped site's key); senders of
    shares that disagree go into ``blamed`` (sender → sentence) and are left out. ``graph`` (SecAgg+,
    :mod:`.secagg_graph`): each secret is rebuilt from ``graph.threshold`` shares of its site's
    neighbourhood, and a dropped site's masks removed only with its surviving neighbours."""
    survivors = [s for s in sites if s in masked]
    by_target: dict[tuple[str, str], list[tuple[str, int, bytes]]] = {}  # (target, kind) → its shares, in one pass
    for sender, r in reveals.items():
        for target, (k, idx, share) in r.items():
            by_target.setdefault((target, k), []).append((sender, idx, share))
    t_shares = threshold if graph is None else graph.threshold
    if len(survivors) < threshold:
        raise SecureAggregationError(f"only {len(survivors)} of {len(sites)} sites sent masked uploads, fewer than the "
                                     f"threshold {threshold}; the round ends without a sum")
    size = next(iter(masked.values())).size
    total = np.zeros(size, dtype=quantizer.unsigned)
    with np.errstate(over="ignore"):
        for site in survivors:
            total = total + masked[site]
        for site in sites:
            survived = site in survivors
            kind = "b" if survived else "s"
            shares = by_target.get((site, kind), [])
            advert = adverts[site]
            if survived:
                def seed_committed(secret: bytes, a: dict[str, bytes] = advert) -> bool:
                    return "commit" not in a or commitment(secret) == a["commit"]

                secret, bad = rebuild(site, "self-mask seed", shares, t_shares, seed_committed)
            else:
                def key_advertised(secret: bytes, a: dict[str, bytes] = advert) -> bool:
                    return s_public(expand(secret, b"mask key")) == a["s_pk"]

                secret, bad = rebuild(site, "pairwise-mask key", shares, t_shares, key_advertised)
            if blamed is not None:
                blamed.update(bad)
            if survived:
                total = total - prg(expand(secret, b"self mask"), size, quantizer.unsigned)
                continue
            dropped_key = x25519.X25519PrivateKey.from_private_bytes(expand(secret, b"mask key"))
            for other in (survivors if graph is None else [s for s in survivors if s in graph.closed(site)]):
                # the dropped site's pairwise masks left in the survivors' vectors
                pairwise = prg(SecAggSite._pair_seed(dropped_key, adverts[other]["s_pk"]), size, quantizer.unsigned)
                total = total - pairwise if sites.index(other) < sites.index(site) else total + pairwise
    return quantizer.decode(total)


# --- the aggregator ---------------------------------------------------------------------------------
def relay_for(sites: list[str], settings: Any, layout: SumLayout, plan: Mapping[str, Any] | None = None,
              run: str = "") -> SecAggRelay:
    """The relay of a federation of ``sites`` under ``settings`` (the plan's secure_aggregation).
    ``plan`` (the run configuration as a mapping) and ``run`` (the engine's run label): the session
    the sites derive (:func:`~.secagg_protocol.session_digest`), which the neighbourhood graph is
    drawn from (SecAgg+); without them, the full graph (the sites must then use ``neighbours="full"``)."""
    return SecAggRelay(sites, settings.sites_needed(len(sites)), layout.words,
                       Quantizer.for_sites(settings.clip, len(sites), settings.bits),
                       neighbours="full" if plan is None else settings.neighbours,
                       session=b"" if plan is None else session_digest(plan, sites, run))


class SecAggRelay:
    """The aggregator's side for a federation of ``sites`` (names, in the plan's order): one round at
    a time, begun by the engine (:meth:`begin`); a message of any other round is refused.
    ``words``: the length of every site's vector; ``quantizer``: the ring (the same at every site).
    ``neighbours`` and ``session``: the round's graph (:func:`~.secagg_graph.graph_for`; each site
    sees only its neighbourhood's adverts, shares and signatures). Thread-safe."""

    def __init__(self, sites: list[str], threshold: int, words: int, quantizer: Quantizer, *,
                 neighbours: str | int = "full", session: bytes = b"") -> None:
        self.all_sites, self.threshold, self.words, self.quantizer = list(sites), threshold, words, quantizer
        self.neighbours, self.session = neighbours, session
        self.place = {s: i for i, s in enumerate(self.all_sites)}  # a site's position in the plan
        self.at_least = 0  # the engine's own floor (e.g. OpenFL's min_sites): fewer present ends the round
        self.lock = threading.RLock()
        self.round = -1
        self.begin(0)

    def begin(self, round_num: int) -> None:
        with self.lock:
            self.round, self.phase = round_num, 0
            self.graph = graph_for(self.all_sites, self.threshold, self.neighbours, self.session, round_num)
            self._holders: dict[str, dict[str, int]] = {}  # target → holder → x-coordinate (:meth:`_holder_index`)
            self._u1: set[str] | None = None
            self.members: list[list[str]] = [list(self.all_sites)]  # U0 (all), U1 … U5
            self.received: list[dict[str, Any]] = [{} for _ in PHASES]
            self.dropped: dict[str, str] = {}  # site → why it is out (the phase it missed, or its withdrawal)
            self.withdrawn: dict[str, str] = {}  # site → the reason it gave
            self.blamed: dict[str, str] = {}  # site → its share that disagreed (left out of the unmasking)
            self.bytes_from: dict[str, int] = {}  # site → the payload bytes it sent this round
            self.sum: np.ndarray | None = None
            self.unmask_cpu_s = 0.0
            self.started = time.monotonic()
            self._survivors_answer: tuple[int, bytes] = (-1, b"")  # (round, U3 as every site fetches it)

    @property
    def open(self) -> bool:
        """A phase of the current round waits for messages."""
        return self.phase < len(PHASES)

    def receive(self, site: str, round_num: int, kind: str, payload: bytes) -> None:
        """Keep one site's message (checked) and close the phase once every member sent its own."""
        with self.lock:
            if round_num != self.round:
                raise SecureAggregationError(f"site {site} sent a secure-aggregation {kind} message of round "
                                             f"{round_num} during round {self.round}; refused")
            if site in self.dropped:
                raise SecureAggregationError(f"site {site} was dropped from round {round_num}'s secure aggregation "
                                             f"({self.dropped[site]}); its {kind} message is refused")
            if kind not in PHASES or PHASES.index(kind) != self.phase:
                expected = PHASES[self.phase] if self.open else "nothing"
                raise SecureAggregationError(f"site {site} sent a secure-aggregation {kind} message in round "
                                             f"{round_num} where {expected} was expected; refused")
            if site not in self.members[self.phase]:
                raise SecureAggregationError(f"site {site} is not a member of round {round_num}'s secure "
                                             "aggregation")
            if site in self.received[self.phase]:
                raise SecureAggregationError(f"site {site} sent its {kind} message of round {round_num} twice")
            message = getattr(self, f"_check_{kind}")(site, payload)
            self.bytes_from[site] = self.bytes_from.get(site, 0) + len(payload)
            if kind == "advert" and "withdraw" in message:
                self.withdrawn[site] = message["withdraw"]
                self.dropped[site] = f"it withdrew: {message['withdraw']}"
            else:
                self.received[self.phase][site] = message
            if self._all_in():
                self._advance()

    def _all_in(self) -> bool:
        return all(s in self.received[self.phase] or s in self.dropped for s in self.members[self.phase])

    def close(self, at_least: int = 0) -> list[str]:
        """The engine's deadline passed: close the open phase with the sites that sent (when at least
        ``max(threshold, at_least)`` did); the missing sites, now dropped. Raises when too few sent."""
        with self.lock:
            if not self.open:
                return []
            present, expected = self.received[self.phase], self.members[self.phase]
            missing = [s for s in expected if s not in present and s not in self.dropped]
            needed = max(self.threshold, at_least)
            if len(present) < needed:
                silent = f" (no answer from {', '.join(missing)})" if missing else ""
                raise SecureAggregationError(
                    f"round {self.round}'s secure aggregation: only {len(present)} of {len(expected)} sites sent "
                    f"their {PHASES[self.phase]} message in time{silent}{self._withdrawals()}, fewer than the "
                    f"{needed} needed; the round ends without a sum")
            for site in missing:
                self.dropped[site] = f"it missed the {PHASES[self.phase]} phase's deadline"
            self._advance()
            return missing

    def _withdrawals(self) -> str:
        return "".join(f"; {s} withdrew: {r}" for s, r in self.withdrawn.items())

    def answer(self, site: str, round_num: int, kind: str) -> bytes | None:
        """What ``site`` fetches once the phase before it closed; None while it is open."""
        with self.lock:
            if round_num != self.round or kind not in ANSWERS:
                return None
            if site in self.dropped:
                return json.dumps({"dropped": f"this site was dropped from round {round_num}'s secure aggregation "
                                              f"({self.dropped[site]})"}).encode()
            if self.phase < ANSWERS[kind]:
                return None
            mine = self.graph.closed(site)  # every site in the full graph
            if kind == "adverts":
                return json.dumps({s: a for s, a in self.received[0].items() if s in mine}).encode()
            if kind == "boxes":
                boxes = {sender: box[site] for sender, box in self.received[1].items() if site in box}
                return json.dumps({"peers": [s for s in self.members[2] if s in mine], "boxes": boxes}).encode()
            if kind == "survivors":  # the same for every site: encoded once per round
                if self._survivors_answer[0] != round_num:
                    self._survivors_answer = (round_num, json.dumps({"survivors": self.members[3]}).encode())
                return self._survivors_answer[1]
            return json.dumps({"signatures": {s: v for s, v in self.received[3].items() if s in mine}}).encode()

    def total(self, round_num: int) -> np.ndarray:
        """The sum of the survivors' vectors of ``round_num`` (float64), once unmasked."""
        with self.lock:
            if round_num != self.round or self.sum is None:
                raise SecureAggregationError(f"round {round_num}'s secure sum is not complete: the sites' messages "
                                             f"stopped at the {PHASES[min(self.phase, len(PHASES) - 1)]} phase")
            return self.sum

    @property
    def survivors(self) -> list[str]:
        """U3: the sites whose vectors are in the round's sum."""
        return list(self.members[3]) if len(self.members) > 3 else []

    # --- phases -------------------------------------------------------------------------------
    def _advance(self) -> None:
        present = [s for s in self.members[self.phase] if s in self.received[self.phase]]
        needed = max(self.threshold, self.at_least)
        if len(present) < needed:
            raise SecureAggregationError(f"round {self.round}'s secure aggregation: {len(present)} sites left"
                                         f"{self._withdrawals()}, fewer than the {needed} needed; the round ends "
                                         "without a sum")
        self.members.append(present)
        self.phase += 1
        if self.phase == len(PHASES):
            adverts = {s: {"s_pk": _unb64(a["s_pk"], KEY_BYTES, "a key"), "commit": _unb64(a["commit"], KEY_BYTES, "a "
                                                                                                                   "key")}
                       for s, a in self.received[0].items()}
            masked = {s: self.received[2][s] for s in self.members[3]}
            cpu = time.process_time()
            self.sum = unmask(masked, self.received[4], adverts, self.members[2], self.threshold, self.quantizer,
                              self.blamed, None if self.graph.full else self.graph)
            self.unmask_cpu_s = time.process_time() - cpu

    def _check_advert(self, site: str, payload: bytes) -> dict[str, str]:
        advert = _json(payload, f"site {site}", "advert")
        if isinstance(advert, dict) and set(advert) == {"withdraw"}:
            reason = advert["withdraw"]
            if not isinstance(reason, str) or not reason or len(reason) > MAX_REASON:
                raise SecureAggregationError(f"site {site}'s withdrawal gives no reason (a sentence of at most "
                                             f"{MAX_REASON} characters)")
            return {"withdraw": reason}
        return check_advert(site, advert, "the advert it sent")

    def _check_boxes(self, site: str, payload: bytes) -> dict[str, str]:
        boxes = _json(payload, f"site {site}", "boxes")
        peers = {s for s in self.members[1] if s != site and s in self.graph.closed(site)}
        if not isinstance(boxes, dict) or set(boxes) != peers:
            raise SecureAggregationError(f"site {site} sent shares for "
                                         f"{sorted(boxes) if isinstance(boxes, dict) else '?'}"
                                         f", not for exactly its peers {sorted(peers)}")
        for peer, box in boxes.items():
            try:
                _unb64(box, box_bytes(self.graph), "a box")
            except SecureAggregationError as exc:
                raise SecureAggregationError(f"site {site}'s shares for {peer}: {exc}") from None
        return boxes

    def _check_masked(self, site: str, payload: bytes) -> np.ndarray:
        size = self.words * self.quantizer.bits // 8
        if len(payload) != size:
            raise SecureAggregationError(f"site {site}'s masked vector has {len(payload)} bytes where round "
                                         f"{self.round} declares {size}; refused")
        return np.frombuffer(payload, dtype=self.quantizer.unsigned).copy()

    def _check_consistency(self, site: str, payload: bytes) -> str:
        message = _json(payload, f"site {site}", "consistency")
        if not isinstance(message, dict) or set(message) != {"signature"}:
            raise SecureAggregationError(f"site {site}'s consistency message does not carry exactly its signature")
        try:
            if len(_unb64(message["signature"], None, "its signature")) > MAX_SIGNATURE:
                raise SecureAggregationError("it is too long")
        except SecureAggregationError as exc:
            raise SecureAggregationError(f"site {site}'s consistency signature is malformed ({exc})") from None
        return message["signature"]

    def _holder_index(self, target: str) -> dict[str, int]:
        """The x-coordinate of each share of ``target``'s secrets: its holder's place among those of U1
        that hold them (its neighbourhood; every site of U1 in the full graph), from 1."""
        if target not in self._holders:
            if self._u1 is None:
                self._u1 = set(self.members[1])
            u1 = self._u1
            mine = sorted((s for s in self.graph.closed(target) if s in u1), key=self.place.__getitem__)
            self._holders[target] = {s: i + 1 for i, s in enumerate(mine)}
        return self._holders[target]

    def _check_reveal(self, site: str, payload: bytes) -> dict[str, tuple[str, int, bytes]]:
        reveal = _json(payload, f"site {site}", "reveal")
        mine = self.graph.closed(site)  # SecAgg+: it holds shares of its neighbourhood only
        survivors = set(self.members[3]) & mine
        dropped = set(self.members[2]) & mine - set(self.members[3])
        if not isinstance(reveal, dict) or set(reveal) != survivors | dropped:
            raise SecureAggregationError(f"site {site} revealed shares for other sites than the round's")
        out = {}
        for target, entry in reveal.items():
            index = self._holder_index(target)[site]
            kind = "b" if target in survivors else "s"
            if not (isinstance(entry, list) and len(entry) == 3 and entry[0] == kind and entry[1] == index):
                raise SecureAggregationError(f"site {site}'s share for {target} is malformed (a {kind} share at index "
                                             f"{index} was expected)")
            out[target] = (kind, index, _unb64(entry[2], share_bytes(self.graph), f"site {site}'s share for {target}"))
        return out


