"""One hostile site under secure aggregation (fedcontrast.privacy.secagg_reach): it can put any word of
the ring in every term it masks, unclipped; the aggregator then refuses, in one sentence naming the
round, a count sum the survivors could not have sent, and clips every average to the range an honest
one takes, so the averaged model moves by at most the closed form ``model_reach`` (2 × the bound of
the honest values) — and the worst adversary built here attains it. Honest sums are left bit for bit;
the audit states the reach on the model and a site policy's ``max_hostile_reach`` refuses a plan over it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedcontrast.algorithms import RunFacts, ServerContext, get_algorithm
from fedcontrast.algorithms.base import Downlink
from fedcontrast.algorithms.fedpcl import COUNTS, GLOBAL_PROTOTYPES, LOCAL_PROTOTYPES, PRESENT
from fedcontrast.algorithms.fedssc import CLASS_COUNTS, CLASS_MEANS, CLASS_PRESENT, CLASS_REPS
from fedcontrast.algorithms.flesd import REPRESENTATIONS
from fedcontrast.config import RepresentationDPConfig, RunConfig, SecureAggregationConfig
from fedcontrast.errors import ConfigError
from fedcontrast.privacy.secagg import Quantizer, SecAggSite, SecureAggregationError
from fedcontrast.privacy.secagg_reach import bounded_sums, model_reach, model_reaches
from fedcontrast.privacy.secagg_sim import secure_aggregate
from fedcontrast.privacy.secagg_terms import SumLayout, flatten_terms, site_terms, term_scale, unflatten_terms

SITES = ["site_0", "site_1", "site_2"]
HOSTILE = "site_2"
WEIGHTS = {"site_0": 200.0, "site_1": 150.0, "site_2": 120.0}
ROUND = 4


# --- helpers: the ring as a hostile site sees it ---------------------------------------------------
def raw_words(values, q: Quantizer) -> np.ndarray:
    """Any real values (in ring units) as words of the ring, unclipped: what a site that skips its own
    clipping masks (a value beyond the ring wraps around it)."""
    ints = [int(round(float(v) * 2 ** q.frac_bits)) % 2 ** q.bits for v in np.ravel(values)]
    return np.array(ints, dtype=np.uint64).astype(q.unsigned)


def extreme(q: Quantizer, size: int, *, largest: bool) -> np.ndarray:
    """The largest (2^(bits−1) − 1) or smallest (−2^(bits−1)) word of the ring, ``size`` times."""
    word = 2 ** (q.bits - 1) - 1 if largest else 2 ** (q.bits - 1)
    return np.full(size, word, dtype=np.uint64).astype(q.unsigned)


def ring_total(vectors: list[np.ndarray], q: Quantizer, hostile: np.ndarray | None = None) -> np.ndarray:
    """The unmasked sum the aggregator decodes: the honest sites' encoded vectors plus the hostile
    site's words, modulo 2^bits (the masks cancel; :func:`secure_aggregate` runs them for real)."""
    total = np.zeros(vectors[0].size, dtype=q.unsigned)
    with np.errstate(over="ignore"):
        for v in vectors:
            total += q.encode(v)
        if hostile is not None:
            total += hostile
    return q.decode(total)


def fedavg_setup(settings, values=None):
    """FedAvg, 3 sites, one upload ``w`` of 6 values within the clip; its layout with the plan's bounds."""
    algorithm = get_algorithm("fedavg")()
    rng = np.random.default_rng(0)
    uploads = {s: {"w": torch.tensor(rng.uniform(-8, 8, 6) if values is None else values[i], dtype=torch.float32)}
               for i, s in enumerate(SITES)}
    terms = site_terms(algorithm, uploads[SITES[0]], WEIGHTS[SITES[0]], settings)
    layout = SumLayout({k: tuple(v.shape) for k, v in terms.items()}, {"w": torch.float32},
                       term_scale(algorithm, settings), settings)
    return algorithm, uploads, layout


def honest_vectors(algorithm, uploads, layout, settings, sites):
    return [flatten_terms(site_terms(algorithm, uploads[s], WEIGHTS[s], settings), layout.scale) for s in sites]


