"""Secure aggregation over an OpenFL federation: the relay and the site's client of
:mod:`fedcontrast.privacy.secagg_protocol`, carried by OpenFL's own calls over the federation's
mutual TLS.

A site sends a protocol message as the results of a pseudo-task ``fedcontrast_secagg:KIND`` (one
tensor carrying the message's bytes), and fetches what the relay publishes as the aggregated tensor
``fedcontrast.secagg:KIND`` of the round (an empty answer: not ready yet; asked again). The
aggregator (:class:`~.aggregator.SafeAggregator`) hands both to its :class:`SecAggRelay`, whose
deadlines are the plan's ``round_timeout`` (per phase) and whose dropouts follow ``min_sites``; the
round's train task uploads only a placeholder, and the aggregation function
(:class:`~.aggregation.PluginAggregation`) takes the relay's unmasked sum. Each site signs its keys
with its federation certificate's private key; its peers check that certificate against the
federation's CA (``cert_chain.crt``) and its name.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from openfl.utilities import TensorKey

from ..config import RunConfig, site_names
from ..errors import ConfigError
from ..privacy.policy import agreed_roster
from ..privacy.secagg import Quantizer, SecureAggregationError
from ..privacy.secagg_protocol import PHASES, PinnedKeys, SecAggClient, session_digest
from ..privacy.secagg_relay import SecAggRelay
from .protocol import SECAGG_REFUSED, FederationStopped

logger = logging.getLogger("fedcontrast.openfl.components")

SECAGG_TASK = "fedcontrast_secagg"  # task name prefix of a protocol message: fedcontrast_secagg:advert …
SECAGG_TENSOR = "fedcontrast.secagg"  # tensor name prefix of what a site fetches: fedcontrast.secagg:adverts …


class DroppedFromRound(SecureAggregationError):
    """The relay dropped this site from the round (it missed a phase's deadline): it stops without
    failing the federation, which goes on without it."""


# --- bytes in OpenFL's float32 tensors ---------------------------------------------------------------
def to_words(payload: bytes) -> np.ndarray:
    """``payload`` with its length in front, padded to whole float32 words (their bits are never computed with)."""
    data = len(payload).to_bytes(8, "little") + payload
    data += b"\0" * (-len(data) % 4)
    return np.frombuffer(data, dtype=np.float32).copy()


def from_words(array: np.ndarray, sender: str) -> bytes:
    data = np.ascontiguousarray(np.asarray(array, dtype=np.float32)).view(np.uint8).tobytes()
    size = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if not 0 <= size <= len(data) - 8:
        raise SecureAggregationError(f"{sender}'s secure-aggregation message is cut short or malformed")
    return data[8:8 + size]


def kind_of(name: str, prefix: str) -> str | None:
    """``KIND`` of ``PREFIX:KIND``; None for another name."""
    return name[len(prefix) + 1:] if name.startswith(prefix + ":") else None


# --- the aggregator ---------------------------------------------------------------------------------
def message_payload(aggregator: Any, collaborator: str, named_tensors: Any) -> bytes:
    """The bytes of a site's protocol message (one tensor, lossless as OpenFL sends it)."""
    if len(named_tensors) != 1:
        raise SecureAggregationError(f"site {collaborator} sent {len(named_tensors)} tensors in a secure-aggregation "
                                     "message, not one")
    named = named_tensors[0]
    metadata = [{"int_to_float": p.int_to_float, "int_list": p.int_list, "bool_list": p.bool_list}
                for p in named.transformer_metadata]
    key = TensorKey(named.name, aggregator.uuid, named.round_number, named.report, tuple(named.tags))
    try:
        _, array = aggregator.tensor_codec.decompress(key, data=named.data_bytes, transformer_metadata=metadata,
                                                      require_lossless=True)
    except Exception as exc:  # whatever the codec raises on bytes that are not its own
        raise SecureAggregationError(f"site {collaborator}'s secure-aggregation message "
                                     f"cannot be decoded ({exc})") from None
    return from_words(array, f"site {collaborator}")


def answer_tensor(aggregator: Any, payload: bytes | None, tensor_name: str, round_number: int) -> Any:
    """What a site's fetch is answered with: the payload as a lossless named tensor, or an empty one."""
    from openfl.protocols.base_pb2 import NamedTensor

    if payload is None:
        return NamedTensor()
    key = TensorKey(tensor_name, aggregator.uuid, round_number, False, ())
    return aggregator._nparray_to_named_tensor(key, to_words(payload), send_model_deltas=False, compress_lossless=True)


# --- a site --------------------------------------------------------------------------------------
class CertificateKeys:
    """Peers' signing keys from the certificates they advertise: signed by the federation's CA (the
    site's ``cert_chain.crt``), issued for the name they claim, within their dates."""

    def __init__(self, chain: str | Path) -> None:
        from cryptography import x509

        from ..yamlio import read_bytes

        self.authorities = x509.load_pem_x509_certificates(read_bytes(chain, "the CA chain"))

    def __call__(self, site: str, pem: str) -> Any:
        from cryptography import x509

        from ..deploy.certificates import identity, signed_by

        try:
            cert = x509.load_pem_x509_certificate(pem.encode())
            name = identity(cert, f"site {site}'s certificate")
        except (ValueError, ConfigError) as exc:
            raise SecureAggregationError(f"site {site}'s certificate cannot be read ({exc}); "
                                         "its keys are refused") from None
        if not signed_by(cert, self.authorities):
            raise SecureAggregationError(f"site {site}'s certificate is not signed by the federation's CA: its "
                                         "key-agreement keys are refused (keys swapped on the way?)")
        if name != site:
            raise SecureAggregationError(f"the keys advertised as site {site}'s come with a certificate issued for "
                                         f"{name}: refused (keys swapped on the way?)")
        now = dt.datetime.now(dt.timezone.utc)
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            raise SecureAggregationError(f"site {site}'s certificate is not valid now: its keys are refused")
        return cert.public_key()


class OpenFLChannel:
    """A collaborator's transport for :class:`SecAggClient`: its own gRPC client, private key and
    certificate (the plan's mutual TLS), its CA chain for its peers'."""

    def __init__(self, collaborator: Any) -> None:
        from cryptography.hazmat.primitives import serialization

        client = collaborator.client
        if not (getattr(client, "use_tls", False) and getattr(client, "require_client_auth", False)):
            raise ConfigError("secure aggregation needs the federation's mutual TLS (each site signs its keys with "
                              "its certificate's private key): turn use_tls and require_client_auth on")
        self.collaborator = collaborator
        from ..yamlio import read_bytes, read_text

        self.signing_key = serialization.load_pem_private_key(read_bytes(client.private_key, "private key"),
                                                              password=None)
        self.certificate = read_text(client.certificate, "certificate")
        self.peer_keys = CertificateKeys(client.root_certificate)

    def run(self, site: str, round_num: int, vector: np.ndarray | None, config: RunConfig,
            reason: str = "") -> dict[str, float]:
        """This site's part of round ``round_num``'s secure sum (counted from 1; OpenFL's own round
        number, counted from 0, is ``round_num - 1``), with ``vector`` (None: it withdraws, giving ``reason``)."""
        fl_round = round_num - 1
        settings = config.secure_aggregation
        assert settings is not None  # a secure round only in a plan with secure_aggregation
        sites = site_names(config)
        col = self.collaborator

        def send(kind: str, payload: bytes) -> None:
            key = TensorKey(SECAGG_TENSOR, site, fl_round, False, ())
            col.client.send_local_task_results(fl_round, f"{SECAGG_TASK}:{kind}", 0,
                                               [col.nparray_to_named_tensor(key, to_words(payload))])

        def fetch(kind: str) -> bytes | None:
            named = col.client.get_aggregated_tensor(f"{SECAGG_TENSOR}:{kind}", fl_round, False, (), True)
            if not named.data_bytes:
                return None
            return from_words(col.named_tensor_to_nparray(named), "the aggregator")

        policy = getattr(getattr(getattr(col, "task_runner", None), "data_loader", None), "site_policy", None)
        members, agreed = agreed_roster(policy)  # the roster the sites pinned: the protocol checks the plan against it
        peer_keys = PinnedKeys(self.peer_keys, getattr(policy, "peers", None),
                               bool(getattr(policy, "require_secure_aggregation", False)), members, agreed)
        session = session_digest(config.to_dict(), sites, str(getattr(col, "federation_uuid", "")))
        client = SecAggClient(site, sites, settings.sites_needed(len(sites)), round_num, self.signing_key,
                              self.certificate, peer_keys, send, fetch, poll=0.05, session=session,
                              neighbours=settings.neighbours)
        if vector is None:  # this site's own input failed its checks: it takes no part in the round
            client.withdraw(reason)
            return {}
        try:
            cost = client.run(vector, Quantizer.for_sites(settings.clip, len(sites), settings.bits))
        except SecureAggregationError as exc:
            if str(exc).startswith("this site was dropped"):
                raise DroppedFromRound(f"{site} {str(exc)[len('this site '):]}") from None
            raise
        if peer_keys.unpinned:
            logger.warning("%s, round %d: the keys of %s were checked against the federation's CA only, which the "
                           "operator holds: pin them in this site's policy (peers:, `fedcontrast site roster`)",
                           site, round_num, ", ".join(sorted(peer_keys.unpinned)))
        return cost


class SecureRounds:
    """What :class:`~.aggregator.SafeAggregator` adds for secure aggregation (a mixin: ``relay`` is
    None without it): protocol messages to the relay, the relay's answers to the sites' fetches, a
    phase's deadline (the plan's ``round_timeout``) closing it without the silent sites when
    ``min_sites`` allows, and the round's end once every site still in it has answered."""

    relay: SecAggRelay | None = None

    if TYPE_CHECKING:  # what the class this mixes into provides (SafeAggregator over OpenFL's Aggregator)
        lock: Any
        round_number: int
        rounds_to_train: int
        round_timeout: float | None
        min_sites: int | None
        authorized_cols: list[str]
        collaborators_done: list[str]
        failure: str | None
        stragglers: list[str]

        def stop_notice(self, collaborator_name: str) -> str | None: ...
        def _fail(self, reason: str) -> None: ...
        def _end_of_round_check(self) -> None: ...
        def drop_silent(self, missing: list[str]) -> None: ...

    def secure_message(self, collaborator: str, round_number: int, task_name: str, named_tensors: Any) -> None:
        """A site's secure-aggregation message of OpenFL's round ``round_number`` (counted from 0; the
        relay and every sentence count from 1)."""
        kind = kind_of(task_name, SECAGG_TASK)
        assert kind is not None  # send_local_task_results sends only secure-aggregation tasks here
        with self.lock:
            notice = self.stop_notice(collaborator)
            if notice is not None:
                raise FederationStopped(notice)
            if self.relay is None or round_number != self.round_number:
                why = "this federation has no secure aggregation" if self.relay is None else \
                    f"round {round_number + 1} is over"
                raise FederationStopped(SECAGG_REFUSED + why)
            if self.relay.round != round_number + 1:  # the aggregator's round, checked above: never a message's own
                self.relay.begin(round_number + 1)
            if collaborator in self.relay.dropped:
                raise FederationStopped(SECAGG_REFUSED + f"{collaborator} was dropped from round {round_number + 1}'s "
                                        f"secure aggregation ({self.relay.dropped[collaborator]})")
            try:
                payload = message_payload(self, collaborator, named_tensors)
                self.relay.receive(collaborator, round_number + 1, kind, payload)
            except SecureAggregationError as exc:
                self._fail(str(exc))
                raise FederationStopped(self.stop_notice(collaborator)) from None

    def get_aggregated_tensor(self, tensor_name, round_number, report, tags, require_lossless, requested_by):
        kind = kind_of(tensor_name, SECAGG_TENSOR)
        if kind is None:
            return super().get_aggregated_tensor(  # type: ignore[misc]  # OpenFL's Aggregator, next in the MRO
                tensor_name, round_number, report, tags, require_lossless,
                                                 requested_by)
        notice = self.stop_notice(requested_by)
        if notice is not None:
            raise FederationStopped(notice)
        payload = self.relay.answer(requested_by, round_number + 1, kind) if self.relay is not None else None
        return answer_tensor(self, payload, tensor_name, round_number)

    def secure_deadline(self) -> bool:
        """Called by the watchdog (its lock held) when the round passed ``round_timeout``: True when a
        secure-aggregation phase was open and has been closed (its silent sites dropped, the next phase
        given a full ``round_timeout``) or the federation stopped; False to go on as without it."""
        relay = self.relay
        if relay is None or self.round_number >= self.rounds_to_train - 1:  # none, or the evaluation round
            return False
        if relay.round != self.round_number + 1:  # no site has reached the protocol in this round
            relay.begin(self.round_number + 1)
        if not relay.open:
            return False
        phase = PHASES[relay.phase]
        try:
            dropped = relay.close(self.min_sites or len(self.authorized_cols))
        except SecureAggregationError as exc:
            self.absent = set(relay.members[relay.phase]) - set(relay.received[relay.phase]) - set(relay.dropped)
            self._fail(f"{exc} (the plan's round_timeout is {self.round_timeout:.0f} s)")
            return True
        logger.warning("round %d: no %s message from %s within %.0f s; the secure sum goes on without them "
                       "(min_sites %s)", self.round_number + 1, phase, ", ".join(dropped), self.round_timeout,
                       self.min_sites)
        self.absent |= set(dropped)
        self.drop_silent(dropped)  # the later rounds do not wait for them (openfl/attendance.py)
        self.round_started = time.monotonic()
        self.end_secure_round()
        return True

    def end_secure_round(self) -> None:
        """End the round once every site the relay kept has sent its results (those it dropped never will)."""
        relay = self.relay
        if relay is None or relay.round != self.round_number + 1 or not relay.dropped \
                or self.failure is not None:
            return
        live = [c for c in self.authorized_cols if c not in relay.dropped]
        if all(c in self.collaborators_done for c in live):
            self.stragglers = [c for c in self.authorized_cols if c in relay.dropped]
            self._end_of_round_check()
