"""ε from our accounting equals Opacus's accountants called directly, step by step."""

import math

import pytest
import torch
from opacus.accountants import PRVAccountant, RDPAccountant

from fedcontrast.config import PrivacyConfig, RunConfig, TrainingConfig
from fedcontrast.privacy import HISTORY_KEY, epsilon, history_of, planned_epsilon, round_history
from fedcontrast.privacy.accounting import compact, count_history, dp_sgd_sample_rate
from fedcontrast.sim.federation import Federation

BOTH = PrivacyConfig(delta=1e-5, dp_sgd={"noise_multiplier": 1.1, "max_grad_norm": 1.0},
                     representations={"noise_multiplier": 3.0, "clip": 1.0})


def opacus_direct(accountant, n, training, privacy, rounds, count=True):
    """One round = local_epochs · ⌈n/B⌉ DP-SGD steps, then the two release mechanisms (sums, counts);
    and, once, the site's sample count (one Gaussian mechanism of sensitivity 1)."""
    q = 1 / math.ceil(n / training.batch_size)
    if count:
        accountant.step(noise_multiplier=privacy.count_noise_multiplier, sample_rate=1.0)
    for _ in range(rounds):
        if privacy.dp_sgd is not None:
            for _ in range(training.local_epochs * math.ceil(n / training.batch_size)):
                accountant.step(noise_multiplier=privacy.dp_sgd.noise_multiplier, sample_rate=q)
        if privacy.representations is not None:
            for _ in range(2):
                accountant.step(noise_multiplier=privacy.representations.noise_multiplier, sample_rate=1.0)
    return accountant.get_epsilon(delta=privacy.delta)


@pytest.mark.parametrize("n,rounds", [(100, 1), (529, 7), (64, 10)])
def test_planned_epsilon_equals_rdp_accountant_called_directly(n, rounds):
    training = TrainingConfig(local_epochs=2, batch_size=32)
    planned = planned_epsilon(BOTH, training, n=n, rounds=rounds)
    assert planned.total == pytest.approx(opacus_direct(RDPAccountant(), n, training, BOTH, rounds), abs=1e-6)
    assert planned.per_round == pytest.approx(opacus_direct(RDPAccountant(), n, training, BOTH, 1, count=False),
                                              abs=1e-6)
    exact_count = planned_epsilon(BOTH, training, n=n, rounds=rounds, count=False)  # the site made it public
    assert exact_count.total == pytest.approx(opacus_direct(RDPAccountant(), n, training, BOTH, rounds, count=False),
                                              abs=1e-6)
    assert exact_count.total < planned.total
    assert 0 < planned.per_round <= planned.total and (rounds == 1 or planned.per_round < planned.total)


@pytest.mark.parametrize("privacy", [
    PrivacyConfig(accountant="prv", dp_sgd={"noise_multiplier": 1.0}),
    PrivacyConfig(accountant="prv", representations={"noise_multiplier": 4.0}),
])
def test_planned_epsilon_equals_prv_accountant_called_directly(privacy):
    training = TrainingConfig(local_epochs=1, batch_size=64)
    planned = planned_epsilon(privacy, training, n=300, rounds=5)
    assert planned.total == pytest.approx(opacus_direct(PRVAccountant(), 300, training, privacy, 5), abs=1e-6)


def test_representation_release_alone_is_two_gaussian_mechanisms():
    # Closed form for the Gaussian mechanism's RDP: α/(2σ²) per release, 2 releases per round.
    privacy = PrivacyConfig(delta=1e-5, representations={"noise_multiplier": 5.0})
    history = round_history(privacy, TrainingConfig(), n=1000)
    assert history == [[5.0, 1.0, 2]]
    alphas = [1.5, 2, 4, 8, 16, 32, 64]
    rdp = [2 * a / (2 * 5.0 ** 2) for a in alphas]
    closed = min(r + math.log1p(-1 / a) - (math.log(1e-5) + math.log(a)) / (a - 1) for r, a in zip(rdp, alphas))
    acc = RDPAccountant()
    acc.history = [(5.0, 1.0, 2)]
    assert acc.get_epsilon(delta=1e-5, alphas=alphas) == pytest.approx(closed, rel=1e-9)


