"""FLESD's ensemble similarity distillation against explicit loops over the paper's definitions."""

import math

import numpy as np
import pytest
import torch

from fedcontrast.losses import ensemble_similarity, esd_loss, similarity_matrix
from tests.losses.reference import cosine


def reference_esd_loss(query, query_index, anchors, anchor_index, target, tau_s):
    """mean_i KL(p_T(·|i) ‖ p_S(·|i)) over anchors of other public samples, one query and anchor at a time."""
    query, anchors, target = (np.asarray(a, dtype=np.float64) for a in (query, anchors, target))
    kls = []
    for i in range(len(query)):
        js = [j for j in range(len(anchors)) if int(anchor_index[j]) != int(query_index[i])]
        if not js:
            continue
        t = [float(target[int(query_index[i]), int(anchor_index[j])]) for j in js]
        s = [cosine(query[i], anchors[j]) / tau_s for j in js]
        zt = sum(math.exp(v) for v in t)
        zs = sum(math.exp(v) for v in s)
        kl = 0.0
        for tj, sj in zip(t, s):
            p_t, p_s = math.exp(tj) / zt, math.exp(sj) / zs
            kl += p_t * (math.log(p_t) - math.log(p_s))
        kls.append(kl)
    return sum(kls) / len(kls) if kls else 0.0


def _problem(seed, n=12, batch=5, queue=9, d=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    target = ensemble_similarity([similarity_matrix(torch.randn(n, d, generator=g)) for _ in range(3)],
                                 target_temperature=0.2).to(dtype)
    query_index = torch.randperm(n, generator=g)[:batch]
    anchor_index = torch.randint(0, n, (queue,), generator=g)
    query = torch.randn(batch, d, generator=g, dtype=dtype)
    anchors = torch.randn(queue, d, generator=g, dtype=dtype)
    return query, query_index, anchors, anchor_index, target


# --- similarity_matrix and ensemble_similarity ------------------------------------------------------

def test_similarity_matrix_is_the_cosine_matrix():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(7, 4, generator=g, dtype=torch.float64)
    m = similarity_matrix(z)
    assert m.shape == (7, 7)
    for i in range(7):
        for j in range(7):
            expected = float(z[i] @ z[j] / (z[i].norm() * z[j].norm()))
            assert m[i, j].item() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_similarity_matrix_rejects_non_matrix():
    with pytest.raises(ValueError, match=r"\(N, d\)"):
        similarity_matrix(torch.randn(3))


def test_ensemble_similarity_hand_case():
    # (1/2) (A + B) / τ with τ = 0.5 is A + B.
    a = torch.tensor([[1.0, 0.5], [0.5, 1.0]])
    b = torch.tensor([[1.0, -0.25], [-0.25, 1.0]])
    m = ensemble_similarity([a, b], target_temperature=0.5)
    assert m.dtype == torch.float32
    assert torch.equal(m, torch.tensor([[2.0, 0.25], [0.25, 2.0]]))


def test_ensemble_similarity_matches_loop_and_accepts_half_precision():
    g = torch.Generator().manual_seed(1)
    mats = [similarity_matrix(torch.randn(5, 3, generator=g)).half() for _ in range(4)]
    m = ensemble_similarity(mats, target_temperature=0.1)
    for i in range(5):
        for j in range(5):
            expected = sum(float(mk[i, j]) for mk in mats) / 4 / 0.1
            assert m[i, j].item() == pytest.approx(expected, rel=1e-6)


def test_ensemble_similarity_of_one_client_is_its_matrix_over_tau():
    m1 = similarity_matrix(torch.randn(4, 3))
    assert torch.allclose(ensemble_similarity([m1], target_temperature=0.25), 4 * m1, atol=1e-6)


@pytest.mark.parametrize("mats, match", [([], "at least one"),
                                         ([torch.zeros(2, 3)], "square"),
                                         ([torch.zeros(2, 2), torch.zeros(3, 3)], "same shape")])
def test_ensemble_similarity_rejects_bad_input(mats, match):
    with pytest.raises(ValueError, match=match):
        ensemble_similarity(mats, target_temperature=0.1)


@pytest.mark.parametrize("tau", [0, -0.1, float("nan")])
def test_ensemble_similarity_bad_temperature_raises(tau):
    with pytest.raises(ValueError, match="temperature"):
        ensemble_similarity([torch.eye(2)], target_temperature=tau)


# --- esd_loss -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tau_s", [0.1, 0.5])
def test_esd_loss_matches_explicit_loop(seed, tau_s):
    query, qi, anchors, ai, target = _problem(seed)
    got = esd_loss(query, qi, anchors, ai, target, student_temperature=tau_s).item()
    assert got == pytest.approx(reference_esd_loss(query, qi, anchors, ai, target, tau_s), rel=1e-10)


def test_esd_loss_float32_matches_loop():
    query, qi, anchors, ai, target = _problem(7, n=40, batch=16, queue=64, d=16, dtype=torch.float32)
    got = esd_loss(query, qi, anchors, ai, target, student_temperature=0.2).item()
    assert got == pytest.approx(reference_esd_loss(query, qi, anchors, ai, target, 0.2), rel=1e-4)


def test_zero_when_student_equals_target_up_to_a_row_constant():
    # target[i, j] = u_i·u_j/τ + c_i: the softmaxes agree, KL = 0 (query and anchors are rescaled u's).
    g = torch.Generator().manual_seed(2)
    tau = 0.3
    u = torch.nn.functional.normalize(torch.randn(10, 5, generator=g, dtype=torch.float64), dim=1)
    target = u @ u.T / tau + torch.randn(10, 1, generator=g, dtype=torch.float64)
    qi, ai = torch.tensor([0, 3, 7]), torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 3])
    loss = esd_loss(2.5 * u[qi], qi, 0.7 * u[ai], ai, target, student_temperature=tau)
    assert loss.item() == pytest.approx(0.0, abs=1e-12)


