"""Secure aggregation between processes: the aggregator's relay and a site's side of one round, as
messages any engine can carry (:mod:`.secagg` has the cryptography; this module the order, checks and
dropouts of Bonawitz et al.'s protocol against an actively lying server, with its consistency round).

The aggregator (:class:`SecAggRelay`) only routes and sums. Each phase collects one message from
every site still in the round and closes when all have arrived, or when the engine's deadline closes
it with those present (:meth:`SecAggRelay.close`; fewer than the threshold ends the round):

=========== ======================================================= ===========================================
phase       a site sends                                            then fetches
=========== ======================================================= ===========================================
advert      its public keys and seed commitment, signed; its        ``adverts``: every site's (U1)
            certificate (or a withdrawal: its own input failed
            its checks)
boxes       its encrypted Shamir shares, one per peer of U1         ``boxes``: those addressed to it, and U2
masked      its masked vector (the only large message)              ``survivors``: U3
consistency its signature over the U3 it was told                   ``signatures``: U3's members' signatures
reveal      shares of ``b`` for U3, of the ``s`` key for U2 − U3    nothing: the relay unmasks the sum
=========== ======================================================= ===========================================

A site never trusts the relay's sets: each must be a subset of the one before, hold the site itself
and at least ``threshold`` members, or the site stops with one sentence; it reveals only once at least
``threshold`` members of U3 signed that very U3 (so two sites told different survivor sets cannot both
reveal), and it works out U2 − U3 itself. Every signature is bound to the session (the plan's digest,
:func:`session_digest`), the round, the threshold and the signer. A site checks every peer's long-term
key with the engine's ``peer_key`` (certificate or registration, then the site's own pinned roster,
:class:`PinnedKeys`) before it sends a share.

Messages are JSON (bytes in base64) except the masked vector (raw ring words); each is checked for
its exact shape before it is used, and a malformed one raises :class:`SecureAggregationError` naming
the sender. The guarantee, as the paper proves it, is in docs/privacy.md.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config.sections import minimum_threshold
from .secagg import (Quantizer, SecAggSite, SecureAggregationError, SumLayout, fingerprint, flatten_terms,
                     site_terms, term_scale, unmask)

PHASES = ("advert", "boxes", "masked", "consistency", "reveal")
ANSWERS = {"adverts": 1, "boxes": 2, "survivors": 3, "signatures": 4}  # what a site fetches → the phase that closed
KEY_BYTES, SHARE_BYTES, BOX_BYTES = 32, 32, 1 + 32 + 32 + 16  # a box: index, b share, s share, Poly1305 tag
ADVERT_FIELDS = ("c_pk", "s_pk", "commit", "signature", "certificate")
MAX_SIGNATURE, MAX_CERTIFICATE, MAX_REASON = 1024, 16384, 500


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
        for name in ("c_pk", "s_pk", "commit"):
            _unb64(advert[name], KEY_BYTES, name)
        if len(_unb64(advert["signature"], None, "its signature")) > MAX_SIGNATURE:
            raise SecureAggregationError("its signature is too long")
    except SecureAggregationError as exc:
        raise SecureAggregationError(f"{what}: site {site}'s advert is malformed ({exc})") from None
    if not isinstance(advert["certificate"], str) or not advert["certificate"] \
            or len(advert["certificate"]) > MAX_CERTIFICATE:
        raise SecureAggregationError(f"{what}: site {site}'s advert carries no certificate or key (text)")
    return advert


# --- the aggregator ---------------------------------------------------------------------------------
def relay_for(sites: list[str], settings: Any, layout: SumLayout) -> SecAggRelay:
    """The relay of a federation of ``sites`` under ``settings`` (the plan's secure_aggregation)."""
    return SecAggRelay(sites, settings.sites_needed(len(sites)), layout.words,
                       Quantizer.for_sites(settings.clip, len(sites), settings.bits))


class SecAggRelay:
    """The aggregator's side for a federation of ``sites`` (names, in the plan's order): one round at
    a time, begun by the engine (:meth:`begin`); a message of any other round is refused.
    ``words``: the length of every site's vector; ``quantizer``: the ring (the same at every site).
    Thread-safe."""

    def __init__(self, sites: list[str], threshold: int, words: int, quantizer: Quantizer) -> None:
        self.all_sites, self.threshold, self.words, self.quantizer = list(sites), threshold, words, quantizer
        self.at_least = 0  # the engine's own floor (e.g. OpenFL's min_sites): fewer present ends the round
        self.lock = threading.RLock()
        self.round = -1
        self.begin(0)

    def begin(self, round_num: int) -> None:
        with self.lock:
            self.round, self.phase = round_num, 0
            self.members: list[list[str]] = [list(self.all_sites)]  # U0 (all), U1 … U5
            self.received: list[dict[str, Any]] = [{} for _ in PHASES]
            self.dropped: dict[str, str] = {}  # site → why it is out (the phase it missed, or its withdrawal)
            self.withdrawn: dict[str, str] = {}  # site → the reason it gave
            self.blamed: dict[str, str] = {}  # site → its share that disagreed (left out of the unmasking)
            self.bytes_from: dict[str, int] = {}  # site → the payload bytes it sent this round
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
            if round_num != self.round:
                raise SecureAggregationError(f"site {site} sent a secure-aggregation {kind} message of round "
                                             f"{round_num + 1} during round {self.round + 1}; refused")
            if site in self.dropped:
                raise SecureAggregationError(f"site {site} was dropped from round {round_num + 1}'s secure aggregation "
                                             f"({self.dropped[site]}); its {kind} message is refused")
            if kind not in PHASES or PHASES.index(kind) != self.phase:
                expected = PHASES[self.phase] if self.open else "nothing"
                raise SecureAggregationError(f"site {site} sent a secure-aggregation {kind} message in round "
                                             f"{round_num + 1} where {expected} was expected; refused")
            if site not in self.members[self.phase]:
                raise SecureAggregationError(f"site {site} is not a member of round {round_num + 1}'s secure aggregation")
            if site in self.received[self.phase]:
                raise SecureAggregationError(f"site {site} sent its {kind} message of round {round_num + 1} twice")
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
                    f"round {self.round + 1}'s secure aggregation: only {len(present)} of {len(expected)} sites sent "
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
                return json.dumps({"dropped": f"this site was dropped from round {round_num + 1}'s secure aggregation "
                                              f"({self.dropped[site]})"}).encode()
            if self.phase < ANSWERS[kind]:
                return None
            if kind == "adverts":
                return json.dumps(self.received[0]).encode()
            if kind == "boxes":
                boxes = {sender: box[site] for sender, box in self.received[1].items() if site in box}
                return json.dumps({"peers": self.members[2], "boxes": boxes}).encode()
            if kind == "survivors":
                return json.dumps({"survivors": self.members[3]}).encode()
            return json.dumps({"signatures": self.received[3]}).encode()

    def total(self, round_num: int) -> np.ndarray:
        """The sum of the survivors' vectors of ``round_num`` (float64), once unmasked."""
        with self.lock:
            if round_num != self.round or self.sum is None:
                raise SecureAggregationError(f"round {round_num + 1}'s secure sum is not complete: the sites' messages "
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
            raise SecureAggregationError(f"round {self.round + 1}'s secure aggregation: {len(present)} sites left"
                                         f"{self._withdrawals()}, fewer than the {needed} needed; the round ends "
                                         "without a sum")
        self.members.append(present)
        self.phase += 1
        if self.phase == len(PHASES):
            adverts = {s: {"s_pk": _unb64(a["s_pk"], KEY_BYTES, "a key"), "commit": _unb64(a["commit"], KEY_BYTES, "a key")}
                       for s, a in self.received[0].items()}
            masked = {s: self.received[2][s] for s in self.members[3]}
            cpu = time.process_time()
            self.sum = unmask(masked, self.received[4], adverts, self.members[2], self.threshold, self.quantizer,
                              self.blamed)
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

    def _check_reveal(self, site: str, payload: bytes) -> dict[str, tuple[str, int, bytes]]:
        reveal = _json(payload, f"site {site}", "reveal")
        survivors = set(self.members[3])
        dropped = set(self.members[2]) - survivors
        if not isinstance(reveal, dict) or set(reveal) != survivors | dropped:
            raise SecureAggregationError(f"site {site} revealed shares for other sites than the round's")
        index = self.members[1].index(site) + 1  # a share's x-coordinate: the holder's place in U1
        out = {}
        for target, entry in reveal.items():
            kind = "b" if target in survivors else "s"
            if not (isinstance(entry, list) and len(entry) == 3 and entry[0] == kind and entry[1] == index):
                raise SecureAggregationError(f"site {site}'s share for {target} is malformed (a {kind} share at index "
                                             f"{index} was expected)")
            out[target] = (kind, index, _unb64(entry[2], SHARE_BYTES, f"site {site}'s share for {target}"))
        return out


# --- a site's trust in its peers' keys ------------------------------------------------------------
class PinnedKeys:
    """A site's check of a peer's long-term key: the engine's own check (``verify(site, text)``: a
    certificate against the federation's CA, a registered SuperNode key, …) and then the site's
    roster (``pins``: site → :func:`~.secagg.fingerprint`, from its policy's ``peers:``), which the
    hospitals confirmed among themselves and the operator cannot change. A pinned peer whose key
    differs is refused; an unpinned one is refused when ``required`` (the policy requires secure
    aggregation), else accepted and listed in ``unpinned``."""

    def __init__(self, verify: Callable[[str, str], Any], pins: Mapping[str, str] | None = None,
                 required: bool = False) -> None:
        self.verify, self.pins, self.required = verify, dict(pins or {}), required
        self.unpinned: set[str] = set()

    def __call__(self, site: str, text: str) -> Any:
        key = self.verify(site, text)
        seen = fingerprint(key)
        pinned = self.pins.get(site)
        if pinned is not None and pinned.lower() != seen.lower():
            raise SecureAggregationError(f"site {site}'s key {seen} is not the key pinned for it in this site's policy "
                                         f"({pinned}): refused, nothing is shared with it (a key substituted on the "
                                         "way, or a site that changed its key without telling the others)")
        if pinned is None:
            if self.required:
                raise SecureAggregationError(f"site {site}'s key ({seen}) is not pinned in this site's policy (peers:), "
                                             "which requires secure aggregation: nothing is shared with it (confirm its "
                                             "fingerprint with that site, e.g. by phone, and add it under peers:)")
            self.unpinned.add(site)
        return key


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
    (:class:`PinnedKeys`); raises otherwise. ``session``: :func:`session_digest` of this site's plan."""

    def __init__(self, name: str, sites: list[str], threshold: int, round_num: int, signing_key: Any,
                 certificate: str, peer_key: Callable[[str, str], Any], vector: np.ndarray, quantizer: Quantizer,
                 session: bytes = b"") -> None:
        if name not in sites:
            raise SecureAggregationError(f"site {name} is not a site of this plan ({', '.join(sites)})")
        if not minimum_threshold(len(sites)) <= threshold <= len(sites):
            raise SecureAggregationError(f"the plan's secure-aggregation threshold {threshold} of {len(sites)} sites is "
                                         f"outside {minimum_threshold(len(sites))}..{len(sites)}: below a majority an "
                                         "operator that lies could unmask this site; this site takes no part")
        self.plan_sites, self.threshold = list(sites), threshold
        self.site = SecAggSite(name, list(sites), threshold, round_num, signing_key, session)
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
        return f"round {self.site.round_num + 1}"

    def _members(self, names: list[str], within: list[str], what: str) -> list[str]:
        """``names`` (the relay's set) checked: within the previous set, holding this site, at least the threshold."""
        strangers = sorted(set(names) - set(within))
        if strangers:
            raise SecureAggregationError(f"the aggregator's {what} of {self._round()} names {', '.join(strangers)}, "
                                         "outside the sites of the phase before: refused, nothing more is sent")
        if self.name not in names:
            raise SecureAggregationError(f"the aggregator left this site ({self.name}) out of {self._round()}'s {what}")
        if len(names) < self.threshold:
            raise SecureAggregationError(f"the aggregator's {what} of {self._round()} has {len(names)} sites, fewer than "
                                         f"the threshold {self.threshold}: refused, nothing more is sent (fewer would "
                                         "let it unmask a single site)")
        return [s for s in within if s in names]  # in the plan's order

    def advert(self) -> bytes:
        advert = self.site.advertise()
        self.sent_advert = {**{k: _b64(v) for k, v in advert.items()}, "certificate": self.certificate}
        return json.dumps(self.sent_advert).encode()

    def boxes(self, answer: bytes | None) -> bytes:
        adverts = _answer(answer)
        self.u1 = self._members(list(adverts), self.plan_sites, "key adverts")
        for peer in self.u1:
            check_advert(peer, adverts[peer], "the aggregator's adverts")
        if adverts[self.name] != self.sent_advert:
            raise SecureAggregationError(f"the aggregator's adverts of {self._round()} carry keys for this site "
                                         f"({self.name}) other than the ones it sent: refused")
        for peer in self.u1:
            if peer != self.name:
                self.keys[peer] = self.peer_key(peer, adverts[peer]["certificate"])
        self.site.sites = list(self.u1)
        boxes = self.site.share({p: {k: _unb64(adverts[p][k], None, k) for k in ("c_pk", "s_pk", "commit", "signature")}
                                 for p in self.u1}, self.keys)
        return json.dumps({p: _b64(b) for p, b in boxes.items()}).encode()

    def masked(self, answer: bytes | None) -> bytes:
        mine = _answer(answer)
        if set(mine) != {"peers", "boxes"} or not isinstance(mine["boxes"], dict):
            raise SecureAggregationError(f"the aggregator's shares for {self.name} are malformed; refused")
        self.u2 = self._members(_names(mine["peers"], "the aggregator's list of sites that shared"), self.u1,
                                "list of sites that shared keys")
        if set(mine["boxes"]) != set(self.u2) - {self.name}:
            raise SecureAggregationError(f"the aggregator's shares for {self.name} do not match {self._round()}'s sites")
        self.site.receive({p: _unb64(b, BOX_BYTES, f"the shares from {p}") for p, b in mine["boxes"].items()})
        return self.site.mask(self.vector, self.quantizer, self.u2).tobytes()

    def consistency(self, answer: bytes | None) -> bytes:
        told = _answer(answer)
        if set(told) != {"survivors"}:
            raise SecureAggregationError("the aggregator's survivor set is malformed; refused")
        self.u3 = self._members(_names(told["survivors"], "the aggregator's survivor set"), self.u2, "survivor set")
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
        return json.dumps({t: [k, i, _b64(s)] for t, (k, i, s) in reveal.items()}).encode()


STEPS = (("advert", "adverts", "boxes"), ("boxes", "boxes", "masked"), ("masked", "survivors", "consistency"),
         ("consistency", "signatures", "reveal"))  # what a site sends, what it fetches next, its next step


def withdrawal(reason: str) -> bytes:
    """The advert-phase message of a site whose own input failed its checks: it takes no part in the
    round (the relay drops it at once, naming the reason, instead of waiting for its deadline)."""
    return json.dumps({"withdraw": reason[:MAX_REASON]}).encode()


class SecAggClient:
    """One site's side of one round over a polling transport: ``send(kind, payload)`` and
    ``fetch(kind) -> bytes | None`` (None: not ready yet, asked again every ``poll`` seconds)."""

    def __init__(self, name: str, sites: list[str], threshold: int, round_num: int, signing_key: Any,
                 certificate_pem: str, peer_key: Callable[[str, str], Any], send: Callable[[str, bytes], None],
                 fetch: Callable[[str], bytes | None], *, poll: float = 0.1, session: bytes = b"") -> None:
        self.args = name, sites, threshold, round_num, signing_key, certificate_pem, peer_key
        self.session = session
        self.send, self.fetch, self.poll = send, fetch, poll

    def withdraw(self, reason: str) -> None:
        """Tell the relay this site takes no part in the round, and why."""
        self.send("advert", withdrawal(reason))

    def run(self, vector: np.ndarray, quantizer: Quantizer) -> dict[str, float]:
        """Takes part in the round with ``vector``; returns the bytes it sent (``secagg_bytes``), the
        wall-clock seconds from its first message to its last (``secagg_s``, waits for the others
        included) and the CPU seconds of its own protocol work (``secagg_cpu_s``: keys, shares, masks)."""
        began, cpu, self.waited_cpu, sent = time.perf_counter(), time.process_time(), 0.0, 0
        steps = SecAggSteps(*self.args, vector, quantizer, self.session)
        payload = steps.advert()
        for kind, answer, step in STEPS:
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


# --- a round with every party in this process (the simulator) ----------------------------------------
@dataclass
class SecureRound:
    """What :func:`secure_sum` measured: the bytes one site sent (keys, shares, masked vector,
    consistency signature, reveals) and those it would have sent as a plain float32 upload."""

    sites: int
    threshold: int
    bytes_per_site: float
    plain_bytes_per_site: float
    site_seconds: float = 0.0  # one site's protocol work (keys, shares, masking, signing, reveal), mean over sites
    aggregator_seconds: float = 0.0  # routing and unmasking


def secure_sum(vectors: dict[str, np.ndarray], settings: Any, round_num: int, *, dropped: tuple[str, ...] = (),
               session: bytes = b"") -> tuple[np.ndarray, SecureRound]:
    """``Σ vectors`` (site → float64 vector within ``[-settings.clip, settings.clip]``) by the
    deployments' own protocol (:class:`SecAggRelay` and a :class:`SecAggSteps` per site, their
    messages passed in this process; each site with a fresh Ed25519 key standing in for its
    certificate's); ``dropped``: sites that go silent after the shares went round (their vectors are
    not in the sum). Returns the sum and what it cost (:class:`SecureRound`)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    names = sorted(vectors)
    t = settings.sites_needed(len(names))
    quantizer = Quantizer.for_sites(settings.clip, len(names), settings.bits)
    private = {n: ed25519.Ed25519PrivateKey.generate() for n in names}
    pem = {n: k.public_key().public_bytes(serialization.Encoding.PEM,
                                          serialization.PublicFormat.SubjectPublicKeyInfo).decode()
           for n, k in private.items()}

    def peer_key(site: str, text: str) -> Any:
        if text != pem.get(site):
            raise SecureAggregationError(f"site {site}'s key is not the one this federation holds for it")
        return private[site].public_key()

    relay = SecAggRelay(names, t, next(iter(vectors.values())).size, quantizer)
    relay.begin(round_num)
    steps = {n: SecAggSteps(n, names, t, round_num, private[n], pem[n], peer_key, vectors[n], quantizer, session)
             for n in names}
    cpu, sent = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)

    def at(site: str, call: Callable[[], bytes]) -> bytes:
        began = time.process_time()
        try:
            return call()
        finally:
            cpu[site] += time.process_time() - began

    payloads = {n: at(n, steps[n].advert) for n in names}
    for kind, answer, step in (*STEPS, ("reveal", None, None)):
        for n, payload in payloads.items():
            if kind == "masked" and n in dropped:
                continue
            relay.receive(n, round_num, kind, payload)
            sent[n] += len(payload)
        if relay.open and PHASES.index(kind) == relay.phase:
            relay.close()
        if step is not None:
            payloads = {n: at(n, lambda n=n: getattr(steps[n], step)(relay.answer(n, round_num, answer)))
                        for n in payloads if n not in relay.dropped}
    total = relay.total(round_num)
    plain = next(iter(vectors.values())).size * 4
    return total, SecureRound(len(names), t, float(sent[names[0]]), float(plain), sum(cpu.values()) / len(names),
                              relay.unmask_cpu_s)


def secure_aggregate(algorithm: Any, uploads: dict[str, dict[str, Any]], weights: dict[str, float], settings: Any,
                     round_num: int, server: Any, *, dropped: tuple[str, ...] = (), session: bytes = b""):
    """A plugin's downlink from the secure sum of its sites' :meth:`~fedcontrast.algorithms.Algorithm.secure_terms`
    (:func:`~.secagg.site_terms`), every party in this process: (downlink, :class:`SecureRound`)."""
    names = sorted(uploads)
    terms = {n: site_terms(algorithm, uploads[n], weights[n], settings) for n in names}
    layout = SumLayout({k: tuple(v.shape) for k, v in terms[names[0]].items()},
                       {k: v.dtype for k, v in uploads[names[0]].items()}, term_scale(algorithm, settings))
    total, cost = secure_sum({n: flatten_terms(terms[n], layout.scale) for n in names}, settings, round_num,
                             dropped=dropped, session=session)
    cost.plain_bytes_per_site = float(sum(v.numel() * v.element_size() for v in uploads[names[0]].values()) + 4)
    return layout.downlink(algorithm, total, server), cost