def honest_mean(uploads, sites, name="w"):
    """The honest sites' own FedAvg (float64, explicit)."""
    total = sum(WEIGHTS[s] for s in sites)
    return sum(WEIGHTS[s] * uploads[s][name].double() for s in sites) / total


def server(**kwargs):
    return ServerContext(model=None, round_num=ROUND, seed=0, device=torch.device("cpu"), num_classes=4,
                         sites=list(SITES), **kwargs)


def assert_one_sentence_naming_the_round(exc: BaseException, term: str) -> None:
    message = str(exc)
    assert message.startswith(f"round {ROUND}: the secure sum's {term} is "), message
    assert "outside what 3 surviving sites can send" in message and "not aggregated" in message
    assert ". " not in message and "\n" not in message


# --- FedAvg: (i) every weight at 1e6, through the protocol --------------------------------------
@pytest.mark.parametrize("bits", [32, 64])
def test_a_site_that_sets_every_weight_to_1e6_moves_fedavg_by_at_most_the_reach(bits, monkeypatch):
    """The tester's attack: one site's weights all 1e6, masked as raw ring words (its own clipping
    skipped) inside the real protocol (:func:`secure_aggregate`). Unbounded before; now every value
    stays within the clip and within ``model_reach`` = 2 × clip of the honest sites' FedAvg."""
    settings = SecureAggregationConfig(bits=bits, max_samples=1000.0)
    algorithm, uploads, layout = fedavg_setup(settings)
    q = Quantizer.for_sites(settings.clip, len(SITES), bits)
    n = WEIGHTS[HOSTILE] / settings.max_samples  # its count term, honest: n_k / max_samples
    words = raw_words(np.concatenate([[n], np.full(6, 1e6 * n)]), q)  # count, then sum.w (name order)
    real_mask = SecAggSite.mask

    def hostile_mask(self, vector, quantizer, *args, **kwargs):
        masked = real_mask(self, vector, quantizer, *args, **kwargs)
        if self.name != HOSTILE:
            return masked
        with np.errstate(over="ignore"):  # its masks stay (the sum unmasks), its clipped input becomes raw words
            return masked - quantizer.encode(vector).ravel() + words

    monkeypatch.setattr(SecAggSite, "mask", hostile_mask)
    downlink, _ = secure_aggregate(algorithm, uploads, WEIGHTS, settings, ROUND, server())
    reach = model_reach(algorithm, settings, len(SITES))
    assert reach == 2 * settings.clip
    value = downlink.global_tensors["w"].double()
    moved = float((value - honest_mean(uploads, SITES[:2])).abs().max())
    assert float(value.abs().max()) <= settings.clip and moved <= reach
    if bits == 64:  # 1e6·n fits this ring unwrapped: the average is pushed to the clip, no further
        assert torch.equal(value, torch.full_like(value, settings.clip))


# --- (ii) the largest and smallest words; (iii) a count that cancels the honest ones ----------------
@pytest.mark.parametrize("bits", [32, 64])
@pytest.mark.parametrize("largest", [True, False])
def test_the_largest_and_smallest_ring_words_are_refused_or_clipped(bits, largest):
    settings = SecureAggregationConfig(bits=bits, max_samples=1000.0)
    algorithm, uploads, layout = fedavg_setup(settings)
    q = Quantizer.for_sites(settings.clip, len(SITES), bits)
    vectors = honest_vectors(algorithm, uploads, layout, settings, SITES[:2])
    # every word extreme, the count too: the count sum wraps far outside what 3 sites hold
    with pytest.raises(SecureAggregationError) as refused:
        layout.downlink(algorithm, ring_total(vectors, q, extreme(q, 7, largest=largest)), server(), survivors=3)
    assert_one_sentence_naming_the_round(refused.value, "count")
    # its count honest, its weights extreme: aggregated, clipped, within the reach
    hostile = np.concatenate([raw_words([WEIGHTS[HOSTILE] / settings.max_samples], q),
                              extreme(q, 6, largest=largest)])
    downlink = layout.downlink(algorithm, ring_total(vectors, q, hostile), server(), survivors=3)
    value = downlink.global_tensors["w"].double()
    assert float(value.abs().max()) <= settings.clip
    assert float((value - honest_mean(uploads, SITES[:2])).abs().max()) <= model_reach(algorithm, settings, 3)


