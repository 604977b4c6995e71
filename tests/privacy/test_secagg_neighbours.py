"""SecAgg+ (privacy/secagg_graph.py): each site masks with and shares among its neighbours on a random
ring graph that every party derives from the session and the round. The sum is checked against the
plain sum of the clipped vectors (an independent reference) with dropouts at each phase; the graph is
shown to be the same at every party and different for another round or session; a relay that names
a site outside a site's neighbourhood is refused; and a pairwise mask left out is shown to break the
sum (the masks cancel only with the right neighbours)."""

from __future__ import annotations

import base64
import json
from collections import Counter

import numpy as np
import pytest

from fedcontrast.config.sections import SecureAggregationConfig, default_threshold
from fedcontrast.errors import FedContrastError
from fedcontrast.privacy.secagg import Quantizer, SecureAggregationError
from fedcontrast.privacy.secagg_graph import graph_for, neighbourhood_size, neighbourhood_threshold, ring
from fedcontrast.privacy.secagg_protocol import PHASES, PinnedKeys, SecAggSteps, session_digest, steps_for
from fedcontrast.privacy.secagg_relay import SecAggRelay
from fedcontrast.privacy.secagg_sim import secure_sum

from .test_secagg_protocol import make_keys, pem_key

SESSION = session_digest({"algorithm": "fedavg", "rounds": 3}, ["x"], "run-1")
N, K, CLIP = 16, 6, 10.0  # 2k + 1 = 13 < 16: the neighbourhood graph; t_k = 5 of each site's 7 holders


class Round:
    """One round with ``n`` sites, degree ``k``, every message carried step by step; ``answer`` may
    be replaced to make the relay lie; ``die``: site → the message kind it never sends."""

    def __init__(self, n=N, k=K, *, round_num=0, words=32, seed=0, die=None):
        self.names = [f"site_{i:02d}" for i in range(n)]
        self.keys, self.pems = make_keys(self.names)
        self.threshold, self.round, self.die = default_threshold(n), round_num, die or {}
        self.quantizer = Quantizer.for_sites(CLIP, n, 64)
        self.relay = SecAggRelay(self.names, self.threshold, words, self.quantizer, neighbours=k, session=SESSION)
        self.relay.begin(round_num)
        rng = np.random.default_rng(seed)
        self.vectors = {s: rng.uniform(-1.5 * CLIP, 1.5 * CLIP, words) for s in self.names}  # some clipped
        self.steps = {s: SecAggSteps(s, self.names, self.threshold, round_num, self.keys[s], self.pems[s],
                                     PinnedKeys(pem_key), self.vectors[s], self.quantizer, SESSION, k)
                      for s in self.names}
        self.errors: dict[str, str] = {}

    def answer(self, site, kind):
        return self.relay.answer(site, self.round, kind)

    def lie_to(self, target, kind, forge):
        """The relay's ``kind`` answer to ``target`` replaced by ``forge(honest answer)``."""
        honest = self.answer
        self.answer = lambda site, asked: forge(honest(site, asked)) if (site, asked) == (target, kind) \
            else honest(site, asked)

    def run(self):
        payloads = {s: self.steps[s].advert() for s in self.names}
        for kind, answer, step in (*steps_for(self.relay.full), ("reveal", None, None)):
            for s, payload in payloads.items():
                if self.die.get(s) != kind:
                    self.relay.receive(s, self.round, kind, payload)
            if self.relay.open and PHASES[self.relay.phase] == kind:
                self.relay.close()
            if step is None:
                break
            payloads = {}
            for s in self.names:
                if s in self.relay.dropped or s in self.errors or _gone(self.die.get(s), kind):
                    continue
                try:
                    payloads[s] = getattr(self.steps[s], step)(self.answer(s, answer))
                except SecureAggregationError as exc:
                    self.errors[s] = str(exc)
        return self


def _gone(missed, kind):
    return missed is not None and PHASES.index(missed) <= PHASES.index(kind)


def reference(vectors, sites):
    """The plain sum of the clipped vectors of ``sites``."""
    return sum(np.clip(vectors[s], -CLIP, CLIP) for s in sites)


# --- the rule and the graph ----------------------------------------------------------------------------
def test_the_rule_for_k_and_t_k():
    assert neighbourhood_size(50) == 49  # 2·⌈3·log2 50⌉ = 34, 2k + 1 ≥ 50: the full graph
    assert neighbourhood_size(100) == 40 and neighbourhood_size(1000) == 60
    assert neighbourhood_size(100, "full") == 99
    assert neighbourhood_size(30, 10) == 10 and neighbourhood_size(20, 10) == 19
    assert neighbourhood_threshold(40) == 28 and neighbourhood_threshold(6) == 5
    for k in (6, 40, 60):  # two sets of t_k of the k + 1 holders always share a holder
        assert 2 * neighbourhood_threshold(k) > k + 1
    graph = graph_for([f"s{i}" for i in range(50)], 34, "auto", SESSION, 0)
    assert graph.full and graph.threshold == 34  # the full graph keeps the plan's threshold: today's protocol


