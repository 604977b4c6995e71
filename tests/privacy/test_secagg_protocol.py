"""Secure aggregation between parties that only exchange messages (privacy/secagg_protocol.py): the
relay and every site in threads, as an engine carries them; dropouts at each phase, forged keys,
malformed messages."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from fedcontrast.privacy.secagg import Quantizer, SecureAggregationError
from fedcontrast.privacy.secagg_protocol import SecAggClient, SecAggRelay

PEM = serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo


class Stop(Exception):
    """A site that goes silent."""


def federation(n, *, threshold, words=50, die=None, forge=None, bits=64, seed=0):
    """Runs one round with ``n`` sites in threads. ``die``: site → the message kind it never sends
    (it stops there); ``forge``: a site whose advert is signed by another key. Returns (relay, vectors,
    errors by site)."""
    rng = np.random.default_rng(seed)
    names = [f"site_{i}" for i in range(n)]
    keys = {s: ed25519.Ed25519PrivateKey.generate() for s in names}
    pems = {s: keys[s].public_key().public_bytes(*PEM).decode() for s in names}
    quantizer = Quantizer.for_sites(10.0, n, bits)
    relay = SecAggRelay(names, threshold, words, quantizer)
    vectors = {s: rng.uniform(-10, 10, words) for s in names}
    die = die or {}
    errors: dict[str, str] = {}

    def peer_key(site, pem):
        if pem != pems.get(site):
            raise SecureAggregationError(f"{site}'s certificate is not the one the CA signed for {site}")
        return serialization.load_pem_public_key(pem.encode())

    def run(site):
        def send(kind, payload):
            if die.get(site) == kind:
                raise Stop
            relay.receive(site, 0, kind, payload)

        signing = ed25519.Ed25519PrivateKey.generate() if site == forge else keys[site]
        client = SecAggClient(site, names, threshold, 0, signing, pems[site], peer_key, send,
                              lambda kind: relay.answer(site, 0, kind), poll=0.01)
        try:
            client.run(vectors[site], quantizer)
        except Stop:
            pass
        except SecureAggregationError as exc:
            errors[site] = str(exc)

    threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in names]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while relay.open and time.monotonic() < deadline:  # the engine's round deadline, as soon as every live site sent
        time.sleep(0.05)
        if errors:
            break
        with relay.lock:
            if not relay.open:
                break
            phase = relay.phase
            kind = ("advert", "boxes", "masked", "reveal")[phase]
            live = [s for s in relay.members[phase] if die.get(s) != kind and s not in errors
                    and not _died_before(die.get(s), kind)]
            if all(s in relay.received[phase] for s in live) and len(live) < len(relay.members[phase]):
                relay.close()
    for t in threads:
        t.join(timeout=5)
    return relay, vectors, errors


def _died_before(kind_missed, kind):
    order = ("advert", "boxes", "masked", "reveal")
    return kind_missed is not None and order.index(kind_missed) < order.index(kind)


def test_every_site_answers_the_sum_is_exact_within_the_quantisation_bound():
    relay, vectors, errors = federation(3, threshold=2)
    assert not errors
    expected = sum(vectors.values())
    bound = relay.quantizer.error_bound(3)
    assert np.abs(relay.total(0) - expected).max() <= bound
    assert relay.survivors == ["site_0", "site_1", "site_2"]


@pytest.mark.parametrize("n,dying,threshold", [(3, {"site_1": "masked"}, 2),
                                               (10, {"site_3": "masked", "site_7": "masked"}, 6),
                                               (4, {"site_2": "reveal"}, 3),
                                               (4, {"site_0": "boxes"}, 3),
                                               (4, {"site_3": "advert"}, 3)])
def test_dropouts_at_each_phase_still_give_the_survivors_sum(n, dying, threshold):
    relay, vectors, errors = federation(n, threshold=threshold, die=dying)
    assert not errors
    # a site that sent its masked vector is in the sum, even if it went silent afterwards (its self mask is rebuilt)
    in_sum = [s for s in vectors if dying.get(s) in (None, "reveal")]
    assert relay.survivors == in_sum
    assert np.abs(relay.total(0) - sum(vectors[s] for s in in_sum)).max() <= relay.quantizer.error_bound(n)
    assert set(relay.dropped) == set(dying)


def test_fewer_survivors_than_the_threshold_end_the_round_without_a_sum():
    with pytest.raises(SecureAggregationError, match="fewer than the 3 needed"):
        federation(3, threshold=3, die={"site_2": "masked"})


def test_a_forged_advert_is_refused_by_every_peer_naming_the_site():
    relay, _, errors = federation(3, threshold=2, forge="site_1")
    assert relay.sum is None
    assert {"site_0", "site_2"} <= set(errors)
    assert all("site_1" in e and "signature" in e for s, e in errors.items() if s != "site_1")


def test_a_dropped_site_that_comes_back_is_told_and_refused():
    names = ["a", "b", "c"]
    relay = SecAggRelay(names, 2, 4, Quantizer.for_sites(10.0, 3, 32))
    advert = {"c_pk": "A" * 43 + "=", "s_pk": "A" * 43 + "=", "signature": "AA==", "certificate": "pem"}
    relay.receive("a", 0, "advert", json.dumps(advert).encode())
    relay.receive("b", 0, "advert", json.dumps(advert).encode())
    assert relay.answer("a", 0, "adverts") is None  # c has not sent yet
    assert relay.close() == ["c"]
    assert "dropped" in json.loads(relay.answer("c", 0, "adverts"))
    with pytest.raises(SecureAggregationError, match="site c was dropped"):
        relay.receive("c", 0, "advert", json.dumps(advert).encode())


@pytest.mark.parametrize("kind,payload,match", [
    ("advert", b"not json", "not JSON"),
    ("advert", json.dumps({"c_pk": "AA==", "s_pk": "AA==", "signature": "", "certificate": ""}).encode(), "malformed"),
    ("boxes", b"{}", "sent a secure-aggregation boxes message .* where advert was expected"),
])
def test_malformed_messages_are_refused_naming_the_sender(kind, payload, match):
    relay = SecAggRelay(["a", "b"], 2, 4, Quantizer.for_sites(10.0, 2, 32))
    with pytest.raises(SecureAggregationError, match=match):
        relay.receive("a", 0, kind, payload)


def test_a_masked_vector_of_the_wrong_length_is_refused():
    relay = SecAggRelay(["a", "b"], 2, 4, Quantizer.for_sites(10.0, 2, 32))
    relay.phase = 2
    relay.members = [["a", "b"]] * 3
    with pytest.raises(SecureAggregationError, match="masked vector has 12 bytes where round 1 declares 16"):
        relay.receive("a", 0, "masked", b"\0" * 12)


def test_what_the_relay_holds_of_one_site_is_uniform_noise():
    """Everything the aggregator keeps of site_0 (its masked vector) for two very different inputs: both
    pass a uniformity test over the ring, so neither tells which input it was."""
    from scipy import stats

    seen = []
    for seed in (0, 1):
        relay, _, _ = federation(3, threshold=2, words=4000, bits=32, seed=seed)
        seen.append(relay.received[2]["site_0"].astype(np.float64) / 2.0**32)
    for words in seen:
        assert stats.kstest(words, "uniform").pvalue > 1e-3
    assert stats.ks_2samp(seen[0], seen[1]).pvalue > 1e-3