@pytest.mark.parametrize("bits", [32, 64])
def test_a_count_that_cancels_the_honest_ones_is_refused_and_the_worst_accepted_one_attains_the_reach(bits):
    """The hostile count −Σ honest (the sum 0) and one leaving a thousandth of a sample are refused;
    the smallest sum the check accepts (3 samples: one per survivor) with a numerator pushing the
    average to +clip while every honest value is −clip moves the model by exactly the reach."""
    settings = SecureAggregationConfig(bits=bits, max_samples=1000.0)
    clip, scale = settings.clip, settings.max_samples
    values = [np.full(6, -clip)] * 3
    algorithm, uploads, layout = fedavg_setup(settings, values)
    q = Quantizer.for_sites(clip, len(SITES), bits)
    vectors = honest_vectors(algorithm, uploads, layout, settings, SITES[:2])
    honest_count = (WEIGHTS["site_0"] + WEIGHTS["site_1"]) / scale  # ring units
    for left in (0.0, 1e-3):
        hostile = raw_words(np.concatenate([[-honest_count + left / scale], np.zeros(6)]), q)
        with pytest.raises(SecureAggregationError) as refused:
            layout.downlink(algorithm, ring_total(vectors, q, hostile), server(), survivors=3)
        assert_one_sentence_naming_the_round(refused.value, "count")
    smallest = 3.0  # samples: the fewest 3 survivors can send
    honest_sum = -clip * (WEIGHTS["site_0"] + WEIGHTS["site_1"])
    numerator = 1.5 * clip * smallest - honest_sum  # the average beyond +clip: clipped to it
    hostile = raw_words(np.concatenate([[(smallest / scale) - honest_count], np.full(6, numerator / scale)]), q)
    downlink = layout.downlink(algorithm, ring_total(vectors, q, hostile), server(), survivors=3)
    moved = float((downlink.global_tensors["w"].double() - honest_mean(uploads, SITES[:2])).abs().max())
    reach = model_reach(algorithm, settings, 3)
    assert moved <= reach and moved == pytest.approx(reach, rel=1e-6)  # the bound is attained, not vacuous


def test_random_hostile_words_are_refused_or_move_the_model_by_at_most_the_reach():
    settings = SecureAggregationConfig(bits=32, max_samples=1000.0)
    algorithm, uploads, layout = fedavg_setup(settings)
    q = Quantizer.for_sites(settings.clip, len(SITES), 32)
    vectors = honest_vectors(algorithm, uploads, layout, settings, SITES[:2])
    mean, reach = honest_mean(uploads, SITES[:2]), model_reach(algorithm, settings, 3)
    rng = np.random.default_rng(1)
    accepted = 0
    for trial in range(300):
        words = rng.integers(0, 2 ** 32, 7, dtype=np.uint64).astype(np.uint32)
        if trial % 2:  # half of them with a count the check accepts: the numerator alone is hostile
            words[0] = raw_words([rng.uniform(-0.3, 0.9)], q)[0]
        try:
            downlink = layout.downlink(algorithm, ring_total(vectors, q, words), server(), survivors=3)
        except SecureAggregationError as exc:
            assert_one_sentence_naming_the_round(exc, "count")
            continue
        accepted += 1
        assert float((downlink.global_tensors["w"].double() - mean).abs().max()) <= reach
    assert accepted > 50