def test_two_anchor_hand_case():
    # q = e1, anchors e1 and e2, τ_S = 1: p_S = (e, 1)/(e + 1); equal target logits: p_T = (½, ½).
    # KL = ½ log(½ (e+1)/e) + ½ log(½ (e+1)) = log((e + 1)/2) − ½.
    target = torch.zeros(3, 3)
    loss = esd_loss(torch.tensor([[1.0, 0.0]]), torch.tensor([0]),
                    torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([1, 2]), target, student_temperature=1.0)
    assert loss.item() == pytest.approx(math.log((math.e + 1) / 2) - 0.5, rel=1e-6)


def test_anchors_of_the_querys_own_sample_are_masked_also_when_duplicated():
    query, qi, anchors, ai, target = _problem(3, n=12, batch=3, queue=6)
    qi = torch.tensor([0, 1, 2])
    ai = torch.tensor([5, 6, 7, 8, 9, 10])
    # Three more queue entries, all copies of query 0's own sample, with arbitrary vectors.
    g = torch.Generator().manual_seed(9)
    more_anchors = torch.cat([anchors, torch.randn(3, anchors.shape[1], generator=g, dtype=anchors.dtype)])
    more_index = torch.cat([ai, torch.tensor([0, 0, 0])])
    # Query 0 does not see them: its loss is unchanged.
    alone = esd_loss(query[:1], qi[:1], anchors, ai, target, student_temperature=0.2)
    alone_with_own = esd_loss(query[:1], qi[:1], more_anchors, more_index, target, student_temperature=0.2)
    assert alone_with_own.item() == pytest.approx(alone.item(), rel=1e-12)
    # Queries 1 and 2 do see them, and the batch loss follows the explicit loop.
    base = esd_loss(query, qi, anchors, ai, target, student_temperature=0.2)
    with_own = esd_loss(query, qi, more_anchors, more_index, target, student_temperature=0.2)
    assert with_own.item() != pytest.approx(base.item(), rel=1e-6)
    assert with_own.item() == pytest.approx(
        reference_esd_loss(query, qi, more_anchors, more_index, target, 0.2), rel=1e-10)


