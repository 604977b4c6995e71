"""Secure aggregation between parties that only exchange messages (privacy/secagg_protocol.py).

Two harnesses: every site in a thread as an engine carries them (dropouts at each phase), and a
step-by-step lab whose relay a test can make lie — the attacks an operator could try through the
protocol's own messages: a peer set below the threshold, different survivor sets for different
sites, swapped or unpinned keys, adverts and consistency signatures replayed from another round or
run, a garbage share, a malformed answer. Each ends in a refusal naming the cause, and the relay
is shown to hold nothing that rebuilds the target's vector."""

from __future__ import annotations

import base64
import json
import threading
import time

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from scipy import stats

from fedcontrast.privacy.secagg import Quantizer, SecureAggregationError, fingerprint
from fedcontrast.privacy.secagg_protocol import (
    PHASES,
    PinnedKeys,
    SecAggClient,
    SecAggSteps,
    session_digest,
    steps_for,
    withdrawal,
)
from fedcontrast.privacy.secagg_relay import SecAggRelay

PEM = serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
SESSION = session_digest({"algorithm": "fedavg", "rounds": 3}, ["x"], "run-1")


class Stop(Exception):
    """A site that goes silent."""


def make_keys(names):
    keys = {s: ed25519.Ed25519PrivateKey.generate() for s in names}
    return keys, {s: keys[s].public_key().public_bytes(*PEM).decode() for s in names}


def pem_key(site, pem):
    """The engine's own check of a peer's key as a Flower site had it: the key inside the advert."""
    return serialization.load_pem_public_key(pem.encode())


# --- every site in a thread ----------------------------------------------------------------------
def federation(n, *, threshold, words=50, die=None, forge=None, bits=64, seed=0, neighbours="full"):
    """One round with ``n`` sites in threads. ``die``: site → the message kind it never sends (it
    stops there); ``forge``: a site whose advert is signed by another key. Returns (relay, vectors,
    errors by site)."""
    rng = np.random.default_rng(seed)
    names = [f"site_{i}" for i in range(n)]
    keys, pems = make_keys(names)
    pins = {s: fingerprint(keys[s].public_key()) for s in names}
    quantizer = Quantizer.for_sites(10.0, n, bits)
    relay = SecAggRelay(names, threshold, words, quantizer, session=SESSION, neighbours=neighbours)
    vectors = {s: rng.uniform(-10, 10, words) for s in names}
    die = die or {}
    errors: dict[str, str] = {}

    def run(site):
        def send(kind, payload):
            if die.get(site) == kind:
                raise Stop
            relay.receive(site, 0, kind, payload)

        signing = ed25519.Ed25519PrivateKey.generate() if site == forge else keys[site]
        client = SecAggClient(site, names, threshold, 0, signing, pems[site], PinnedKeys(pem_key, pins, True), send,
                              lambda kind: relay.answer(site, 0, kind), poll=0.01, session=SESSION,
                              neighbours=neighbours)
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
    while relay.open and time.monotonic() < deadline:  # the engine's deadline, as soon as every live site sent
        time.sleep(0.05)
        if errors:
            break
        with relay.lock:
            if not relay.open:
                break
            phase = relay.phase
            live = [s for s in relay.members[phase] if s not in errors and not _died_by(die.get(s), PHASES[phase])]
            if all(s in relay.received[phase] for s in live) and len(live) < len(relay.members[phase]):
                relay.close()
    for t in threads:
        t.join(timeout=5)
    return relay, vectors, errors


def _died_by(kind_missed, kind):
    return kind_missed is not None and PHASES.index(kind_missed) <= PHASES.index(kind)


def test_every_site_answers_the_sum_is_exact_within_the_quantisation_bound():
    relay, vectors, errors = federation(3, threshold=2)
    assert not errors
    assert np.abs(relay.total(0) - sum(vectors.values())).max() <= relay.quantizer.error_bound(3)
    assert relay.survivors == ["site_0", "site_1", "site_2"] and not relay.blamed


@pytest.mark.parametrize("n,dying,threshold", [(3, {"site_1": "masked"}, 2),
                                               (10, {"site_3": "masked", "site_7": "masked"}, 7),
                                               (4, {"site_2": "reveal"}, 3),
                                               (4, {"site_1": "consistency"}, 3),
                                               (4, {"site_0": "boxes"}, 3),
                                               (4, {"site_3": "advert"}, 3)])