# --- the closed form against a brute-force search -----------------------------------------------------
def test_model_reach_equals_a_brute_force_search_over_hostile_words_on_a_tiny_example():
    """FedAvg, one value, 2 honest sites and a hostile one, clip 1, max_samples 4, a 32-bit ring (28
    fractional bits: every word decodes to [−8, 8)). Every honest value on a grid of [−1, 1], every
    honest count 1 or 4; the hostile numerator and count each over 513 words spread across the whole
    ring (its extremes included): the largest movement found is the closed form, never above it."""
    settings = SecureAggregationConfig(clip=1.0, bits=32, max_samples=4.0)
    q = Quantizer.for_sites(settings.clip, 3, 32)
    assert (q.frac_bits, q.reach) == (28, 8.0)
    algorithm = get_algorithm("fedavg")()
    grid = np.linspace(-1.0, 1.0, 5)
    words = np.unique(np.concatenate([np.linspace(-2 ** 31, 2 ** 31 - 1, 513).round(), [2 ** 31 - 1, -2 ** 31]]))
    words = (words.astype(np.int64) % 2 ** 32).astype(np.uint32)
    a, b, w = np.meshgrid(grid, grid, np.arange(words.size), indexing="ij")  # site_0's value, site_1's, the word
    a, b, w = a.ravel(), b.ravel(), w.ravel()
    layout = SumLayout({"count": (1,), "sum.w": (a.size,)}, {"w": torch.float64}, 4.0, settings)
    found = 0.0
    for n0 in (1.0, 4.0):
        for n1 in (1.0, 4.0):
            honest = [np.concatenate([[n0 / 4], n0 * a / 4]), np.concatenate([[n1 / 4], n1 * b / 4])]
            mean = (n0 * a + n1 * b) / (n0 + n1)
            for count_word in words:
                hostile = np.concatenate([[count_word], words[w]]).astype(np.uint32)
                try:
                    downlink = layout.downlink(algorithm, ring_total(honest, q, hostile), server(), survivors=3)
                except SecureAggregationError:
                    continue
                found = max(found, float(np.abs(downlink.global_tensors["w"].numpy() - mean).max()))
    assert found <= model_reach(algorithm, settings, 3) == 2.0
    assert found == pytest.approx(2.0, abs=1e-12)


def test_the_closed_form_is_twice_the_honest_range_whatever_max_samples_bits_sites_and_threshold():
    for name, hp, facts, bound in [("fedavg", {}, RunFacts(), 10.0), ("fedprox", {}, RunFacts(), 10.0),
                                   ("moon", {}, RunFacts(), 10.0),
                                   ("fedssc", {"class_reps": "pooled"}, RunFacts(), 10.0),
                                   ("fedpcl", {"local_sets": "global"}, RunFacts(), 1.0 + 1e-4),
                                   ("flesd", {}, RunFacts(public_size=8), 1.0 + 1e-4)]:
        algorithm = get_algorithm(name).from_settings(hp, facts)
        for max_samples in (1.0, 50.0, 1e5):
            for bits in (32, 64):
                for sites, threshold in ((3, 2), (3, 3), (10, None), (40, 21)):
                    settings = SecureAggregationConfig(clip=10.0, bits=bits, max_samples=max_samples,
                                                       threshold=threshold)
                    assert model_reach(algorithm, settings, sites) == pytest.approx(2 * bound, rel=1e-12), name
    reaches = model_reaches(get_algorithm("fedssc").from_settings({"class_reps": "pooled"}),
                            SecureAggregationConfig(clip=4.0), 5)
    assert [(r.what, r.bound, r.reach, r.setting) for r in reaches] == [
        ("sum.* / count", 4.0, 8.0, "secure_aggregation.clip"),
        ("classes.sum / classes.count", 4.0, 8.0, "secure_aggregation.clip")]
    noisy = get_algorithm("fedpcl").from_settings({"local_sets": "global"},
                                                  RunFacts(representation_dp=RepresentationDPConfig()))
    assert model_reach(noisy, SecureAggregationConfig(clip=3.0), 3) == 6.0  # DP noise: only the clip bounds it