@pytest.mark.parametrize("value", [5, 2, "some", True, 1.5])
def test_the_setting_is_checked(value):
    with pytest.raises(FedContrastError, match="neighbours"):
        SecureAggregationConfig(neighbours=value)
    assert SecureAggregationConfig(neighbours=6).neighbours == 6


def test_the_graph_is_k_regular_symmetric_and_the_same_at_every_party():
    lab = Round().run()
    graph = lab.relay.graph
    assert not graph.full and graph.k == K
    for s in lab.names:
        assert lab.steps[s].drawn == graph  # each site derived it itself
        assert len(graph.closed(s)) == K + 1 and s in graph.closed(s)
        assert all(s in graph.closed(v) for v in graph.closed(s))


def test_the_graph_differs_for_another_round_or_session():
    names = [f"site_{i}" for i in range(200)]
    base = ring(names, SESSION, 3, 40)
    assert sorted(base) == sorted(names) and base == ring(names, SESSION, 3, 40)
    assert base != ring(names, SESSION, 4, 40)
    assert base != ring(names, session_digest({"algorithm": "fedavg", "rounds": 3}, ["x"], "run-2"), 3, 40)


def test_the_ring_order_is_uniform():
    """Fisher–Yates over the keystream: each of 4 sites is first in about a quarter of 4000 sessions."""
    from scipy import stats

    firsts = Counter(ring(["a", "b", "c", "d"], i.to_bytes(4, "big"), 0, 2)[0] for i in range(4000))
    assert stats.chisquare([firsts[s] for s in "abcd"]).pvalue > 1e-3


# --- the sum ---------------------------------------------------------------------------------------------
def test_every_site_answers_the_sum_is_the_plain_sum_of_the_clipped_vectors():
    lab = Round().run()
    assert not lab.errors and lab.relay.survivors == lab.names
    assert np.abs(lab.relay.total(0) - reference(lab.vectors, lab.names)).max() <= lab.quantizer.error_bound(N)
    for site, reveal in lab.relay.received[5].items():  # each site revealed shares of its neighbourhood only
        assert set(reveal) <= lab.relay.graph.closed(site)
        # 16-byte secrets (17-byte shares): half the Shamir work
        assert all(len(share) == 17 for _, _, share, *_ in reveal.values())


@pytest.mark.parametrize("dying", [{"site_03": "advert"}, {"site_05": "boxes"},
                                   {"site_07": "masked", "site_11": "masked"},
                                   {"site_02": "consistency"}, {"site_09": "reveal"}])
def test_dropouts_at_each_phase_still_give_the_survivors_sum(dying):
    lab = Round(die=dying).run()
    assert not lab.errors
    in_sum = [s for s in lab.names if dying.get(s) in (None, "consistency", "reveal")]
    assert lab.relay.survivors == in_sum
    assert np.abs(lab.relay.total(0) - reference(lab.vectors, in_sum)).max() <= lab.quantizer.error_bound(N)


def test_the_simulator_sums_through_the_neighbourhoods():
    rng = np.random.default_rng(1)
    vectors = {f"s{i:02d}": rng.uniform(-CLIP, CLIP, 20) for i in range(N)}
    settings = SecureAggregationConfig(neighbours=K, clip=CLIP)
    total, cost = secure_sum(vectors, settings, 2, dropped=("s04",), session=SESSION)
    assert cost.neighbours == K
    survivors = [s for s in vectors if s != "s04"]
    quantizer = Quantizer.for_sites(CLIP, N, settings.bits)
    assert np.abs(total - reference(vectors, survivors)).max() <= quantizer.error_bound(N)


def test_a_pairwise_mask_left_out_breaks_the_sum():
    """The masks cancel only with the right neighbours: a site that leaves one neighbour out of its
    pairwise masks leaves that neighbour's mask in the sum, which then decodes to noise."""
    lab = Round()
    site = lab.names[0]
    steps = lab.steps[site]
    mask = steps.site.mask

    def without_one(vector, quantizer, peers=None):
        left_out = sorted(lab.relay.graph.closed(site) - {site})[0]  # drawn by the time a site masks
        return mask(vector, quantizer, [p for p in peers if p != left_out])

    steps.site.mask = without_one
    lab.run()
    assert not lab.errors
    assert np.abs(lab.relay.total(0) - reference(lab.vectors, lab.names)).max() > 1e3


