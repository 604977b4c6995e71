"""What an honest representation upload can be: prototype and mean norms, counts, Gram matrices."""

import logging

import pytest
import torch
import torch.nn.functional as F

from fedcontrast.algorithms import InvalidUploadError, RunFacts, get_algorithm
from fedcontrast.algorithms.fedpcl import COUNTS, LOCAL_PROTOTYPES
from fedcontrast.algorithms.fedssc import CLASS_COUNTS, CLASS_MEANS
from fedcontrast.algorithms.flesd import SIMILARITY, quantise
from fedcontrast.config import RepresentationDPConfig, RobustnessConfig
from fedcontrast.privacy.representations import GaussianClassSums
from fedcontrast.robust import UploadScreen

from .test_flesd import flesd


def honest_prototypes(classes=4, dim=16, per_class=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = F.normalize(torch.randn(classes * per_class, dim, generator=g), dim=1)
    labels = torch.arange(classes).repeat_interleave(per_class)
    protos = torch.stack([z[labels == c].mean(0) for c in range(classes)])
    return z, labels, protos, torch.full((classes,), per_class)


def test_fedpcl_prototype_norms_beyond_a_mean_of_unit_vectors_are_rejected():
    _, _, protos, counts = honest_prototypes()
    alg = get_algorithm("fedpcl")()
    alg.check_upload("x", {LOCAL_PROTOTYPES: protos, COUNTS: counts}, float(counts.sum()))
    one = F.normalize(torch.ones(1, 16), dim=1).repeat(4, 1)  # every sample of a class the same: norm exactly 1
    alg.check_upload("x", {LOCAL_PROTOTYPES: one, COUNTS: counts}, float(counts.sum()))
    with pytest.raises(InvalidUploadError, match=r"site 'x' uploaded a prototype of norm .* for class 0, more than a "
                                                 r"mean of unit vectors"):
        alg.check_upload("x", {LOCAL_PROTOTYPES: protos * 1e6, COUNTS: counts}, float(counts.sum()))


def test_fedpcl_noisy_honest_prototypes_pass_and_scaled_ones_do_not():
    dp = RepresentationDPConfig(noise_multiplier=2.0, clip=1.0)
    alg = get_algorithm("fedpcl")(facts=RunFacts(representation_dp=dp, count_noise=10.0, under_dp=True))
    z, labels, _, _ = honest_prototypes(per_class=20)
    for seed in range(200):  # the mechanism as a site runs it (GaussianClassSums), 200 draws
        sums = GaussianClassSums(4, 16, len(z), "cpu", noise_multiplier=dp.noise_multiplier, clip=dp.clip,
                                 generator=torch.Generator().manual_seed(seed))
        sums.add(z, labels, torch.arange(len(z)))
        s, n = sums.release()
        n = n.round().clamp_min(0)
        sent = n >= 1
        protos = torch.where(sent[:, None], s / n.clamp_min(1)[:, None], torch.zeros_like(s))
        counts = torch.where(sent, n, torch.zeros_like(n)).long()
        alg.check_upload("x", {LOCAL_PROTOTYPES: protos, COUNTS: counts}, 80.0 + 10 * torch.randn(()).item())
        if seed < 5:
            with pytest.raises(InvalidUploadError, match="prototype of norm"):
                alg.check_upload("x", {LOCAL_PROTOTYPES: protos * 1e6, COUNTS: counts}, 80.0)


def test_counts_inflated_with_a_matching_sample_count_are_caught_by_the_declared_size():
    _, _, protos, counts = honest_prototypes()
    alg = get_algorithm("fedpcl")()
    inflated = counts * 1000
    alg.check_upload("x", {LOCAL_PROTOTYPES: protos, COUNTS: inflated}, float(inflated.sum()))  # consistent in itself
    screen = UploadScreen(RobustnessConfig(max_samples={"x": 60}), alg)
    with pytest.raises(Exception, match="site 'x' claimed 48000 samples, more than the plan's max_samples 60"):
        screen.check("x", {LOCAL_PROTOTYPES: protos, COUNTS: inflated}, float(inflated.sum()), 0, None)
    screen.check("x", {LOCAL_PROTOTYPES: protos, COUNTS: counts}, float(counts.sum()), 0, None)
    with pytest.raises(InvalidUploadError, match="more than its 10 samples"):  # FedSSC: counts beyond the weight
        get_algorithm("fedssc")().check_upload("x", {CLASS_MEANS: protos, CLASS_COUNTS: counts}, 10.0)


def test_fedssc_means_are_bounded_by_the_clip_under_dp_only():
    _, _, protos, counts = honest_prototypes()
    alg = get_algorithm("fedssc")()
    alg.check_upload("x", {CLASS_MEANS: protos * 1e6, CLASS_COUNTS: counts}, 48.0)  # unnormalised z: no bound
    dp = RepresentationDPConfig(noise_multiplier=1.0, clip=0.5)
    alg = get_algorithm("fedssc")(facts=RunFacts(representation_dp=dp, count_noise=10.0, under_dp=True))
    assert alg.facts.private_representations and not alg.facts.exact_weights
    alg.check_upload("x", {CLASS_MEANS: protos * 0.5, CLASS_COUNTS: counts}, 48.0)
    with pytest.raises(InvalidUploadError, match="class mean of norm .* more than clipped representations allow"):
        alg.check_upload("x", {CLASS_MEANS: protos * 1e6, CLASS_COUNTS: counts}, 48.0)


def test_flesd_matrices_that_no_representations_can_have_are_rejected(caplog):
    n = 40
    alg = flesd(n, upload="similarity")
    g = torch.Generator().manual_seed(0)
    z = F.normalize(torch.randn(n, 8, generator=g), dim=1)
    alg.check_upload("a", {SIMILARITY: z @ z.T}, 10.0)
    int8 = flesd(n, upload="similarity", quantize="int8")
    int8.check_upload("a", {SIMILARITY: quantise(z @ z.T, "int8")}, 10.0)  # quantisation error tolerated
    anti = -torch.ones(n, n) + 2 * torch.eye(n)  # −1 off the diagonal: symmetric, in [−1, 1], diagonal 1
    with pytest.raises(InvalidUploadError, match=r"site 'b' uploaded a similarity matrix that is not positive "
                                                 r"semi-definite \(smallest eigenvalue -38"):
        alg.check_upload("b", {SIMILARITY: anti}, 10.0)
    half = z @ z.T
    half.fill_diagonal_(0.5)
    with pytest.raises(InvalidUploadError, match="diagonal is not 1"):
        alg.check_upload("c", {SIMILARITY: half}, 10.0)
    with caplog.at_level(logging.WARNING):  # the Gram matrix of n identical vectors: possible, but collapsed
        alg.check_upload("d", {SIMILARITY: torch.ones(n, n)}, 10.0)
    assert "site 'd' uploaded a similarity matrix of all ones" in caplog.text