# --- honest sums are left as they are ------------------------------------------------------------------
def test_honest_sums_pass_the_checks_bit_for_bit():
    settings = SecureAggregationConfig(bits=32, max_samples=1000.0)
    algorithm, uploads, layout = fedavg_setup(settings, [np.full(6, 10.0)] * 3)  # at the clip itself
    q = Quantizer.for_sites(settings.clip, 3, 32)
    total = ring_total(honest_vectors(algorithm, uploads, layout, settings, SITES), q)
    sums = unflatten_terms(total, layout.terms, layout.scale)
    checked = bounded_sums(algorithm, sums, settings, round_num=ROUND, survivors=3, sites=3)
    assert all(float((checked[k] - sums[k]).abs().max()) <= 20 * q.step * 1e3 for k in sums)  # its rounding at most
    rng = np.random.default_rng(2)
    algorithm, uploads, layout = fedavg_setup(settings, [rng.uniform(-9, 9, 6) for _ in SITES])
    total = ring_total(honest_vectors(algorithm, uploads, layout, settings, SITES), q)
    sums = unflatten_terms(total, layout.terms, layout.scale)
    checked = bounded_sums(algorithm, sums, settings, round_num=ROUND, survivors=3, sites=3)
    assert all(torch.equal(checked[k], sums[k]) for k in sums)
    unchecked = SumLayout(layout.terms, layout.dtypes, layout.scale)  # no settings: no checks
    assert torch.equal(layout.downlink(algorithm, total, server(), survivors=3).global_tensors["w"],
                       unchecked.downlink(algorithm, total, server()).global_tensors["w"])


# --- the other plugins' averages ---------------------------------------------------------------------
C, D = 4, 5


def class_uploads(seed: int, *, unit: bool):
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for site in SITES:
        counts = torch.randint(10, 30, (C,), generator=gen)
        counts[3] = 0  # nobody has class 3
        means = torch.randn(C, D, generator=gen)
        means = F.normalize(means, dim=1) if unit else means
        means[counts == 0] = 0.0
        out[site] = (means, counts.long())
    return out


def hostile_sum(algorithm, uploads, settings, words_for):
    """The decoded sum when the hostile site replaces its terms by ``words_for(name, size, q)`` (None:
    its honest encoding)."""
    terms = site_terms(algorithm, uploads[HOSTILE], WEIGHTS[HOSTILE], settings)
    layout = SumLayout({k: tuple(v.shape) for k, v in terms.items()},
                       {k: v.dtype for k, v in uploads[HOSTILE].items()}, term_scale(algorithm, settings), settings)
    q = Quantizer.for_sites(settings.clip, 3, settings.bits)
    honest = [flatten_terms(site_terms(algorithm, uploads[s], WEIGHTS[s], settings), layout.scale) for s in SITES[:2]]
    own = q.encode(flatten_terms(terms, layout.scale))
    parts, offset = [], 0
    for name in sorted(terms):
        size = terms[name].numel()
        chosen = words_for(name, size, q)
        parts.append(own[offset:offset + size] if chosen is None else chosen)
        offset += size
    return layout, ring_total(honest, q, np.concatenate(parts).astype(q.unsigned))


def test_fedssc_pooled_class_means_are_clipped_to_the_clip_and_a_bad_class_count_is_refused():
    algorithm = get_algorithm("fedssc").from_settings({"class_reps": "pooled"})
    settings = SecureAggregationConfig(bits=32, max_samples=1000.0)
    weights = {s: torch.full((3,), 0.5) for s in SITES}
    uploads = {s: {"model.w": weights[s], CLASS_MEANS: m, CLASS_COUNTS: n}
               for s, (m, n) in class_uploads(1, unit=False).items()}
    honest = algorithm.aggregate({s: uploads[s] for s in SITES[:2]}, WEIGHTS, server())
    layout, total = hostile_sum(algorithm, uploads, settings,
                                lambda name, size, q: extreme(q, size, largest=True) if name == "classes.sum" else None)
    downlink = layout.downlink(algorithm, total, server(), survivors=3)
    reps = downlink.global_tensors[CLASS_REPS].double()
    reach = model_reach(algorithm, settings, 3)
    assert reach == 20.0 and float(reps.abs().max()) <= settings.clip
    present = honest.global_tensors[CLASS_PRESENT].bool()
    assert float((reps[present] - honest.global_tensors[CLASS_REPS].double()[present]).abs().max()) <= reach
    assert torch.equal(downlink.global_tensors[CLASS_PRESENT], honest.global_tensors[CLASS_PRESENT])
    layout, total = hostile_sum(algorithm, uploads, settings,  # a class count no 3 sites hold
                                lambda name, size, q: raw_words(np.full(size, 50.0), q)
                                if name == "classes.count" else None)
    with pytest.raises(SecureAggregationError) as refused:
        layout.downlink(algorithm, total, server(), survivors=3)
    assert_one_sentence_naming_the_round(refused.value, "classes.count")