def test_dropouts_at_each_phase_still_give_the_survivors_sum(n, dying, threshold):
    relay, vectors, errors = federation(n, threshold=threshold, die=dying)
    assert not errors
    # a site that sent its masked vector is in the sum, even if it went silent afterwards (its self mask is rebuilt)
    in_sum = [s for s in vectors if dying.get(s) in (None, "consistency", "reveal")]
    assert relay.survivors == in_sum
    assert np.abs(relay.total(0) - sum(vectors[s] for s in in_sum)).max() <= relay.quantizer.error_bound(n)
    assert set(relay.dropped) == set(dying)


@pytest.mark.parametrize("dying", [{"site_3": "advert"}, {"site_5": "boxes"}, {"site_7": "masked", "site_11": "masked"},
                                   {"site_2": "consistency"}, {"site_9": "reveal"}])
def test_secagg_plus_over_a_polling_transport_sums_exactly_with_a_dropout_at_each_phase(dying):
    """OpenFL's site transport (SecAggClient, each site polling in its own thread) with SecAgg+'s graph
    phase: 16 sites, 6 neighbours each; a site silent at any phase after the graph is drawn is left
    out (or kept, once masked) and the sum is exact."""
    relay, vectors, errors = federation(16, threshold=11, die=dying, neighbours=6)
    assert not errors and not relay.full and set(relay.randomness) >= set(relay.members[3])
    in_sum = [s for s in vectors if dying.get(s) in (None, "consistency", "reveal")]
    assert relay.survivors == in_sum
    assert np.abs(relay.total(0) - sum(vectors[s] for s in in_sum)).max() <= relay.quantizer.error_bound(16)


def test_secagg_plus_over_a_polling_transport_ends_the_round_when_a_site_keeps_its_graph_randomness():
    with pytest.raises(SecureAggregationError, match="site_4 sent its advert but not the randomness"):
        federation(16, threshold=11, die={"site_4": "graph"}, neighbours=6)


def test_fewer_survivors_than_the_threshold_end_the_round_without_a_sum():
    with pytest.raises(SecureAggregationError, match="fewer than the 3 needed"):
        federation(3, threshold=3, die={"site_2": "masked"})


def test_a_forged_advert_is_refused_by_every_peer_naming_the_site():
    relay, _, errors = federation(3, threshold=2, forge="site_1")
    assert relay.sum is None
    assert {"site_0", "site_2"} <= set(errors)
    assert all("site_1" in e for s, e in errors.items() if s != "site_1")


def test_a_dropped_site_that_comes_back_is_told_and_refused():
    lab = Lab(3, threshold=2)
    lab.send_adverts(skip=("site_2",))
    assert lab.relay.answer("site_0", 0, "adverts") is None  # site_2 has not sent yet
    assert lab.relay.close() == ["site_2"]
    assert "dropped" in json.loads(lab.relay.answer("site_2", 0, "adverts"))
    with pytest.raises(SecureAggregationError, match="site site_2 was dropped .*missed the advert phase"):
        lab.relay.receive("site_2", 0, "advert", lab.steps["site_2"].advert())


def test_a_message_of_another_round_is_refused_and_never_restarts_the_round():
    lab = Lab(3, threshold=2)
    lab.send_adverts(skip=("site_2",))
    with pytest.raises(SecureAggregationError, match="message of round 1 during round 0; refused"):
        lab.relay.receive("site_2", 1, "advert", b"{}")
    assert lab.relay.round == 0 and set(lab.relay.received[0]) == {"site_0", "site_1"}  # nothing was reset


@pytest.mark.parametrize("kind,payload,match", [
    ("advert", b"not json", "not JSON"),
    ("advert", json.dumps({"c_pk": "AA==", "s_pk": "AA==", "signature": "", "certificate": ""}).encode(),
     "does not carry exactly its keys, commitment"),
    ("advert", json.dumps({"s_pk": "A" * 43 + "=", "commit": "A" * 43 + "=", "signature": "AA==",
                           "certificate": "pem"}).encode(), "does not carry exactly"),  # no c_pk
    ("boxes", b"{}", "sent a secure-aggregation boxes message .* where advert was expected"),
])
def test_malformed_messages_are_refused_naming_the_sender(kind, payload, match):
    relay = SecAggRelay(["a", "b"], 2, 4, Quantizer.for_sites(10.0, 2, 32))
    with pytest.raises(SecureAggregationError, match=match) as info:
        relay.receive("a", 0, kind, payload)
    assert "site a" in str(info.value) or "a's" in str(info.value)


