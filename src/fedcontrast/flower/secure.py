"""Secure aggregation on a Flower deployment: the protocol of :mod:`fedcontrast.privacy.secagg_protocol`
carried by the ServerApp's messages. After a round's ``train`` message each site answers with its
signed keys instead of its uploads (or a withdrawal, when its own input fails its checks); four
``query.secagg`` messages follow (``boxes``, ``masked``, ``consistency``, ``reveal``; SecAgg+ adds
``graph`` first, each site's randomness for the round's graph), each carrying the relay's answer to
that site; the ServerApp unmasks only the sum.

A site signs its keys with its SuperNode's private key (``fedcontrast flower site-key``). A peer's key
travels inside its advert, put there by the operator's ServerApp, so a site checks it against its own
roster: the fingerprints its policy pins (``peers:``), which the hospitals confirmed among themselves
(``fedcontrast site roster``); without a pin only the ServerApp's check against the registered key
stands between the site and a lying operator (the site says so in its log), and under
``require_secure_aggregation`` an unpinned peer is refused. The site's secrets of a round (its
key-agreement keys, its self-mask seed) live only in its long-lived worker's memory, so secure
aggregation needs the worker (``fedcontrast flower supernode`` without ``--no-worker``). A site that
stays silent at any phase is dropped when the plan's ``min_sites`` allows (its masks removed with the
others' shares), else it stops the run, named.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ..config import site_names
from ..errors import FedContrastError
from ..privacy.policy import agreed_roster
from ..privacy.secagg import Quantizer, SecureAggregationError
from ..privacy.secagg_protocol import PinnedKeys, SecAggSteps, session_digest, withdrawal
from ..privacy.secagg_terms import checked_vector
from ..tensors import InvalidUploadError
from .console import say

logger = logging.getLogger("fedcontrast.flower")

SECAGG_MESSAGE = "query.secagg"
PHASES = (("graph", "commitments"), ("boxes", "adverts"), ("masked", "boxes"), ("consistency", "survivors"),
          ("reveal", "signatures"))  # what a site sends, given what (no graph phase in the full graph)
_SESSIONS: dict[tuple[int, str, int], SecAggSteps] = {}  # (run, site, round) → its round, in the worker's memory


def _openssh(key: Any) -> str:
    from cryptography.hazmat.primitives import serialization

    return key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def registered_key(site: str, text: str) -> Any:
    """A peer's public key as the operator registered it (OpenSSH text)."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    try:
        return serialization.load_ssh_public_key(text.strip().encode())
    except (ValueError, UnsupportedAlgorithm):
        raise SecureAggregationError(f"site {site}'s registered key cannot be read; its keys are refused") from None


# --- a site (its worker) ----------------------------------------------------------------------------
def begin_site_round(site: Any, round_num: int, uploads: dict[str, Any], weight: float,
                     settings: dict[str, str]) -> bytes:
    """This site's signed keys for round ``round_num``; its secrets stay in this process until the round ends."""
    from cryptography.hazmat.primitives import serialization

    if not (settings.get("worker") or settings.get("runner")):  # the worker: behind ClientApps, or the runner
        raise FedContrastError("secure aggregation needs this site's long-lived worker (its round secrets live in "
                               "its memory): start the SuperNode with `fedcontrast flower supernode`, without "
                               "--no-worker")
    if not settings.get("signing-key"):
        raise FedContrastError("secure aggregation signs this site's keys with its SuperNode key, which this "
                               "SuperNode was started without: start it with `fedcontrast flower supernode --key`")
    signing = serialization.load_ssh_private_key(Path(settings["signing-key"]).read_bytes(), None)
    secure, sites = site.config.secure_aggregation, site_names(site.config)
    for key in [k for k in _SESSIONS if k[:2] == (site.run_id, site.name)]:  # an earlier round that never ended
        del _SESSIONS[key]
    try:  # the checks the ServerApp cannot make on a masked vector, made here before masking
        vector = checked_vector(site.name, site.algorithm, uploads, weight, secure,
                                site.algorithm.upload_specs(site.model, site.shape["num_classes"]))
    except InvalidUploadError as exc:
        logger.error("%s, round %d: %s; this site withdraws from the round's secure sum", site.name, round_num, exc)
        return withdrawal(str(exc))
    policy = site.data.site_policy
    members, agreed = agreed_roster(policy)  # the roster the sites pinned: the protocol checks the plan against it
    peers = PinnedKeys(registered_key, getattr(policy, "peers", None),
                       bool(getattr(policy, "require_secure_aggregation", False)), members, agreed)
    steps = SecAggSteps(site.name, sites, secure.sites_needed(len(sites)), round_num, signing,
                        _openssh(signing.public_key()), peers, vector,
                        Quantizer.for_sites(secure.clip, len(sites), secure.bits),
                        session_digest(site.config.to_dict(), sites, str(site.run_id)), neighbours=secure.neighbours)
    _SESSIONS[(site.run_id, site.name, round_num)] = steps
    return steps.advert()