@pytest.mark.parametrize("weighting", ["count", "paper_eq6"])
def test_fedpcl_global_prototypes_stay_within_the_unit_range(weighting):
    algorithm = get_algorithm("fedpcl").from_settings({"local_sets": "global", "prototype_weighting": weighting})
    settings = SecureAggregationConfig(bits=32, max_samples=1000.0)
    uploads = {s: {LOCAL_PROTOTYPES: m, COUNTS: n} for s, (m, n) in class_uploads(2, unit=True).items()}
    honest = algorithm.aggregate({s: uploads[s] for s in SITES[:2]}, WEIGHTS, server())
    for largest in (True, False):
        layout, total = hostile_sum(algorithm, uploads, settings,
                                    lambda name, size, q, largest=largest: extreme(q, size, largest=largest)
                                    if name == "classes.sum" else None)
        g = layout.downlink(algorithm, total, server(), survivors=3).global_tensors[GLOBAL_PROTOTYPES].double()
        bound = 1.0 + 1e-4
        assert float(g.abs().max()) <= bound * (1 + 2 ** -24)  # the bound, as float32 rounds it
        present = honest.global_tensors[PRESENT].bool()
        moved = float((g[present] - honest.global_tensors[GLOBAL_PROTOTYPES].double()[present]).abs().max())
        assert moved <= model_reach(algorithm, settings, 3) * (1 + 2 ** -23) and \
            model_reach(algorithm, settings, 3) == pytest.approx(2 * bound)
        assert moved > 0.3  # the prototypes did move: the clip, not the honest sum, holds them
    layout, total = hostile_sum(algorithm, uploads, settings,  # one holder too many per class
                                lambda name, size, q: raw_words(np.full(size, 5.0 / 1000.0), q)
                                if name == "classes.holders" else None)
    with pytest.raises(SecureAggregationError) as refused:
        layout.downlink(algorithm, total, server(), survivors=3)
    assert_one_sentence_naming_the_round(refused.value, "classes.holders")


def test_flesd_ensemble_similarities_stay_within_the_cosine_range_and_a_wrong_site_count_is_refused():
    targets = []

    class Recording(get_algorithm("flesd")):  # test only: the distillation target, without distilling
        def distilled(self, target, srv, answered):
            targets.append((target, answered))
            return Downlink({})

    n = 8
    algorithm = Recording.from_settings({}, RunFacts(public_size=n))
    settings = SecureAggregationConfig(bits=32, max_samples=1000.0)
    gen = torch.Generator().manual_seed(3)
    uploads = {s: {REPRESENTATIONS: F.normalize(torch.randn(n, D, generator=gen), dim=1)} for s in SITES}
    tau = algorithm.hp.target_temperature
    honest = sum(uploads[s][REPRESENTATIONS].double() @ uploads[s][REPRESENTATIONS].double().T for s in SITES[:2]) / 2
    for largest in (True, False):
        layout, total = hostile_sum(algorithm, uploads, settings,
                                    lambda name, size, q, largest=largest: extreme(q, size, largest=largest)
                                    if name == "similarity.sum" else None)
        layout.downlink(algorithm, total, server(), survivors=3)
        target, answered = targets[-1]
        mean = target.double() * tau  # M, before the temperature
        assert answered == 3 and float(mean.abs().max()) <= 1.0 + 1e-4 + 1e-6
        assert float((mean - honest).abs().max()) <= model_reach(algorithm, settings, 3) + 1e-6
    layout, total = hostile_sum(algorithm, uploads, settings,  # it says it did not answer: the sum counts 2
                                lambda name, size, q: raw_words(np.zeros(size), q) if name == "similarity.sites"
                                else None)
    with pytest.raises(SecureAggregationError) as refused:
        layout.downlink(algorithm, total, server(), survivors=3)
    assert_one_sentence_naming_the_round(refused.value, "similarity.sites")


