"""FedSiam-DA's dual aggregation against hand-computed cases and an explicit loop."""

import math

import pytest
import torch

from fedcontrast.aggregation import dual_aggregation


def test_hand_computed_two_sites():
    # w_a = [1, 0], w_b = [0, 1], equal weights: w0 = [0.5, 0.5]; both cosines 1/√2 → ξ = ½ each.
    uploads = {"a": {"w": torch.tensor([1.0, 0.0])}, "b": {"w": torch.tensor([0.0, 1.0])}}
    w, xi = dual_aggregation(uploads, {"a": 1, "b": 1})
    assert xi == pytest.approx({"a": 0.5, "b": 0.5})
    assert torch.allclose(w["w"], torch.tensor([0.5, 0.5]))


def test_matches_explicit_loop_over_the_whole_flattened_model():
    gen = torch.Generator().manual_seed(0)
    uploads = {f"s{k}": {"a": torch.randn(2, 3, generator=gen) + 1, "b": torch.randn(4, generator=gen) + 1}
               for k in range(4)}
    weights = {f"s{k}": float(k + 1) for k in range(4)}
    w, xi = dual_aggregation(uploads, weights)
    n = sum(weights.values())
    flat = {s: torch.cat([u["a"].flatten(), u["b"].flatten()]).double() for s, u in uploads.items()}
    w0 = sum(weights[s] / n * flat[s] for s in flat)
    cos = {s: float(flat[s] @ w0 / (flat[s].norm() * w0.norm())) for s in flat}
    expected_xi = {s: max(c, 0) / sum(max(v, 0) for v in cos.values()) for s, c in cos.items()}
    assert xi == pytest.approx(expected_xi, rel=1e-6)  # w0 is the float32 first-pass model, not float64
    expected = sum(expected_xi[s] * flat[s] for s in flat)
    assert torch.allclose(torch.cat([w["a"].flatten(), w["b"].flatten()]).double(), expected, atol=1e-6)


def test_negative_cosines_are_clipped_and_all_negative_falls_back_to_first_pass():
    # c is opposite to the first pass: its cosine is negative, so it gets ξ = 0.
    uploads = {"a": {"w": torch.tensor([2.0, 0.0])}, "b": {"w": torch.tensor([2.0, 0.2])},
               "c": {"w": torch.tensor([-1.0, 0.0])}}
    w, xi = dual_aggregation(uploads, {"a": 1, "b": 1, "c": 1})
    assert xi["c"] == 0.0 and xi["a"] + xi["b"] == pytest.approx(1.0)
    # Two opposite models with a zero first pass: no positive cosine → w = w0 (the plain average).
    opposite = {"a": {"w": torch.tensor([1.0, 1.0])}, "b": {"w": torch.tensor([-1.0, -1.0])}}
    w, xi = dual_aggregation(opposite, {"a": 1, "b": 1})
    assert torch.equal(w["w"], torch.zeros(2)) and xi == {"a": 0.0, "b": 0.0}


def test_plain_mean_first_pass_option():
    uploads = {"a": {"w": torch.tensor([3.0, 0.0])}, "b": {"w": torch.tensor([0.0, 1.0])}}
    _, xi_weighted = dual_aggregation(uploads, {"a": 1, "b": 9})
    _, xi_mean = dual_aggregation(uploads, {"a": 1, "b": 9}, first_pass="mean")
    # plain mean w0 = [1.5, 0.5]: cos_a = 1.5/√2.5, cos_b = 0.5/√2.5
    assert xi_mean["a"] == pytest.approx(0.75) and xi_weighted["a"] != pytest.approx(0.75)
    with pytest.raises(ValueError, match="first_pass"):
        dual_aggregation(uploads, {"a": 1, "b": 1}, first_pass="median")
    assert math.isclose(sum(xi_mean.values()), 1.0)