def test_a_masked_vector_of_the_wrong_length_is_refused():
    relay = SecAggRelay(["a", "b"], 2, 4, Quantizer.for_sites(10.0, 2, 32))
    relay.phase = PHASES.index("masked")
    relay.members = [["a", "b"]] * (relay.phase + 1)
    with pytest.raises(SecureAggregationError, match="masked vector has 12 bytes where round 0 declares 16"):
        relay.receive("a", 0, "masked", b"\0" * 12)


def test_a_site_that_withdraws_is_dropped_at_once_and_its_reason_named():
    lab = Lab(4, threshold=3)
    lab.relay.receive("site_3", 0, "advert", withdrawal("its upload has non-finite values (fc.weight)"))
    lab.send_adverts(skip=("site_3",))
    assert lab.relay.phase == PHASES.index("boxes")  # no deadline waited for (the full graph: no graph phase)
    assert lab.relay.dropped["site_3"] == "it withdrew: its upload has non-finite values (fc.weight)"
    lab.finish()
    assert lab.relay.survivors == ["site_0", "site_1", "site_2"]
    assert np.abs(lab.relay.total(0) - sum(lab.vectors[s] for s in lab.relay.survivors)).max() <= 1e-6


# --- a relay that lies -----------------------------------------------------------------------------
class Lab:
    """One round, step by step: ``steps`` (each site's :class:`SecAggSteps`), an honest ``relay``, and
    ``answer(site, kind)`` that a test may replace to make the relay lie. Each site pins its peers'
    keys unless ``pins`` is given (site → its pins)."""

    def __init__(self, n, *, threshold, words=64, round_num=0, session=SESSION, keys=None, required=True, seed=0,
                 bits=64):
        self.names = [f"site_{i}" for i in range(n)]
        self.keys, self.pems = keys or make_keys(self.names)
        self.pins = {s: fingerprint(self.keys[s].public_key()) for s in self.names}
        self.quantizer = Quantizer.for_sites(10.0, n, bits)
        self.relay = SecAggRelay(self.names, threshold, words, self.quantizer, session=session)
        self.relay.begin(round_num)
        self.round, self.threshold = round_num, threshold
        rng = np.random.default_rng(seed)
        self.vectors = {s: rng.uniform(-10, 10, words) for s in self.names}
        self.checkers = {s: PinnedKeys(pem_key, {p: f for p, f in self.pins.items() if p != s}, required)
                         for s in self.names}
        self.steps = {s: SecAggSteps(s, self.names, threshold, round_num, self.keys[s], self.pems[s], self.checkers[s],
                                     self.vectors[s], self.quantizer, session) for s in self.names}
        self.errors: dict[str, str] = {}
        self.payloads: dict[str, bytes] = {}

    def answer(self, site, kind):
        return self.relay.answer(site, self.round, kind)

    def send_adverts(self, skip=()):
        for s in self.names:
            if s not in skip:
                self.payloads[s] = self.steps[s].advert()
                self.relay.receive(s, self.round, "advert", self.payloads[s])

    def step(self, kind, answer, step, sites=None):
        """Each live site fetches ``answer``, takes ``step`` and sends its next message (kind of ``step``)."""
        for s in sites or self.names:
            if s in self.errors or s in self.relay.dropped:
                continue
            try:
                payload = getattr(self.steps[s], step)(self.answer(s, answer))
            except SecureAggregationError as exc:
                self.errors[s] = str(exc)
                continue
            self.payloads[s] = payload
            if self.relay.open and PHASES[self.relay.phase] == step:
                self.relay.receive(s, self.round, step, payload)

    def finish(self, until="reveal"):
        for kind, answer, step in steps_for(self.relay.full):
            if self.relay.phase != PHASES.index(step):
                self.close()
            self.step(kind, answer, step)
            if step == until:
                break
        self.close()

    def close(self):
        if self.relay.open and self.relay.received[self.relay.phase]:
            try:
                self.relay.close()
            except SecureAggregationError as exc:
                self.errors["relay"] = str(exc)


def held_shares(lab, target):
    """The shares of ``target``'s self-mask seed and of its key the relay got from the honest sites."""
    b = s = 0
    for reveal in lab.relay.received[5].values():
        kind = reveal.get(target, (None,))[0]
        b, s = b + (kind == "b"), s + (kind == "s")
    return b, s