# --- the audit and the policy ---------------------------------------------------------------------------
def audited(config):
    from fedcontrast.audit.report import audit_plan

    plan = {"task_runner": {"settings": {"run_config": config.to_dict()}}, "network": {"settings": {}},
            "aggregator": {"settings": {"rounds_to_train": config.rounds}}}
    return audit_plan(plan, source="plan", sites=[], site_samples={})


def test_the_audit_states_the_reach_on_the_averaged_model_beside_the_reach_on_each_term():
    from fedcontrast.audit.format import format_report

    report = audited(RunConfig(algorithm="fedavg", clients=3, secure_aggregation={}))
    assert report.secure_reach == 20.0 and report.secure_reach_setting == "secure_aggregation.clip"
    text = format_report(report)
    assert ("  averaged model: one hostile site can move each value of sum.* / count by up to 20 (the honest values "
            "lie in [−10, 10]); each summed term by up to ±64 — the aggregator refuses a count sum the survivors "
            "could not have sent and clips each average to that range, so lower secure_aggregation.clip to lower it"
            in text.splitlines())
    assert "a hostile site can move each summed term by up to ±64 (any word of the ring" in text  # kept
    assert report.to_dict()["secure_reach"] == 20.0
    pcl = audited(RunConfig(algorithm="fedpcl", clients=3, hyperparameters={"fedpcl": {"local_sets": "global"}},
                            secure_aggregation={}))
    assert pcl.secure_reach == pytest.approx(2.0002) and pcl.secure_reach_setting is None
    assert "classes.sum / classes.count by up to 2.0002" in format_report(pcl)
    plain = audited(RunConfig(algorithm="fedavg", clients=3))
    assert plain.secure_reach is None and "averaged model" not in format_report(plain)


def test_a_site_policy_refuses_a_plan_whose_hostile_reach_exceeds_its_bound(tmp_path):
    from fedcontrast.privacy.policy import SitePolicy, check_policy

    secure = audited(RunConfig(algorithm="fedavg", clients=3, secure_aggregation={}))
    refused = check_policy(secure, SitePolicy(max_hostile_reach=5.0))
    assert refused == ["one hostile site could move each value of the averaged model by up to 20 under this plan's "
                       "secure aggregation (its masked uploads cannot be checked), more than the policy's "
                       "max_hostile_reach 5: lower secure_aggregation.clip to at most 2.5 (the reach is twice it)"]
    assert check_policy(secure, SitePolicy(max_hostile_reach=20.0)) == []
    lowered = audited(RunConfig(algorithm="fedavg", clients=3, secure_aggregation={"clip": 2.5}))
    assert lowered.secure_reach == 5.0 and check_policy(lowered, SitePolicy(max_hostile_reach=5.0)) == []
    assert check_policy(audited(RunConfig(algorithm="fedavg", clients=3)), SitePolicy(max_hostile_reach=1.0)) == []
    assert "a plan cannot set below 1" in check_policy(secure, SitePolicy(max_hostile_reach=1.0))[0]
    pcl = audited(RunConfig(algorithm="fedpcl", clients=3, hyperparameters={"fedpcl": {"local_sets": "global"}},
                            secure_aggregation={}))
    (why,) = check_policy(pcl, SitePolicy(max_hostile_reach=1.5))
    assert "by up to 2.0002" in why and "no setting lowers it" in why and ". " not in why
    path = tmp_path / "policy.yaml"
    path.write_text("max_hostile_reach: 5\n")
    assert SitePolicy.from_yaml(path).max_hostile_reach == 5
    for wrong in (0, -1.0, float("inf"), "5", True):
        with pytest.raises(ConfigError, match="policy max_hostile_reach must be a number > 0"):
            SitePolicy(max_hostile_reach=wrong)
