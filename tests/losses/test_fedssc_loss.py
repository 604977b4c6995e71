"""FedSSC's global class-contrastive loss against an explicit loop over eq. 3 and closed forms."""

import math

import numpy as np
import pytest
import torch

from fedcontrast.losses import global_class_contrastive_loss
from tests.losses.reference import cosine


def reference(z, labels, reps, present, tau):
    z, reps = np.asarray(z, dtype=np.float64), np.asarray(reps, dtype=np.float64)
    terms = []
    for i in range(len(z)):
        if not present[labels[i]]:
            continue
        denominator = sum(math.exp(cosine(z[i], reps[c]) / tau) for c in range(len(reps)) if present[c])
        terms.append(-math.log(math.exp(cosine(z[i], reps[labels[i]]) / tau) / denominator))
    return sum(terms) / len(terms) if terms else 0.0


@pytest.mark.parametrize("batch,classes", [(1, 2), (8, 5), (64, 10)])
def test_matches_explicit_loop_with_missing_classes(batch, classes):
    g = torch.Generator().manual_seed(batch * classes)
    z = torch.randn(batch, 6, generator=g, dtype=torch.float64)
    reps = torch.randn(classes, 6, generator=g, dtype=torch.float64)
    labels = torch.randint(0, classes, (batch,), generator=g)
    present = (torch.rand(classes, generator=g) < 0.7).to(torch.float64)
    present[labels[0]] = 1.0  # at least one usable sample
    got = global_class_contrastive_loss(z, labels, reps, present, temperature=0.5).item()
    assert got == pytest.approx(reference(z, labels.tolist(), reps, present.tolist(), 0.5), rel=1e-10)


def test_closed_form_equal_similarities():
    # z orthogonal to every representation: all logits equal → −log(1/C_present).
    z = torch.tensor([[0.0, 0.0, 1.0]])
    reps = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [-1.0, 0.0, 0.0], [0.0, -1.0, 0.0]])
    present = torch.tensor([1.0, 1.0, 0.0, 1.0])
    loss = global_class_contrastive_loss(z, torch.tensor([1]), reps, present, temperature=0.3)
    assert loss.item() == pytest.approx(math.log(3), rel=1e-6)


def test_round_zero_no_representations_is_zero_with_zero_gradient():
    z = torch.randn(4, 3, requires_grad=True)
    loss = global_class_contrastive_loss(z, torch.tensor([0, 1, 1, 0]), torch.zeros(2, 3), torch.zeros(2),
                                         temperature=0.5)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(z.grad) == 0