def assert_uniform(words, bits=64):
    """What the relay holds of the target: indistinguishable from uniform words of the ring."""
    assert stats.kstest(words.astype(np.float64) / 2.0**bits, "uniform").pvalue > 1e-3


def test_the_honest_lab_round_gives_the_exact_sum():
    lab = Lab(5, threshold=3)
    lab.send_adverts()
    lab.finish()
    assert not lab.errors
    assert np.abs(lab.relay.total(0) - sum(lab.vectors.values())).max() <= lab.quantizer.error_bound(5)


@pytest.mark.parametrize("n,t", [(5, 3), (10, 6)])
def test_a_peer_set_below_the_threshold_is_refused_by_the_target(n, t):
    """The attack that recovered any chosen site exactly before: the relay tells the target that it
    alone shared keys, so it would mask with its self mask only, then has everyone reveal that mask."""
    lab = Lab(n, threshold=t, words=4096)
    target = "site_2"
    honest = lab.answer

    def lying(site, kind):
        if site == target and kind == "boxes":
            return json.dumps({"peers": [target], "boxes": {}, "deals": {}}).encode()
        return honest(site, kind)

    lab.answer = lying
    lab.send_adverts()
    lab.step("advert", "adverts", "boxes")
    lab.step("boxes", "boxes", "masked")
    assert "has 1 sites, fewer than the threshold" in lab.errors[target]
    assert target not in lab.relay.received[3]  # the target never masked: nothing of its vector left the site


@pytest.mark.parametrize("n,t", [(5, 3), (7, 4)])
def test_different_survivor_sets_for_different_sites_never_reveal_both_masks_of_a_site(n, t):
    """The relay splits the sites: some are told the target survived (they would reveal its self-mask
    seed), the others that it dropped (they would reveal its key); each set is self-consistent and at
    least the threshold. Only a set that gathers t signatures is revealed for, so the relay gets at
    most one of the target's two secrets, and the target's vector stays masked."""
    from fedcontrast.privacy.secagg import _combine, prg

    lab = Lab(n, threshold=t, words=4096)
    target, names = "site_0", lab.names
    others = [s for s in names if s != target]
    group_b = others[t - 1:]  # the other t - 1 and the target: t signers; group_b: fewer
    honest = lab.answer

    def lying(site, kind):
        if kind == "survivors":
            return json.dumps({"survivors": others if site in group_b else names}).encode()
        if kind == "signatures":  # every signature it got, whatever set each covers
            return json.dumps({"signatures": lab.relay.received[4]}).encode()
        return honest(site, kind)

    lab.answer = lying
    lab.send_adverts()
    lab.finish()
    assert set(group_b) <= set(lab.errors)
    assert all("signed that same set, fewer than the threshold" in lab.errors[s] for s in group_b)
    b_shares, s_shares = held_shares(lab, target)
    assert s_shares == 0 and b_shares == t  # its key stays secret: the pairwise masks stay on
    shares = [(i, share) for r in lab.relay.received[5].values() for tgt, (k, i, share, *_) in r.items()
              if tgt == target and k == "b"]
    words = lab.relay.received[3][target] - prg(_combine(shares), 4096, np.uint64)  # the best the relay can do
    assert_uniform(words)


def test_a_survivor_set_the_site_did_not_share_keys_with_is_refused():
    lab = Lab(5, threshold=3)
    honest = lab.answer
    lab.answer = lambda site, kind: (json.dumps({"survivors": ["site_0", "site_1", "intruder"]}).encode()
                                     if kind == "survivors" else honest(site, kind))
    lab.send_adverts()
    lab.finish()
    assert all("names intruder, outside the sites of the phase before" in lab.errors[s] for s in lab.names)