def test_compacted_history_gives_the_same_epsilon():
    history = [[1.0, 0.1, 10], [2.0, 1.0, 2], [1.0, 0.1, 10], [2.0, 1.0, 2]]
    assert compact(history) == [[1.0, 0.1, 20], [2.0, 1.0, 4]]
    acc = RDPAccountant()
    acc.history = [tuple(h) for h in history]
    assert epsilon(history, delta=1e-5) == pytest.approx(acc.get_epsilon(delta=1e-5), abs=1e-9)
    assert epsilon([], delta=1e-5) == 0.0


def test_simulated_rounds_record_the_planned_history_and_it_survives_a_reload(tmp_path):
    config = RunConfig(algorithm="fedssc", dataset="synthetic", image_size=16, clients=2, rounds=2, min_samples=5,
                       projection_dim=32, public_fraction=0.2, training={"local_epochs": 1, "batch_size": 32},
                       hyperparameters={"fedssc": {"min_class_samples": 2}},
                       privacy={"dp_sgd": {"noise_multiplier": 1.5}, "representations": {"noise_multiplier": 2.0}})
    fed = Federation(config)
    rows = fed.run_round(1) + fed.run_round(2)
    for site in fed.sites:
        n = len(site.data)
        planned = planned_epsilon(config.privacy, config.training, n=n, rounds=2)
        assert compact(history_of(site.state)) == compact(
            [[s, q, k * 2] for s, q, k in round_history(config.privacy, config.training, n)]
            + count_history(config.privacy))  # and the sample count, released once
        assert compact(history_of(site.state, 2)) == round_history(config.privacy, config.training, n)
        row = next(r for r in rows if r["site"] == site.name and r["round"] == 2)
        assert f'"dp_epsilon":{round(planned.total, 6)}' in row["extra"]
        # persisted as plain numbers: readable with weights_only=True
        torch.save(site.state[HISTORY_KEY], tmp_path / "h.pt")
        assert torch.load(tmp_path / "h.pt", weights_only=True) == site.state[HISTORY_KEY]
    assert dp_sgd_sample_rate(len(fed.sites[0].data), 32) == compact(history_of(fed.sites[0].state))[0][1]


@pytest.mark.parametrize("k", [93, 99, 105])
def test_a_dp_sgd_session_records_the_true_sampling_rate(k):
    # n = 10k samples in batches of 10: q = 1/k exactly. Opacus's accountant records 1/len(loader), and
    # for these k float rounding makes len(loader) = int(1/q) = k − 1, i.e. q = 1/(k − 1): too high.
    from fedcontrast.privacy.dp_sgd import DPSGDSession

    assert int(1 / (1 / k)) == k - 1  # the rounding the test is about
    n, batch = 10 * k, 10
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = DPSGDSession(model, optimizer, num_samples=n, batch_size=batch, noise_multiplier=1.0, max_grad_norm=1.0,
                           generator=torch.Generator().manual_seed(0))
    for idx in session.epoch_batches():
        session.optimizer.zero_grad()
        session.model(torch.ones(len(idx), 2)).sum().backward()
        session.optimizer.step()
    history = session.close()
    training = TrainingConfig(local_epochs=1, batch_size=batch)
    privacy = PrivacyConfig(dp_sgd={"noise_multiplier": 1.0})
    assert compact(history) == round_history(privacy, training, n)  # [[1.0, 1/k, k − 1]]
    assert compact(history)[0][1] == 1 / k
    assert epsilon(history, delta=1e-5) == planned_epsilon(privacy, training, n=n, rounds=1, count=False).total


def test_the_sample_count_is_released_once_noised_and_reused():
    from fedcontrast.privacy import SitePrivacy

    privacy = PrivacyConfig(representations={"noise_multiplier": 2.0}, count_noise_multiplier=3.0)
    state = {}
    draws = []
    for round_num in range(3):  # a fresh privacy object each round, as engines make them
        draws.append(SitePrivacy(privacy, state, round_num=round_num, noise_seed=round_num).released_count(120))
    assert draws[0] == draws[1] == draws[2] != 120.0  # noised once, then the same value: one release
    assert history_of(state) == [[3.0, 1.0, 1]]  # accounted once, in the round it was drawn
    samples = [SitePrivacy(privacy, {}, round_num=0, noise_seed=s).released_count(120) for s in range(4000)]
    mean = sum(samples) / len(samples)
    std = (sum((x - mean) ** 2 for x in samples) / len(samples)) ** 0.5
    assert abs(mean - 120) < 0.3 and abs(std - 3.0) < 0.15  # N(n, σ²)