# --- a relay that lies ---------------------------------------------------------------------------------
def test_a_share_request_naming_a_non_neighbour_is_refused_and_nothing_sent():
    lab = Round()
    target = lab.names[0]
    # every site's advert, not its neighbourhood's
    lab.lie_to(target, "adverts", lambda honest: json.dumps({**json.loads(honest),
                                                             "adverts": dict(lab.relay.received[0])}).encode())
    lab.run()
    stranger = next(s for s in lab.names if s not in lab.relay.graph.closed(target))
    assert stranger in lab.errors[target] and "outside this site's neighbourhood" in lab.errors[target]
    assert target not in lab.relay.received[2]  # it sent no shares at all


def test_a_shared_set_naming_a_non_neighbour_is_refused():
    lab = Round()
    target = lab.names[1]

    def with_stranger(honest):
        stranger = next(s for s in lab.names if s not in lab.relay.graph.closed(target))
        mine = json.loads(honest)
        return json.dumps({**mine, "peers": mine["peers"] + [stranger]}).encode()

    lab.lie_to(target, "boxes", with_stranger)
    lab.run()
    assert "outside this site's neighbourhood" in lab.errors[target]
    assert target not in lab.relay.received[3]  # it never masked: nothing of its vector left the site


def test_no_party_can_compute_the_graph_before_every_site_revealed_its_randomness():
    """Before, the graph came from the plan and the run label alone, so the operator could try run
    labels offline until one drew a graph that suited its colluders. Now the relay built from the plan
    and run (relay_for) has no graph until the sites' randomness is in; the graph drawn then is the
    one seeded by every committed site's revealed randomness, differs between two rounds with the same
    plan, run and round number, and is not the one the plan and run alone would give."""
    from fedcontrast.privacy.secagg_graph import graph_seed
    from fedcontrast.privacy.secagg_relay import relay_for
    from fedcontrast.privacy.secagg_terms import SumLayout

    names = [f"site_{i:03d}" for i in range(100)]
    plan, settings = {"algorithm": "fedavg", "clients": 100}, SecureAggregationConfig()
    relay = relay_for(names, settings, SumLayout({"w": (4,)}, {}, 1.0), plan, "fed_1234")
    relay.begin(3)
    assert not relay.full and relay.graph is None
    with pytest.raises(SecureAggregationError, match="not drawn yet"):
        relay.drawn  # noqa: B018
    plain = relay_for(names, settings, SumLayout({"w": (4,)}, {}, 1.0))
    assert plain.graph.full and plain.graph.threshold == settings.sites_needed(100)

    first, second = Round().run(), Round().run()
    for lab in (first, second):
        assert not lab.errors
        assert lab.relay.seed == graph_seed(SESSION, 0, lab.relay.randomness)
        assert set(lab.relay.randomness) == set(lab.names)
        assert lab.relay.graph == graph_for(lab.names, lab.threshold, K, lab.relay.seed, 0)
    assert first.relay.graph != second.relay.graph  # same plan, run and round: another draw
    assert first.relay.graph != graph_for(first.names, first.threshold, K, SESSION, 0)  # not the offline one


def test_randomness_the_relay_substitutes_is_refused_by_every_site_naming_the_site():
    lab = Round()
    victim = lab.names[4]

    def substituted(honest):
        answer = json.loads(honest)
        answer["reveals"][victim] = base64.b64encode(bytes(32)).decode()
        return json.dumps(answer).encode()

    for site in lab.names:
        lab.lie_to(site, "adverts", substituted)
    with pytest.raises(SecureAggregationError, match="only 0 of 16 sites sent their boxes message"):
        lab.run()
    assert set(lab.errors) == set(lab.names)
    assert all(f"site {victim}'s graph randomness of round 0 does not match its commitment" in e
               for e in lab.errors.values())
    assert lab.relay.received[2] == {}  # no share left any site