def test_a_key_swapped_by_the_relay_is_refused_by_a_site_that_pinned_its_peers():
    """The relay replaces site_1's advert with keys and a key of its own, self-consistently signed:
    a check against the key inside the advert passes; the roster pinned at each site does not."""
    lab = Lab(4, threshold=3)
    lab.send_adverts()
    impostor = ed25519.Ed25519PrivateKey.generate()
    fake = SecAggSteps("site_1", lab.names, 3, 0, impostor, impostor.public_key().public_bytes(*PEM).decode(),
                       pem_key, np.zeros(64), lab.quantizer, SESSION)
    answer = json.loads(lab.relay.answer("site_0", 0, "adverts"))
    answer["adverts"]["site_1"] = json.loads(fake.advert())
    lab.answer = lambda site, kind: json.dumps(answer).encode() if kind == "adverts" else None
    lab.step("advert", "adverts", "boxes", sites=["site_0", "site_2", "site_3"])
    for site in ("site_0", "site_2", "site_3"):
        assert "site site_1's key SHA256:" in lab.errors[site] and "is not the key pinned for it" in lab.errors[site]
        assert site not in lab.relay.received[2]  # no share left the site


def test_an_unpinned_peer_is_refused_when_the_policy_requires_secure_aggregation():
    lab = Lab(3, threshold=2)
    lab.checkers["site_0"].pins.pop("site_2")
    lab.send_adverts()
    lab.step("advert", "adverts", "boxes")
    assert "site site_2's key (SHA256:" in lab.errors["site_0"] and "is not pinned" in lab.errors["site_0"]
    lab2 = Lab(3, threshold=2, required=False)
    lab2.checkers["site_0"].pins.pop("site_2")
    lab2.send_adverts()
    lab2.finish()
    assert not lab2.errors and lab2.checkers["site_0"].unpinned == {"site_2"}


@pytest.mark.parametrize("replayed_from", ["another round", "another run"])
def test_an_advert_replayed_from_another_round_or_run_is_refused(replayed_from):
    keys = make_keys([f"site_{i}" for i in range(3)])
    another_round = replayed_from == "another round"
    old = Lab(3, threshold=2, keys=keys, round_num=0 if another_round else 4,
              session=SESSION if another_round else session_digest({"algorithm": "fedavg"}, [], "run-0"))
    old.send_adverts()
    stale = json.loads(old.relay.answer("site_0", old.round, "adverts"))["adverts"]["site_1"]  # genuine, signed
    lab = Lab(3, threshold=2, keys=keys, round_num=4)
    lab.send_adverts()
    answer = json.loads(lab.relay.answer("site_0", 4, "adverts"))
    answer["adverts"]["site_1"] = stale
    lab.answer = lambda site, kind: json.dumps(answer).encode()
    lab.step("advert", "adverts", "boxes", sites=["site_0"])
    assert ("site site_1's key-agreement keys for round 4 do not carry its signature over this session"
            in lab.errors["site_0"])


def test_consistency_signatures_replayed_from_another_round_are_not_counted():
    keys = make_keys([f"site_{i}" for i in range(4)])
    old = Lab(4, threshold=3, keys=keys, round_num=2)
    old.send_adverts()
    old.finish(until="consistency")
    replay = dict(old.relay.received[4])  # round 3's genuine signatures over the same four sites
    lab = Lab(4, threshold=3, keys=keys, round_num=3)
    honest = lab.answer
    lab.answer = lambda site, kind: (json.dumps({"signatures": replay}).encode() if kind == "signatures"
                                     else honest(site, kind))
    lab.send_adverts()
    lab.finish()
    assert all("signed that same set" in lab.errors[s] and "no valid signature from" in lab.errors[s]
               for s in lab.names)
    assert lab.relay.received[5] == {}  # nothing revealed


def test_a_garbage_share_is_found_its_sender_named_and_the_sum_still_exact():
    lab = Lab(5, threshold=3)
    lab.send_adverts()
    lab.finish(until="consistency")
    lab.close()
    honest_reveal = lab.steps["site_4"].reveal

    def garbage(answer):
        reveal = json.loads(honest_reveal(answer))
        reveal["site_0"][2] = base64.b64encode(bytes(34)).decode()  # zeros in place of its share
        return json.dumps(reveal).encode()

    lab.steps["site_4"].reveal = garbage
    lab.step("consistency", "signatures", "reveal")
    lab.close()
    assert "site_4" in lab.relay.blamed and "site_0's self-mask seed" in lab.relay.blamed["site_4"]
    assert np.abs(lab.relay.total(0) - sum(lab.vectors.values())).max() <= lab.quantizer.error_bound(5)