def site_step(site: Any, content: dict[str, Any]) -> dict[str, Any]:
    """A ``query.secagg`` message: this site's next protocol message."""
    task = content["task"]
    round_num, phase = int(task["round"]), str(task["phase"])
    steps = _SESSIONS.get((site.run_id, site.name, round_num))
    if steps is None or phase not in dict(PHASES):
        raise FedContrastError(f"no secure aggregation of round {round_num} is under way at this site (its worker "
                               "restarted?), or the phase is unknown; refused")
    try:
        payload = getattr(steps, phase)(bytes(content["secagg"]["payload"]))
    except SecureAggregationError:
        del _SESSIONS[(site.run_id, site.name, round_num)]  # nothing more of this round leaves the site
        raise
    peers = steps.peer_key  # the PinnedKeys given at the advert
    if phase == "boxes" and isinstance(peers, PinnedKeys) and peers.unpinned:
        logger.warning("%s, round %d: the keys of %s came from the operator's ServerApp with nothing of this site's to "
                       "check them against: pin them in its policy (peers:, `fedcontrast site roster`)", site.name,
                       round_num, ", ".join(sorted(peers.unpinned)))
    if phase == "reveal":
        del _SESSIONS[(site.run_id, site.name, round_num)]
    return {"secagg": {"payload": payload}}


# --- the ServerApp --------------------------------------------------------------------------------
def secure_round(server: Any, round_num: int, adverts: dict[str, bytes], site_keys: dict[str, str]):
    """Round ``round_num``'s secure sum (the survivors' terms, unmasked): ``adverts`` (site → its train
    reply's keys) checked against the registered keys, then the four exchanges."""
    from flwr.app import ConfigRecord

    relay = server.relay
    relay.begin(round_num)  # a site that withdraws is dropped, named; the round goes on while the threshold allows
    for site, payload in adverts.items():
        try:
            message = json.loads(payload.decode())
        except (UnicodeDecodeError, ValueError):
            message = None
        if isinstance(message, dict) and set(message) == {"withdraw"}:  # its own input failed its checks
            relay.receive(site, round_num, "advert", payload)
            say_withdrawn(site, round_num, message["withdraw"])
            continue
        if not site_keys.get(site):
            raise SecureAggregationError(f"site {site}'s key was registered without being recorded for secure "
                                         "aggregation (an older deployment folder): register the sites again in a new "
                                         "folder (`fedcontrast flower init`, `register`)")
        claimed = message.get("certificate", "") if isinstance(message, dict) else ""
        if str(claimed).split()[:2] != site_keys[site].split()[:2]:
            raise SecureAggregationError(f"site {site} advertised a signing key other than the one registered for it; "
                                         "the run stops")
        relay.receive(site, round_num, "advert", payload)
    _close_without_the_silent(server, relay, 0)  # sites that did not answer the training message (min_sites)
    for phase, answer in PHASES:
        if phase == "graph" and relay.full:
            continue  # the full graph: nothing to draw
        members = relay.members[relay.phase]
        messages = {s: server.message(s, SECAGG_MESSAGE, {
            "task": ConfigRecord({"round": round_num, "phase": phase}),
            "secagg": ConfigRecord({"payload": relay.answer(s, round_num, answer)})}, round_num) for s in members}
        replies = server.ask(messages, server.round_timeout,
                                  f"round {round_num}'s secure aggregation ({phase})", drop=True)
        for site, reply in replies.items():
            relay.receive(site, round_num, phase, bytes(reply.content["secagg"]["payload"]))
        _close_without_the_silent(server, relay, PHASES.index((phase, answer)) + 1)
    for site, why in sorted(relay.blamed.items()):
        say(f"round {round_num}: site {site} sent a bad secure-aggregation share: {why}")
    sent = [relay.bytes_from.get(s, 0) for s in relay.survivors]
    say(f"round {round_num}: secure sum of {', '.join(relay.survivors)} (threshold {relay.threshold}; "
        f"{sum(sent) / max(1, len(sent)):.0f} bytes per site; unmasking {relay.unmask_cpu_s:.3f} s of CPU)")
    return relay.total(round_num)


def _close_without_the_silent(server: Any, relay: Any, phase: int) -> None:
    """A phase some sites did not answer (the ServerApp let the round go on without them: ``min_sites``):
    closed with those that did, the others dropped from the secure sum (their masks are removed with
    the others' shares, as the protocol's dropouts are)."""
    if relay.open and relay.phase == phase:
        relay.close(server.min_sites or 0)


def say_withdrawn(site: str, round_num: int, reason: Any) -> None:
    say(f"round {round_num}: site {site} takes no part in the secure sum: {str(reason)[:500]}")