def test_a_site_told_other_commitments_than_its_neighbours_cannot_go_on_with_them():
    """The relay gives one site a list with a commitment of its own in a peer's place (and that
    randomness): the site draws another graph, its seed differs from its neighbours', and since the
    seed is bound into the shares' cipher, the deal and the consistency signature, nothing of it is
    unmasked: the round refuses it or ends without it."""
    from fedcontrast.privacy.secagg import graph_commitment

    lab = Round()
    target, victim = lab.names[0], lab.names[9]
    fake = bytes(range(32))

    def commitments(honest):
        answer = json.loads(honest)
        answer["commitments"][victim] = base64.b64encode(graph_commitment(SESSION, 0, victim, fake)).decode()
        return json.dumps(answer).encode()

    def reveals(honest):
        answer = json.loads(honest)
        answer["reveals"][victim] = base64.b64encode(fake).decode()
        return json.dumps(answer).encode()

    lab.lie_to(target, "commitments", commitments)
    lab.lie_to(target, "adverts", reveals)
    try:
        lab.run()
    except SecureAggregationError as exc:
        lab.errors["relay"] = str(exc)
    assert lab.steps[target].site.graph_seed not in (b"", lab.relay.seed)
    assert lab.errors  # someone refused: the target, a neighbour, or the relay
    assert target not in lab.relay.received[3]  # the target's masked vector never left it


def test_a_site_that_keeps_its_randomness_ends_the_round_with_a_true_sentence():
    lab = Round(die={"site_06": "graph"})
    with pytest.raises(SecureAggregationError, match="site_06 sent its advert but not the randomness it committed "
                                                     "to.*the round ends without a sum"):
        lab.run()
    assert lab.relay.graph is None and lab.relay.sum is None


def test_randomness_that_does_not_match_its_commitment_is_refused_at_the_relay_naming_the_site():
    lab = Round()
    honest_graph = lab.steps["site_03"].graph
    lab.steps["site_03"].graph = lambda answer: (honest_graph(answer), json.dumps(
        {"randomness": base64.b64encode(bytes(32)).decode()}).encode())[1]
    with pytest.raises(SecureAggregationError, match="site site_03's graph randomness does not match the commitment"):
        lab.run()


def test_the_audit_states_the_neighbourhood_guarantee_and_the_full_graph_is_unchanged():
    from fedcontrast.audit.report import _neighbourhoods
    from fedcontrast.privacy.secagg_graph import failure_bounds

    assert _neighbourhoods(50, "auto") == [] and _neighbourhoods(200, "full") == []
    line = _neighbourhoods(100, "auto")[0]
    assert "40 of the 100 sites" in line and "28 of its 41 holders" in line and "2^-83" in line and "2^-25" in line
    assert "no party can choose or search it" in line  # the graph's randomness is every site's (graph phase)
    bounds = failure_bounds(1000, 60)
    assert bounds["follows"] < 2.0**-100 and bounds["lies"] < 2.0**-30 and bounds["fails"] < 2.0**-30


def test_different_survivor_sets_within_a_neighbourhood_never_reveal_both_secrets_of_a_site():
    """The relay tells two of the target's neighbours that it dropped (they would reveal shares of its
    key) and everyone else that it survived: the two find fewer than t_k of their neighbours signed
    their set and reveal nothing, so the relay gets no share of the target's key."""
    lab = Round(words=256)
    target = lab.names[0]
    group_b: list[str] = []
    honest = lab.answer

    def lying(site, kind):
        if kind == "survivors":
            group_b[:] = sorted(lab.relay.graph.closed(target) - {target})[-2:]
            told = [s for s in lab.names if s != target] if site in group_b else lab.names
            return json.dumps({"survivors": told}).encode()
        if kind == "signatures":  # every signature it got, whatever set each covers
            return json.dumps({"signatures": lab.relay.received[4]}).encode()
        return honest(site, kind)

    lab.answer = lying
    lab.run()
    assert all("signed that same set, fewer than the threshold 5" in lab.errors[s] for s in group_b)
    kinds = [r[target][0] for r in lab.relay.received[5].values() if target in r]
    assert "s" not in kinds and len(kinds) <= K + 1 - len(group_b)


def test_a_simulated_round_through_the_neighbourhoods_matches_the_plain_round(tmp_path):
    """The simulator's wiring (sim/federation.py): 16 FedProx-synthetic sites, k = 6, a 64-bit ring;
    the round's record names k and the model agrees with the plain run's."""
    import csv

    from fedcontrast.config import RunConfig
    from fedcontrast.sim import run_simulation

    def run(secure):
        config = RunConfig(algorithm="fedavg", dataset="fedprox_synthetic", partition="natural", clients=N, rounds=1,
                           seed=1, device="cpu", training={"local_epochs": 1},
                           secure_aggregation={"bits": 64, "neighbours": K} if secure else None)
        return run_simulation(config, tmp_path / str(secure))

    plain, secure = run(False), run(True)
    assert secure["rounds_completed"] == 1
    with open(tmp_path / "True" / "metrics.csv") as f:
        row = next(r for r in csv.DictReader(f) if r["task"] == "secure_aggregation")
    assert json.loads(row["extra"])["neighbours"] == K
    assert abs(secure["final_accuracy"] - plain["final_accuracy"]) < 0.02