def test_a_garbage_share_among_exactly_threshold_shares_ends_the_round_without_a_wrong_sum():
    lab = Lab(3, threshold=2)
    lab.send_adverts()
    lab.finish(until="consistency")
    honest_reveal = lab.steps["site_2"].reveal

    def garbage(answer):
        reveal = json.loads(honest_reveal(answer))
        reveal["site_0"][2] = base64.b64encode(bytes(34)).decode()
        return json.dumps(reveal).encode()

    lab.steps["site_2"].reveal = garbage
    lab.step("consistency", "signatures", "reveal", sites=["site_2", "site_1"])
    with pytest.raises(SecureAggregationError, match="only 1 good shares of site site_0's self-mask seed arrived, "
                                                     "fewer than the threshold 2.*left out: site_2's is not the one "
                                                     "site_0 dealt it"):
        lab.relay.close()
    assert lab.relay.sum is None and "site_2" in lab.relay.blamed


def test_a_malformed_answer_of_the_relay_is_one_sentence_at_the_site_not_a_key_error():
    lab = Lab(3, threshold=2)
    lab.send_adverts()
    answer = json.loads(lab.relay.answer("site_0", 0, "adverts"))
    del answer["adverts"]["site_1"]["c_pk"]
    lab.answer = lambda site, kind: json.dumps(answer).encode()
    lab.step("advert", "adverts", "boxes", sites=["site_0"])
    assert "site site_1's advert does not carry exactly its keys" in lab.errors["site_0"]
    for bad in (b"[]", b"null", b"\xff"):
        lab.answer = lambda site, kind, bad=bad: bad
        with pytest.raises(SecureAggregationError):
            Lab(3, threshold=2).steps["site_0"].boxes(bad)


def test_the_relay_cannot_alter_the_sites_own_advert():
    lab = Lab(3, threshold=2)
    lab.send_adverts()
    answer = json.loads(lab.relay.answer("site_0", 0, "adverts"))
    answer["adverts"]["site_0"]["certificate"] = "another"
    lab.answer = lambda site, kind: json.dumps(answer).encode()
    lab.step("advert", "adverts", "boxes", sites=["site_0"])
    assert "carry keys for this site (site_0) other than the ones it sent" in lab.errors["site_0"]


@pytest.mark.parametrize("n,t", [(4, 2), (10, 2), (10, 5)])
def test_a_threshold_below_a_majority_is_refused_by_the_site_itself(n, t):
    keys, pems = make_keys(["a"])
    with pytest.raises(SecureAggregationError, match=f"threshold {t} of {n} sites is outside"):
        SecAggSteps("a", ["a"] + [f"s{i}" for i in range(n - 1)], t, 0, keys["a"], pems["a"], pem_key, np.zeros(4),
                    Quantizer.for_sites(10.0, n), SESSION)


def test_what_the_relay_holds_of_one_site_is_uniform_noise():
    """Everything the aggregator keeps of site_0 (its masked vector) for two very different inputs: both
    pass a uniformity test over the ring, so neither tells which input it was."""
    seen = []
    for seed in (0, 1):
        relay, _, _ = federation(3, threshold=2, words=4000, bits=32, seed=seed)
        seen.append(relay.received[3]["site_0"].astype(np.float64) / 2.0**32)
    for words in seen:
        assert stats.kstest(words, "uniform").pvalue > 1e-3
    assert stats.ks_2samp(seen[0], seen[1]).pvalue > 1e-3


# --- shares that blame their dealer; any t good shares rebuild a secret ---------------------------------
def _lying_dealer(lab, dealer, victims, *, signed=True):
    """``dealer`` deals ``victims`` a wrong share of its self-mask seed: inside the tree it signs
    (``signed``: the holder's check passes, so only the revealed share shows it) or only in the box."""
    import fedcontrast.privacy.secagg as secagg

    honest_split, honest_leaf = secagg._split, secagg.leaf
    positions = [lab.names.index(v) for v in victims]

    def split(secret, t, n):
        shares = honest_split(secret, t, n)
        if secret == lab.steps[dealer].site.secrets[0]:
            for k in positions:
                index, share = shares[k]
                shares[k] = (index, bytes([share[0] ^ 1]) + share[1:])
        return shares

    def leaf(holder, index, b_hash, s_hash):
        if holder in victims:  # the tree signs the honest share; the box carries the wrong one
            b_hash = bytes(32)
        return honest_leaf(holder, index, b_hash, s_hash)

    def boxes(answer):
        secagg._split = split
        if not signed:
            secagg.leaf = leaf
        try:
            return honest_boxes(answer)
        finally:
            secagg._split, secagg.leaf = honest_split, honest_leaf

    honest_boxes = lab.steps[dealer].boxes
    lab.steps[dealer].boxes = boxes


