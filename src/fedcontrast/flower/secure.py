"""Secure aggregation on a Flower deployment: the protocol of :mod:`fedcontrast.privacy.secagg_protocol`
carried by the ServerApp's messages. After a round's ``train`` message each site answers with its
signed keys instead of its uploads; three ``query.secagg`` messages follow (``boxes``, ``masked``,
``reveal``), each carrying the relay's answer to that site; the ServerApp unmasks only the sum.

A site signs its keys with its SuperNode's private key (``fedcontrast flower site-key``); its peers
check the signature against the public key the operator registered for that site (sent with the
keys; the ServerApp refuses an advert whose key is not the registered one). The site's secrets of a
round (its key-agreement keys, its self-mask seed) live only in its long-lived worker's memory, so
secure aggregation needs the worker (``fedcontrast flower supernode`` without ``--no-worker``). A site
that stays silent stops the run, named, as without secure aggregation (no ``min_sites`` on Flower).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..config import site_names
from ..errors import FedContrastError
from ..privacy.secagg import Quantizer, SecureAggregationError, secure_vector
from ..privacy.secagg_protocol import SecAggSteps

SECAGG_MESSAGE = "query.secagg"
PHASES = (("boxes", "adverts"), ("masked", "boxes"), ("reveal", "survivors"))  # what a site sends, given what
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

    if not settings.get("worker"):
        raise FedContrastError("secure aggregation needs this site's long-lived worker (its round secrets live in "
                               "its memory): start the SuperNode with `fedcontrast flower supernode`, without "
                               "--no-worker")
    if not settings.get("signing-key"):
        raise FedContrastError("secure aggregation signs this site's keys with its SuperNode key, which this "
                               "SuperNode was started without: start it with `fedcontrast flower supernode --key`")
    signing = serialization.load_ssh_private_key(Path(settings["signing-key"]).read_bytes(), None)
    secure, sites = site.config.secure_aggregation, site_names(site.config)
    steps = SecAggSteps(site.name, sites, secure.sites_needed(len(sites)), round_num, signing,
                        _openssh(signing.public_key()), registered_key,
                        secure_vector(site.algorithm, uploads, weight, secure),
                        Quantizer.for_sites(secure.clip, len(sites), secure.bits))
    for key in [k for k in _SESSIONS if k[:2] == (site.run_id, site.name)]:  # an earlier round that never ended
        del _SESSIONS[key]
    _SESSIONS[(site.run_id, site.name, round_num)] = steps
    return steps.advert()


def site_step(site: Any, content: dict[str, Any]) -> dict[str, Any]:
    """A ``query.secagg`` message: this site's next protocol message."""
    task = content["task"]
    round_num, phase = int(task["round"]), str(task["phase"])
    steps = _SESSIONS.get((site.run_id, site.name, round_num))
    if steps is None or phase not in dict(PHASES):
        raise FedContrastError(f"no secure aggregation of round {round_num + 1} is under way at this site (its worker "
                               "restarted?), or the phase is unknown; refused")
    payload = getattr(steps, phase)(bytes(content["secagg"]["payload"]))
    if phase == "reveal":
        del _SESSIONS[(site.run_id, site.name, round_num)]
    return {"secagg": {"payload": payload}}


# --- the ServerApp --------------------------------------------------------------------------------
def secure_round(server: Any, round_num: int, adverts: dict[str, bytes], site_keys: dict[str, str]):
    """Round ``round_num``'s downlink from the secure sum: ``adverts`` (site → its train reply's
    keys) checked against the registered keys, then the three exchanges."""
    from flwr.app import ConfigRecord

    relay = server.relay
    relay.begin(round_num)
    for site, payload in adverts.items():
        if not site_keys.get(site):
            raise SecureAggregationError(f"site {site}'s key was registered without being recorded for secure "
                                         "aggregation (an older deployment folder): register the sites again in a new "
                                         "folder (`fedcontrast flower init`, `register`)")
        try:
            claimed = json.loads(payload.decode()).get("certificate", "")
        except (UnicodeDecodeError, ValueError, AttributeError):
            claimed = ""
        if str(claimed).split()[:2] != site_keys[site].split()[:2]:
            raise SecureAggregationError(f"site {site} advertised a signing key other than the one registered for it; "
                                         "the run stops")
        relay.receive(site, round_num, "advert", payload)
    for phase, answer in PHASES:
        members = relay.members[relay.phase]
        messages = {s: server.message(s, SECAGG_MESSAGE, {
            "task": ConfigRecord({"round": round_num, "phase": phase}),
            "secagg": ConfigRecord({"payload": relay.answer(s, round_num, answer)})}, round_num + 1) for s in members}
        replies = server.exchange(messages, server.round_timeout, f"round {round_num + 1}'s secure aggregation ({phase})")
        for site, reply in replies.items():
            relay.receive(site, round_num, phase, bytes(reply.content["secagg"]["payload"]))
    return server.sum_layout.downlink(server.algorithm, relay.total(round_num), server.server)
