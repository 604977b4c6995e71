"""The aggregator's side of secure aggregation (:mod:`.secagg_protocol` has the messages and a site's
side): :class:`SecAggRelay` routes each phase's messages, closes phases at the engine's deadlines,
and unmasks only the sum, checking every rebuilt secret against what its site committed to
(:func:`unmask`, :func:`rebuild`)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from .secagg import (
    MAX_DEPTH,
    Quantizer,
    SecureAggregationError,
    deal_bytes,
    graph_commitment,
    verify,
)
from .secagg_graph import Graph, graph_for, graph_seed, neighbourhood_size
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
    public_key_of,
    session_digest,
    share_bytes,
)
from .secagg_terms import SumLayout
from .secagg_unmask import SEARCH_LIMIT, check_reveals, decode_shares, rebuild, unmask  # noqa: F401 (re-exported)


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
            n = len(self.all_sites)
            self.full = neighbourhood_size(n, self.neighbours) >= n - 1
            # the full graph is fixed; SecAgg+'s is drawn from every site's revealed randomness (:meth:`_advance`)
            self.graph: Graph | None = (graph_for(self.all_sites, self.threshold, self.neighbours, self.session,
                                                  round_num) if self.full else None)
            self.seed = b""  # SecAgg+: the round's graph seed, once drawn
            self.randomness: dict[str, bytes] = {}  # SecAgg+: each site's revealed graph randomness
            self._commitments_answer: tuple[int, bytes] = (-1, b"")
            self._reveals_answer: tuple[int, bytes] = (-1, b"")
            self.members: list[list[str]] = [list(self.all_sites)]  # U0 (all), U1 … U5
            self.received: list[dict[str, Any]] = [{} for _ in PHASES]
            self.dropped: dict[str, str] = {}  # site → why it is out (the phase it missed, or its withdrawal)
            self.withdrawn: dict[str, str] = {}  # site → the reason it gave
            self.blamed: dict[str, str] = {}  # site → the bad share it dealt or relayed (left out of the unmasking)
            self.withheld: dict[str, str] = {}  # holder → the dealers whose shares failed its check, and why
            self.roots: dict[str, bytes] = {}  # dealer → the root of its shares' tree, its signature checked
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
            if PHASES[self.phase] == "graph" and missing:
                raise SecureAggregationError(self._no_graph(missing))
            for site in missing:
                self.dropped[site] = f"it missed the {PHASES[self.phase]} phase's deadline"
            self._advance()
            return missing

    def _no_graph(self, silent: list[str]) -> str:
        whose = "its" if len(silent) == 1 else "their"
        return (f"round {self.round}'s secure aggregation: {', '.join(silent)} sent {whose} advert but not the "
                "randomness it committed to, and the round's graph is drawn from every committed "
                "site's (dropping one would let the aggregator pick among graphs); the round ends without a sum")

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
            if kind == "commitments":  # the same for every site: encoded once per round
                if self._commitments_answer[0] != round_num:
                    commitments = {s: self.received[0][s]["graph"] for s in self.members[1]}
                    self._commitments_answer = (round_num, json.dumps({"commitments": commitments}).encode())
                return self._commitments_answer[1]
            mine = self.drawn.closed(site)  # every site in the full graph
            if kind == "adverts":  # every site's randomness (encoded once per round), its neighbourhood's adverts
                if self._reveals_answer[0] != round_num:
                    self._reveals_answer = (round_num, b"{}" if self.full else json.dumps(self.received[1]).encode())
                return (b'{"reveals": ' + self._reveals_answer[1] + b', "adverts": '
                        + json.dumps({s: a for s, a in self.received[0].items() if s in mine}).encode() + b"}")
            if kind == "boxes":
                boxes = {sender: m["boxes"][site] for sender, m in self.received[2].items() if site in m["boxes"]}
                deals = {sender: self.received[2][sender]["deal"] for sender in boxes}
                return json.dumps({"peers": [s for s in self.members[3] if s in mine], "boxes": boxes,
                                   "deals": deals}).encode()
            if kind == "survivors":  # the same for every site: encoded once per round
                if self._survivors_answer[0] != round_num:
                    self._survivors_answer = (round_num, json.dumps({"survivors": self.members[4]}).encode())
                return self._survivors_answer[1]
            return json.dumps({"signatures": {s: v for s, v in self.received[4].items() if s in mine}}).encode()

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
        return list(self.members[4]) if len(self.members) > 4 else []

    @property
    def drawn(self) -> Graph:
        """The round's graph, once drawn (the full graph at once; SecAgg+'s after the graph phase)."""
        if self.graph is None:
            raise SecureAggregationError(f"round {self.round}'s graph is not drawn yet")
        return self.graph

    # --- phases -------------------------------------------------------------------------------
    def _advance(self) -> None:
        present = [s for s in self.members[self.phase] if s in self.received[self.phase]]
        needed = max(self.threshold, self.at_least)
        if len(present) < needed:
            raise SecureAggregationError(f"round {self.round}'s secure aggregation: {len(present)} sites left"
                                         f"{self._withdrawals()}, fewer than the {needed} needed; the round ends "
                                         "without a sum")
        if PHASES[self.phase] == "graph" and len(present) < len(self.members[self.phase]):
            silent = [s for s in self.members[self.phase] if s not in present]
            raise SecureAggregationError(self._no_graph(silent))
        self.members.append(present)
        self.phase += 1
        if PHASES[self.phase - 1] == "advert" and self.full:  # the full graph: nothing to draw
            self.members.append(present)
            self.phase += 1
        elif PHASES[self.phase - 1] == "graph":
            self.seed = graph_seed(self.session, self.round, self.randomness)
            self.graph = graph_for(self.all_sites, self.threshold, self.neighbours, self.seed, self.round)
        if self.phase == len(PHASES):
            adverts = {s: {"s_pk": _unb64(a["s_pk"], KEY_BYTES, "a key"), "commit": _unb64(a["commit"], KEY_BYTES, "a "
                                                                                                                   "key")}
                       for s, a in self.received[0].items()}
            masked = {s: self.received[3][s] for s in self.members[4]}
            cpu = time.process_time()
            self.sum = unmask(masked, self.received[5], adverts, self.members[3], self.threshold, self.quantizer,
                              self.blamed, None if self.full else self.drawn, roots=self.roots,
                              withheld=self.withheld)
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

    def _check_graph(self, site: str, payload: bytes) -> bytes:
        message = _json(payload, f"site {site}", "graph")
        if not isinstance(message, dict) or set(message) != {"randomness"}:
            raise SecureAggregationError(f"site {site}'s graph message does not carry exactly its randomness")
        value = _unb64(message["randomness"], KEY_BYTES, f"site {site}'s graph randomness")
        committed = _unb64(self.received[0][site]["graph"], KEY_BYTES, "a commitment")
        if graph_commitment(self.session, self.round, site, value) != committed:
            raise SecureAggregationError(f"site {site}'s graph randomness does not match the commitment in its advert; "
                                         "refused")
        self.randomness[site] = value
        return message["randomness"]

    def _check_boxes(self, site: str, payload: bytes) -> dict[str, Any]:
        message = _json(payload, f"site {site}", "boxes")
        peers = {s for s in self.members[1] if s != site and s in self.drawn.closed(site)}
        boxes = message.get("boxes") if isinstance(message, dict) else None
        if not isinstance(message, dict) or set(message) != {"boxes", "deal"} or not isinstance(boxes, dict) \
                or set(boxes) != peers:
            raise SecureAggregationError(f"site {site} sent shares for "
                                         f"{sorted(boxes) if isinstance(boxes, dict) else '?'}"
                                         f", not for exactly its peers {sorted(peers)} with its signed deal")
        size = box_bytes(self.full, len(peers) + 1)
        for peer, box in boxes.items():
            try:
                _unb64(box, size, "a box")
            except SecureAggregationError as exc:
                raise SecureAggregationError(f"site {site}'s shares for {peer}: {exc}") from None
        deal = message["deal"]
        try:
            if not (isinstance(deal, list) and len(deal) == 2):
                raise SecureAggregationError("it is not its root and signature")
            root, signature = _unb64(deal[0], KEY_BYTES, "its root"), _unb64(deal[1], None, "its signature")
            if len(signature) > MAX_SIGNATURE:
                raise SecureAggregationError("its signature is too long")
        except SecureAggregationError as exc:
            raise SecureAggregationError(f"site {site}'s signed deal is malformed ({exc})") from None
        terms = () if self.full else ("neighbours", self.drawn.k, self.drawn.threshold)
        if not verify(public_key_of(site, self.received[0][site]["certificate"]), signature,
                      deal_bytes(self.session, self.round, self.threshold, site, root, terms, self.seed)):
            raise SecureAggregationError(f"site {site}'s deal does not carry its signature over this session and "
                                         "round: its shares are refused")
        self.roots[site] = root
        return message

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

    def _check_reveal(self, site: str, payload: bytes) -> dict[str, tuple[Any, ...]]:
        reveal = _json(payload, f"site {site}", "reveal")
        mine = self.drawn.closed(site)  # SecAgg+: it holds shares of its neighbourhood only
        survivors = set(self.members[4]) & mine
        dropped = set(self.members[3]) & mine - set(self.members[4])
        if not isinstance(reveal, dict) or set(reveal) != survivors | dropped:
            raise SecureAggregationError(f"site {site} revealed shares for other sites than the round's")
        out: dict[str, tuple[Any, ...]] = {}
        for target, entry in reveal.items():
            kind = "b" if target in survivors else "s"
            if isinstance(entry, list) and len(entry) == 2 and entry[0] == "withheld" and isinstance(entry[1], str):
                out[target] = ("withheld", entry[1][:MAX_REASON])
                continue
            if not (isinstance(entry, list) and len(entry) == 5 and entry[0] == kind and isinstance(entry[1], int)
                    and not isinstance(entry[1], bool) and 1 <= entry[1] <= 1 << MAX_DEPTH):
                raise SecureAggregationError(f"site {site}'s share for {target} is malformed (a {kind} share, its "
                                             "index, the other share's hash and its path were expected)")
            where = f"site {site}'s share for {target}"
            path = _unb64(entry[4], None, where + "'s path")
            if len(path) % 32 or len(path) > 32 * MAX_DEPTH:
                raise SecureAggregationError(f"{where} has a malformed path")
            out[target] = (kind, entry[1], _unb64(entry[2], share_bytes(self.full), where),
                           _unb64(entry[3], KEY_BYTES, where + "'s other hash"), path)
        return out