def _garbage_holder(lab, holder, target):
    honest_reveal = lab.steps[holder].reveal

    def reveal(answer):
        message = json.loads(honest_reveal(answer))
        share = bytearray(base64.b64decode(message[target][2]))
        share[-1] ^= 1
        message[target][2] = base64.b64encode(bytes(share)).decode()
        return json.dumps(message).encode()

    lab.steps[holder].reveal = reveal


def _exact(lab):
    error = np.abs(lab.relay.total(lab.round) - sum(lab.vectors.values())).max()
    assert error <= lab.quantizer.error_bound(len(lab.names))


def test_a_dealer_that_deals_an_honest_holder_a_bad_share_is_blamed_never_the_holder():
    """Before, the holder who revealed the bad share was named and its round record said rejected."""
    lab = Lab(5, threshold=3)
    _lying_dealer(lab, "site_0", ["site_3"])
    lab.send_adverts()
    lab.finish()
    assert "site_3" not in lab.relay.blamed and not lab.errors
    assert "site_0" in lab.relay.blamed and "site_3" in lab.relay.blamed["site_0"]
    _exact(lab)  # site_0's seed rebuilt from the good shares


def test_a_dealer_whose_box_is_not_what_it_signed_is_refused_by_the_holder_who_says_so_and_is_not_blamed():
    lab = Lab(5, threshold=3)
    _lying_dealer(lab, "site_0", ["site_3"], signed=False)
    lab.send_adverts()
    lab.finish()
    assert "site_0" in lab.steps["site_3"].site.refused and "site_3" not in lab.relay.blamed
    assert "not the ones site_0 signed" in lab.relay.withheld["site_3"]
    _exact(lab)


def test_a_holder_that_alters_a_share_is_blamed_and_the_sum_still_exact():
    lab = Lab(5, threshold=3)
    _garbage_holder(lab, "site_4", "site_1")
    lab.send_adverts()
    lab.finish()
    assert list(lab.relay.blamed) == ["site_4"] and "site_1's self-mask seed" in lab.relay.blamed["site_4"]
    _exact(lab)


def test_any_t_good_shares_rebuild_two_garbage_shares_at_ten_sites_no_longer_end_the_round():
    """10 sites, t = 7: two holders send garbage for one target (8 good shares). Before, only windows
    of consecutive shares were tried and the round ended saying no 7 of them rebuild the seed."""
    lab = Lab(10, threshold=7)
    _garbage_holder(lab, "site_2", "site_5")
    _garbage_holder(lab, "site_8", "site_5")
    lab.send_adverts()
    lab.finish()
    assert sorted(lab.relay.blamed) == ["site_2", "site_8"]
    _exact(lab)


def test_a_dealer_that_signed_two_bad_shares_among_ten_is_named_and_its_seed_rebuilt_from_eight():
    lab = Lab(10, threshold=7)
    _lying_dealer(lab, "site_5", ["site_1", "site_9"])
    lab.send_adverts()
    lab.finish()
    assert list(lab.relay.blamed) == ["site_5"] and "site_1, site_9" in lab.relay.blamed["site_5"]
    _exact(lab)


def test_fewer_than_t_good_shares_end_the_round_with_a_true_sentence_naming_the_dealer():
    lab = Lab(5, threshold=4)
    _lying_dealer(lab, "site_0", ["site_1", "site_2"])  # 3 good shares of 5, t = 4
    lab.send_adverts()
    with pytest.raises(SecureAggregationError, match="site site_0 signed 5 shares of its self-mask seed .* no 4 of "
                                                     "them rebuild what it committed to: it dealt bad shares"):
        lab.finish()
    assert lab.relay.sum is None


def test_a_deal_without_its_dealers_signature_is_refused_at_the_relay_naming_the_dealer():
    lab = Lab(3, threshold=2)
    lab.send_adverts()
    lab.close()
    payload = json.loads(lab.steps["site_1"].boxes(lab.answer("site_1", "adverts")))
    payload["deal"][0] = base64.b64encode(bytes(32)).decode()  # another root under its signature
    with pytest.raises(SecureAggregationError, match="site site_1's deal does not carry its signature"):
        lab.relay.receive("site_1", 0, "boxes", json.dumps(payload).encode())
