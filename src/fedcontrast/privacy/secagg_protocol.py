"""Secure aggregation between processes: the aggregator's relay and a site's side of one round, as
messages any engine can carry (:mod:`.secagg` has the cryptography; this module the order, checks and
dropouts of Bonawitz et al.'s four rounds).

The aggregator (:class:`SecAggRelay`) only routes and sums. Each phase collects one message from
every site still in the round and closes when all have arrived, or when the engine's deadline closes
it with those present (:meth:`SecAggRelay.close`; fewer than the threshold ends the round):

========== ===================================================== ==========================================
phase      a site sends                                          then fetches
========== ===================================================== ==========================================
advert     its two public keys, signed, and its certificate      ``adverts``: every site's (U1)
boxes      its encrypted Shamir shares, one per peer of U1       ``boxes``: those addressed to it, and U2
masked     its masked vector (the only large message)            ``survivors``: U3 and the dropped U2 − U3
reveal     shares of ``b`` for U3, of the ``s`` key for U2 − U3  nothing: the relay unmasks the sum
========== ===================================================== ==========================================

Messages are JSON (bytes in base64) except the masked vector (raw ring words); each is checked for
its exact shape before it is kept, and a malformed one raises :class:`SecureAggregationError`
naming the sender. A site checks every peer's signature against that peer's certificate (signed by
the federation's CA, issued for that name) before it sends a share.

Threat model (say it to the privacy officer): an aggregator that follows the protocol but records
everything learns only the sum of at least ``threshold`` sites; keys cannot be swapped by anyone
without the CA's key. An operator that holds the federation's CA *and* deviates from the protocol
(mints certificates, tells sites different survivor sets) is outside it, as in Bonawitz et al.'s
semi-honest setting without their consistency round.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .secagg import Quantizer, SecAggSite, SecureAggregationError, SumLayout, unmask

PHASES = ("advert", "boxes", "masked", "reveal")
ANSWERS = {"adverts": 1, "boxes": 2, "survivors": 3}  # what a site fetches → the phase that must have closed
KEY_BYTES, SHARE_BYTES, BOX_BYTES = 32, 32, 1 + 32 + 32 + 16  # a box: index, b share, s share, Poly1305 tag
MAX_SIGNATURE, MAX_CERTIFICATE = 1024, 16384


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: Any, size: int | None, what: str) -> bytes:
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
    except (UnicodeDecodeError, ValueError):
        raise SecureAggregationError(f"site {sender}'s secure-aggregation {kind} message is not JSON; refused") from None


# --- the aggregator ---------------------------------------------------------------------------------
def relay_for(sites: list[str], settings: Any, layout: SumLayout) -> SecAggRelay:
    """The relay of a federation of ``sites`` under ``settings`` (the plan's secure_aggregation)."""
    return SecAggRelay(sites, settings.sites_needed(len(sites)), layout.words,
                       Quantizer.for_sites(settings.clip, len(sites), settings.bits))


class SecAggRelay:
    """The aggregator's side for a federation of ``sites`` (names, in the plan's order): one round at
    a time (a message of a later round starts it). ``words``: the length of every site's vector;
    ``quantizer``: the ring (the same at every site). Thread-safe."""

    def __init__(self, sites: list[str], threshold: int, words: int, quantizer: Quantizer) -> None:
        self.all_sites, self.threshold, self.words, self.quantizer = list(sites), threshold, words, quantizer
        self.lock = threading.RLock()
        self.round = -1
        self.begin(0)

    def begin(self, round_num: int) -> None:
        with self.lock:
            self.round, self.phase = round_num, 0
            self.members: list[list[str]] = [list(self.all_sites)]  # U0 (all), U1, U2, U3, U4
            self.received: list[dict[str, Any]] = [{} for _ in PHASES]
            self.dropped: dict[str, str] = {}  # site → the phase it missed
            self.sum: np.ndarray | None = None
            self.unmask_cpu_s = 0.0
            self.started = time.monotonic()

    @property
    def open(self) -> bool:
        """A phase of the current round waits for messages."""
        return self.phase < len(PHASES)

    def receive(self, site: str, round_num: int, kind: str, payload: bytes) -> None:
        """Keep one site's message (checked) and close the phase once every member sent its own."""
        with self.lock:
            if round_num < self.round:
                return  # a stale message of a round that ended
            if round_num > self.round:
                self.begin(round_num)
            if site in self.dropped:
                raise SecureAggregationError(f"site {site} was dropped from round {round_num + 1}'s secure aggregation "
                                             f"(it missed the {self.dropped[site]} phase); its {kind} message is refused")
            if kind not in PHASES or PHASES.index(kind) != self.phase:
                expected = PHASES[self.phase] if self.open else "nothing"
                raise SecureAggregationError(f"site {site} sent a secure-aggregation {kind} message in round "
                                             f"{round_num + 1} where {expected} was expected; refused")
            if site not in self.members[self.phase]:
                raise SecureAggregationError(f"site {site} is not a member of round {round_num + 1}'s secure aggregation")
            if site in self.received[self.phase]:
                raise SecureAggregationError(f"site {site} sent its {kind} message of round {round_num + 1} twice")
            self.received[self.phase][site] = getattr(self, f"_check_{kind}")(site, payload)
            if len(self.received[self.phase]) == len(self.members[self.phase]):
                self._advance()

    def close(self, at_least: int = 0) -> list[str]:
        """The engine's deadline passed: close the open phase with the sites that sent (when at least
        ``max(threshold, at_least)`` did); the missing sites, now dropped. Raises when too few sent."""
        with self.lock:
            if not self.open:
                return []
            present, expected = self.received[self.phase], self.members[self.phase]
            missing = [s for s in expected if s not in present]
            needed = max(self.threshold, at_least)
            if len(present) < needed:
                raise SecureAggregationError(
                    f"round {self.round + 1}'s secure aggregation: only {len(present)} of {len(expected)} sites sent "
                    f"their {PHASES[self.phase]} message in time (no answer from {', '.join(missing)}), fewer than "
                    f"the {needed} needed; the round ends without a sum")
            for site in missing:
                self.dropped[site] = PHASES[self.phase]
            self._advance()
            return missing

    def answer(self, site: str, round_num: int, kind: str) -> bytes | None:
        """What ``site`` fetches once the phase before it closed; None while it is open."""
        with self.lock:
            if round_num != self.round or kind not in ANSWERS:
                return None
            if site in self.dropped:
                return json.dumps({"dropped": f"this site was dropped from round {round_num + 1}'s secure aggregation "
                                              f"(it missed the {self.dropped[site]} phase's deadline)"}).encode()
            if self.phase < ANSWERS[kind]:
                return None
            if kind == "adverts":
                return json.dumps(self.received[0]).encode()
            if kind == "boxes":
                boxes = {sender: box[site] for sender, box in self.received[1].items() if site in box}
                return json.dumps({"peers": self.members[2], "boxes": boxes}).encode()
            survivors = self.members[3]
            return json.dumps({"survivors": survivors,
                               "dropped": [s for s in self.members[2] if s not in survivors]}).encode()

    def total(self, round_num: int) -> np.ndarray:
        """The sum of the survivors' vectors of ``round_num`` (float64), once unmasked."""
        with self.lock:
            if round_num != self.round or self.sum is None:
                raise SecureAggregationError(f"round {round_num + 1}'s secure sum is not complete: the sites' messages "
                                             f"stopped at the {PHASES[min(self.phase, len(PHASES) - 1)]} phase")
            return self.sum

    @property
    def survivors(self) -> list[str]:
        return list(self.members[3]) if len(self.members) > 3 else []

    # --- phases -------------------------------------------------------------------------------
    def _advance(self) -> None:
        present = [s for s in self.members[self.phase] if s in self.received[self.phase]]
        if len(present) < self.threshold:
            raise SecureAggregationError(f"round {self.round + 1}'s secure aggregation: {len(present)} sites left, "
                                         f"fewer than the threshold {self.threshold}; the round ends without a sum")
        self.members.append(present)
        self.phase += 1
        if self.phase == len(PHASES):
            adverts = {s: {"s_pk": _unb64(a["s_pk"], KEY_BYTES, "a key")} for s, a in self.received[0].items()}
            masked = {s: self.received[2][s] for s in self.members[3]}
            cpu = time.process_time()
            self.sum = unmask(masked, self.received[3], adverts, self.members[2], self.threshold, self.quantizer)
            self.unmask_cpu_s = time.process_time() - cpu

    def _check_advert(self, site: str, payload: bytes) -> dict[str, str]:
        advert = _json(payload, site, "advert")
        if not isinstance(advert, dict) or set(advert) != {"c_pk", "s_pk", "signature", "certificate"}:
            raise SecureAggregationError(f"site {site}'s advert does not carry exactly its keys, signature and certificate")
        try:
            _unb64(advert["c_pk"], KEY_BYTES, "a key"), _unb64(advert["s_pk"], KEY_BYTES, "a key")
            if len(_unb64(advert["signature"], None, "a signature")) > MAX_SIGNATURE:
                raise SecureAggregationError("its signature is too long")
        except SecureAggregationError as exc:
            raise SecureAggregationError(f"site {site}'s advert is malformed: {exc}") from None
        if not isinstance(advert["certificate"], str) or len(advert["certificate"]) > MAX_CERTIFICATE:
            raise SecureAggregationError(f"site {site}'s advert carries no certificate (PEM text)")
        return advert

    def _check_boxes(self, site: str, payload: bytes) -> dict[str, str]:
        boxes = _json(payload, site, "boxes")
        peers = {s for s in self.members[1] if s != site}
        if not isinstance(boxes, dict) or set(boxes) != peers:
            raise SecureAggregationError(f"site {site} sent shares for {sorted(boxes) if isinstance(boxes, dict) else '?'}"
                                         f", not for exactly its peers {sorted(peers)}")
        for peer, box in boxes.items():
            try:
                _unb64(box, BOX_BYTES, "a box")
            except SecureAggregationError as exc:
                raise SecureAggregationError(f"site {site}'s shares for {peer}: {exc}") from None
        return boxes

    def _check_masked(self, site: str, payload: bytes) -> np.ndarray:
        size = self.words * self.quantizer.bits // 8
        if len(payload) != size:
            raise SecureAggregationError(f"site {site}'s masked vector has {len(payload)} bytes where round "
                                         f"{self.round + 1} declares {size}; refused")
        return np.frombuffer(payload, dtype=self.quantizer.unsigned).copy()

    def _check_reveal(self, site: str, payload: bytes) -> dict[str, tuple[str, int, bytes]]:
        reveal = _json(payload, site, "reveal")
        survivors = set(self.members[3])
        dropped = set(self.members[2]) - survivors
        if not isinstance(reveal, dict) or set(reveal) != survivors | dropped:
            raise SecureAggregationError(f"site {site} revealed shares for other sites than the round's")
        out = {}
        for target, entry in reveal.items():
            kind = "b" if target in survivors else "s"
            if not (isinstance(entry, list) and len(entry) == 3 and entry[0] == kind and isinstance(entry[1], int)
                    and 1 <= entry[1] <= 255):
                raise SecureAggregationError(f"site {site}'s share for {target} is malformed")
            out[target] = (kind, entry[1], _unb64(entry[2], SHARE_BYTES, f"site {site}'s share for {target}"))
        return out


# --- a site --------------------------------------------------------------------------------------
class SecAggSteps:
    """One site's side of one round, one step per message of the aggregator (an engine that pushes
    messages, like Flower's, calls them in turn; :class:`SecAggClient` drives them by polling):
    :meth:`advert` → :meth:`boxes` (given every site's advert) → :meth:`masked` (given the shares
    addressed to it) → :meth:`reveal` (given the survivors). ``peer_key(site, certificate)``: that
    site's public key once its certificate (or registered key) is checked; raises otherwise."""

    def __init__(self, name: str, sites: list[str], threshold: int, round_num: int, signing_key: Any,
                 certificate: str, peer_key: Callable[[str, str], Any], vector: np.ndarray, quantizer: Quantizer) -> None:
        self.site = SecAggSite(name, list(sites), threshold, round_num, signing_key)
        self.certificate, self.peer_key, self.vector, self.quantizer = certificate, peer_key, vector, quantizer
        self.peers: list[str] = []

    def advert(self) -> bytes:
        advert = self.site.advertise()
        return json.dumps({**{k: _b64(v) for k, v in advert.items()}, "certificate": self.certificate}).encode()

    def boxes(self, answer: bytes) -> bytes:
        site, adverts = self.site, _answer(answer)
        if not isinstance(adverts, dict) or site.name not in adverts:
            raise SecureAggregationError(f"the aggregator left this site ({site.name}) out of round "
                                         f"{site.round_num + 1}'s keys")
        keys = {peer: self.peer_key(peer, a["certificate"]) for peer, a in adverts.items()}
        site.sites = [s for s in site.sites if s in adverts]  # U1, in the plan's order
        boxes = site.share({p: {k: _unb64(a[k], None, "a key") for k in ("c_pk", "s_pk", "signature")}
                            for p, a in adverts.items()}, keys)
        return json.dumps({p: _b64(b) for p, b in boxes.items()}).encode()

    def masked(self, answer: bytes) -> bytes:
        site, mine = self.site, _answer(answer)
        self.peers = [s for s in site.sites if s in mine["peers"]]
        if site.name not in self.peers or set(mine["boxes"]) != set(self.peers) - {site.name}:
            raise SecureAggregationError(f"the aggregator's shares for {site.name} do not match round "
                                         f"{site.round_num + 1}'s sites")
        site.receive({p: _unb64(b, BOX_BYTES, "a box") for p, b in mine["boxes"].items()})
        return site.mask(self.vector, self.quantizer, self.peers).tobytes()

    def reveal(self, answer: bytes) -> bytes:
        site, answer = self.site, _answer(answer)
        survivors, dropped = answer["survivors"], answer["dropped"]
        if not set(survivors) | set(dropped) <= set(self.peers) or site.name not in survivors:
            raise SecureAggregationError(f"the aggregator named survivors of round {site.round_num + 1} that did not "
                                         "share keys with this site; nothing is revealed")
        reveal = site.reveal(survivors, dropped)
        return json.dumps({t: [k, i, _b64(s)] for t, (k, i, s) in reveal.items()}).encode()


def _answer(payload: bytes) -> Any:
    """The relay's answer; a site the relay dropped raises (the sentence says why)."""
    try:
        answer = json.loads(payload.decode())
    except (UnicodeDecodeError, ValueError):
        raise SecureAggregationError("the aggregator's secure-aggregation answer is not JSON") from None
    if isinstance(answer, dict) and isinstance(answer.get("dropped"), str):
        raise SecureAggregationError(answer["dropped"])
    return answer


class SecAggClient:
    """One site's side of one round over a polling transport: ``send(kind, payload)`` and
    ``fetch(kind) -> bytes | None`` (None: not ready yet, asked again every ``poll`` seconds)."""

    def __init__(self, name: str, sites: list[str], threshold: int, round_num: int, signing_key: Any,
                 certificate_pem: str, peer_key: Callable[[str, str], Any], send: Callable[[str, bytes], None],
                 fetch: Callable[[str], bytes | None], *, poll: float = 0.1) -> None:
        self.args = name, sites, threshold, round_num, signing_key, certificate_pem, peer_key
        self.send, self.fetch, self.poll = send, fetch, poll

    def run(self, vector: np.ndarray, quantizer: Quantizer) -> dict[str, float]:
        """Takes part in the round with ``vector``; returns the bytes it sent (``secagg_bytes``), the
        wall-clock seconds from its first message to its last (``secagg_s``, waits for the others
        included) and the CPU seconds of its own protocol work (``secagg_cpu_s``: keys, shares, masks)."""
        began, cpu, self.waited_cpu, sent = time.perf_counter(), time.process_time(), 0.0, 0
        steps = SecAggSteps(*self.args, vector, quantizer)
        payload = steps.advert()
        for kind, answer, step in (("advert", "adverts", steps.boxes), ("boxes", "boxes", steps.masked),
                                   ("masked", "survivors", steps.reveal)):
            self.send(kind, payload)
            sent += len(payload)
            payload = step(self._wait(answer))
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
