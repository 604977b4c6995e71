"""Linear probing: separable features are learnt, random labels are not, and the number is reproducible."""

import pytest
import torch
from torch import nn

from fedcontrast.data.datasets import ArrayDataset
from fedcontrast.evaluation import linear_probe

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_thread():
    # The problems here are tiny: on a busy shared machine, intra-op threads only wait for each other.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def flatten(x):
    return x.flatten(1)


def _blobs(n, seed, num_classes=4, shape=(1, 4, 4), spread=0.5):
    """Gaussian blobs around fixed class means (seed 0), images of ``shape``; labels cycle over classes."""
    means = 2.0 * torch.randn(num_classes, *shape, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % num_classes
    x = means[y] + spread * torch.randn(n, *shape, generator=g)
    return ArrayDataset(x, y, num_classes)


def test_separable_blobs_are_classified():
    result = linear_probe(flatten, _blobs(400, 1), _blobs(400, 2), CPU, epochs=50)
    assert set(result) == {"probe_accuracy", "probe_train_accuracy"}
    assert result["probe_accuracy"] >= 0.95
    assert result["probe_train_accuracy"] >= 0.95


def test_random_labels_give_chance_accuracy():
    g = torch.Generator().manual_seed(3)

    def make(n):
        return ArrayDataset(torch.randn(n, 1, 4, 4, generator=g), torch.randint(0, 10, (n,), generator=g), 10)

    result = linear_probe(flatten, make(1000), make(2000), CPU, epochs=30)
    # Test accuracy of 2000 random labels: 0.1 ± 0.007 (one standard deviation).
    assert abs(result["probe_accuracy"] - 0.1) < 0.04
    assert result["probe_train_accuracy"] > result["probe_accuracy"]  # it fits noise it cannot transfer


def test_same_seed_same_numbers():
    train, test = _blobs(200, 4, spread=2.0), _blobs(200, 5, spread=2.0)  # overlapping: not a trivial 1.0
    a = linear_probe(flatten, train, test, CPU, epochs=20, seed=7)
    b = linear_probe(flatten, train, test, CPU, epochs=20, seed=7)
    assert a == b
    assert 0.3 < a["probe_accuracy"] < 1.0


def test_features_are_standardised_with_train_statistics():
    # Rescaling and shifting every feature changes nothing once the features are standardised.
    train, test = _blobs(200, 6, spread=1.5), _blobs(200, 7, spread=1.5)
    plain = linear_probe(flatten, train, test, CPU, epochs=20)
    scaled = linear_probe(lambda x: 1000.0 * x.flatten(1) + 5.0, train, test, CPU, epochs=20)
    assert scaled["probe_accuracy"] == pytest.approx(plain["probe_accuracy"], abs=0.011)


def test_batching_does_not_change_the_result():
    train, test = _blobs(150, 8, spread=1.5), _blobs(150, 9, spread=1.5)
    a = linear_probe(flatten, train, test, CPU, epochs=15, batch_size=1024)
    b = linear_probe(flatten, train, test, CPU, epochs=15, batch_size=7)
    assert a["probe_accuracy"] == pytest.approx(b["probe_accuracy"], abs=1e-9)


def test_classes_count_labels_of_both_sets():
    # Class 3 only occurs in the test set: the probe has 4 outputs and simply never predicts it.
    train = _blobs(90, 10, num_classes=3)
    test_full = _blobs(120, 11, num_classes=4)
    result = linear_probe(flatten, train, test_full, CPU, epochs=20)
    assert result["probe_accuracy"] <= 0.75 + 1e-9  # the quarter labelled 3 is always wrong


class _Recorder(nn.Module):
    """An encoder with dropout that remembers the mode and grad state of every call."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 8)
        self.dropout = nn.Dropout(0.5)
        self.calls = []

    def forward(self, x):
        self.calls.append((self.training, torch.is_grad_enabled()))
        return self.dropout(self.proj(x.flatten(1)))

    def encode(self, x):
        return self(x)


@pytest.mark.parametrize("as_method", [False, True])
def test_encoder_runs_in_eval_mode_without_gradients_and_mode_is_restored(as_method):
    enc = _Recorder().train()
    linear_probe(enc.encode if as_method else enc, _blobs(50, 12), _blobs(50, 13), CPU, epochs=5, batch_size=20)
    assert len(enc.calls) == 6  # 3 batches of train, 3 of test
    assert all(mode == (False, False) for mode in enc.calls)
    assert enc.training
    assert enc.proj.weight.grad is None


def test_explicit_module_is_switched_for_a_plain_function():
    enc = _Recorder().train()
    linear_probe(lambda x: enc(x), _blobs(20, 14), _blobs(20, 15), CPU, epochs=3, module=enc)
    assert all(training is False for training, _ in enc.calls)
    assert enc.training


def test_empty_sets_raise():
    empty = ArrayDataset(torch.zeros(0, 1, 4, 4), torch.zeros(0, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="non-empty"):
        linear_probe(flatten, empty, _blobs(10, 16), CPU)