def test_masked_anchor_vectors_do_not_matter():
    query, qi, anchors, ai, target = _problem(4, batch=1, queue=5)
    ai = torch.tensor([int(qi[0]), (int(qi[0]) + 1) % 12, int(qi[0]), (int(qi[0]) + 2) % 12, (int(qi[0]) + 3) % 12])
    changed = anchors.clone()
    changed[[0, 2]] = torch.randn(2, anchors.shape[1], dtype=anchors.dtype)
    a = esd_loss(query, qi, anchors, ai, target, student_temperature=0.5)
    b = esd_loss(query, qi, changed, ai, target, student_temperature=0.5)
    assert a.item() == pytest.approx(b.item(), rel=1e-12)


def test_query_with_every_anchor_masked_contributes_nothing():
    query, qi, anchors, ai, target = _problem(5, batch=2, queue=4)
    qi = torch.tensor([3, 4])
    ai = torch.tensor([3, 3, 3, 3])  # query 0 has no anchor left, query 1 has four
    both = esd_loss(query, qi, anchors, ai, target, student_temperature=0.5)
    second = esd_loss(query[1:], qi[1:], anchors, ai, target, student_temperature=0.5)
    assert both.item() == pytest.approx(second.item(), rel=1e-12)
    assert torch.isfinite(both)


@pytest.mark.parametrize("queue", [0, 3])
def test_no_anchor_left_gives_zero_with_a_gradient(queue):
    query = torch.randn(2, 4, requires_grad=True)
    qi = torch.tensor([1, 1])
    loss = esd_loss(query, qi, torch.randn(queue, 4), torch.full((queue,), 1), torch.zeros(3, 3),
                    student_temperature=0.5)
    assert loss.item() == 0.0
    loss.backward()
    assert query.grad is not None and torch.equal(query.grad, torch.zeros_like(query))


def test_gradient_reaches_only_the_query_and_is_finite_with_masking():
    query, qi, anchors, ai, target = _problem(6, batch=4, queue=10)
    ai[:3] = qi[0]  # masked entries in the graph
    query.requires_grad_(True)
    anchors.requires_grad_(True)
    target.requires_grad_(True)
    esd_loss(query, qi, anchors, ai, target, student_temperature=0.2).backward()
    assert query.grad is not None and torch.isfinite(query.grad).all() and query.grad.abs().sum() > 0
    assert anchors.grad is None
    assert target.grad is None


def test_gradient_matches_finite_differences():
    query, qi, anchors, ai, target = _problem(8, n=8, batch=3, queue=5, d=4)
    ai[0] = qi[1]
    query.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda q: esd_loss(q, qi, anchors, ai, target, student_temperature=0.3), (query,))


def test_descent_on_the_query_lowers_the_loss():
    query, qi, anchors, ai, target = _problem(10, dtype=torch.float32)
    query.requires_grad_(True)
    loss = esd_loss(query, qi, anchors, ai, target, student_temperature=0.2)
    loss.backward()
    with torch.no_grad():
        assert esd_loss(query - 0.05 * query.grad, qi, anchors, ai, target, student_temperature=0.2) < loss


def test_rejects_bad_shapes_and_temperature():
    q, qi, a, ai, t = _problem(11)
    with pytest.raises(ValueError, match="same d"):
        esd_loss(q, qi, a[:, :3], ai, t, student_temperature=0.5)
    with pytest.raises(ValueError, match="one index per row"):
        esd_loss(q, qi[:2], a, ai, t, student_temperature=0.5)
    with pytest.raises(ValueError, match="integer"):
        esd_loss(q, qi.double(), a, ai.double(), t, student_temperature=0.5)
    with pytest.raises(ValueError, match="square"):
        esd_loss(q, qi, a, ai, t[:, :3], student_temperature=0.5)
    with pytest.raises(ValueError, match="temperature"):
        esd_loss(q, qi, a, ai, t, student_temperature=0.0)
