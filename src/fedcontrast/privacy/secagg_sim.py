"""Secure aggregation with every party in this process (the simulator): the deployments' own relay
and site steps (:mod:`.secagg_protocol`), their messages passed in memory, and what one round cost."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .secagg import Quantizer, SecureAggregationError
from .secagg_protocol import PHASES, SecAggSteps, steps_for
from .secagg_relay import SecAggRelay
from .secagg_terms import SumLayout, flatten_terms, site_terms, term_scale


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
    neighbours: int = 0  # k: each site's neighbours (sites − 1: the full graph)


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

    neighbours = getattr(settings, "neighbours", "full")
    relay = SecAggRelay(names, t, next(iter(vectors.values())).size, quantizer, neighbours=neighbours,
                        session=session)
    relay.begin(round_num)
    steps = {n: SecAggSteps(n, names, t, round_num, private[n], pem[n], peer_key, vectors[n], quantizer, session,
                            neighbours) for n in names}
    cpu, sent = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)

    def at(site: str, call: Callable[[], bytes]) -> bytes:
        began = time.process_time()
        try:
            return call()
        finally:
            cpu[site] += time.process_time() - began

    payloads = {n: at(n, steps[n].advert) for n in names}
    for kind, answer, step in (*steps_for(relay.full), ("reveal", None, None)):
        for n, payload in payloads.items():
            if kind == "masked" and n in dropped:
                continue
            relay.receive(n, round_num, kind, payload)
            sent[n] += len(payload)
        if relay.open and PHASES.index(kind) == relay.phase:
            relay.close()
        if step is not None and answer is not None:  # set in every phase but the last (reveal)
            def reply(n: str, step: str = step, answer: str = answer) -> bytes:
                return getattr(steps[n], step)(relay.answer(n, round_num, answer))

            payloads = {n: at(n, functools.partial(reply, n)) for n in payloads if n not in relay.dropped}
    total = relay.total(round_num)
    plain = next(iter(vectors.values())).size * 4
    return total, SecureRound(len(names), t, float(sent[names[0]]), float(plain), sum(cpu.values()) / len(names),
                              relay.unmask_cpu_s, relay.drawn.k)


def secure_terms_sum(algorithm: Any, uploads: dict[str, dict[str, Any]], weights: dict[str, float], settings: Any,
                     round_num: int, layout: SumLayout, *, dropped: tuple[str, ...] = (),
                     session: bytes = b"") -> tuple[np.ndarray, SecureRound]:
    """The secure sum of the sites' :meth:`~fedcontrast.algorithms.Algorithm.secure_terms`
    (:func:`~.secagg_terms.site_terms`, laid out as ``layout`` says), every party in this process:
    (the sum, :class:`SecureRound`)."""
    names = sorted(uploads)
    vectors = {n: flatten_terms(site_terms(algorithm, uploads[n], weights[n], settings), layout.scale) for n in names}
    total, cost = secure_sum(vectors, settings, round_num, dropped=dropped, session=session)
    cost.plain_bytes_per_site = float(sum(v.numel() * v.element_size() for v in uploads[names[0]].values()) + 4)
    return total, cost


def secure_aggregate(algorithm: Any, uploads: dict[str, dict[str, Any]], weights: dict[str, float], settings: Any,
                     round_num: int, server: Any, *, dropped: tuple[str, ...] = (), session: bytes = b""):
    """A plugin's downlink from the secure sum of its sites' terms, every party in this process:
    (downlink, :class:`SecureRound`)."""
    names = sorted(uploads)
    terms = site_terms(algorithm, uploads[names[0]], weights[names[0]], settings)
    layout = SumLayout({k: tuple(v.shape) for k, v in terms.items()},
                       {k: v.dtype for k, v in uploads[names[0]].items()}, term_scale(algorithm, settings), settings)
    total, cost = secure_terms_sum(algorithm, uploads, weights, settings, round_num, layout, dropped=dropped,
                                   session=session)
    return layout.downlink(algorithm, total, server, survivors=len(names) - len(set(dropped) & set(names)),
                           round_num=round_num), cost
