"""A site's task (:func:`fedcontrast.rounds.run_site_task`): the count leaves noised only under DP
(and not when the site's policy makes it public), and only the metrics the plan, the site's policy
and the plugin's declaration let leave; against values written out by hand."""

from types import SimpleNamespace

import pytest
import torch

from fedcontrast.algorithms import TaskResult
from fedcontrast.config import PrivacyConfig
from fedcontrast.privacy.releases import ReleaseChoices, release_choices
from fedcontrast.privacy.site import COUNT_KEY, SitePrivacy
from fedcontrast.rounds import run_site_task

TRUE_COUNT = 40
METRICS = {"loss": 0.5, "accuracy": 0.75, "update_norm": 3.0}  # update_norm: not declared for the task
DP_SGD = PrivacyConfig(dp_sgd={"noise_multiplier": 1.0, "max_grad_norm": 1.0})
EPSILON = {"dp_epsilon": 1.5, "dp_epsilon_round": 0.25}


class Plugin:
    """What run_site_task asks of a plugin: its task's result and the metrics the task declares."""

    task_metrics = {"train": ("loss", "accuracy")}

    def run_task(self, task, site, received):
        assert received == {"model.w": "the global model"}
        return TaskResult({"model.w": torch.ones(2, 3), "count": torch.tensor([4, 5])}, TRUE_COUNT, dict(METRICS))


class CountNoise:
    """A site's privacy as run_site_task uses it: its count as released, ``n + 2.5``, and ε so far."""

    def __init__(self) -> None:
        self.asked: list[float] = []

    def released_count(self, n):
        self.asked.append(n)
        return n + 2.5

    def metrics(self):
        return dict(EPSILON)


def run(privacy, releases, task="train"):
    return run_site_task(Plugin(), SimpleNamespace(privacy=privacy), task, {"model.w": "the global model"}, releases)


def test_without_dp_the_exact_count_and_the_declared_training_metrics_leave():
    done = run(None, release_choices(None))
    assert done.weight == 40.0 and isinstance(done.weight, float)
    assert done.released == {"loss": 0.5, "accuracy": 0.75}
    assert done.epsilon == {}
    assert done.result.metrics == METRICS  # the site's own report keeps every metric
    assert done.bytes_sent == 2 * 3 * 4 + 2 * 8  # float32 and int64 values
    assert run(None, release_choices(None), task="distill").released == {}  # a task that declares no metrics


def test_under_dp_the_count_leaves_noised_and_no_metric_leaves():
    privacy = CountNoise()
    done = run(privacy, release_choices(DP_SGD))
    assert privacy.asked == [TRUE_COUNT]
    assert done.weight == 42.5
    assert done.released == {}  # training metrics withheld; and ε: under DP-SGD its sampling rate tells the count
    assert done.epsilon == EPSILON  # the site's own record of it


def test_a_policy_that_publishes_the_count_and_the_metrics_sends_them_exact_with_epsilon():
    privacy = CountNoise()
    releases = release_choices(DP_SGD, SimpleNamespace(public_sample_count=True, share_training_metrics=True,
                                                       share_evaluation_metrics=None))
    done = run(privacy, releases)
    assert privacy.asked == []  # never noised
    assert done.weight == 40.0
    assert done.released == {"loss": 0.5, "accuracy": 0.75, **EPSILON}


@pytest.mark.parametrize("exact, training, epsilon", [(False, True, False), (False, False, True),
                                                      (True, False, False)])
def test_each_release_choice_alone(exact, training, epsilon):
    privacy = CountNoise()
    done = run(privacy, ReleaseChoices(exact_count=exact, training_metrics=training, evaluation_metrics=False,
                                       epsilon_metrics=epsilon))
    assert done.weight == (40.0 if exact else 42.5)
    assert privacy.asked == ([] if exact else [TRUE_COUNT])
    expected = {}
    if training:
        expected.update({"loss": 0.5, "accuracy": 0.75})
    if epsilon:
        expected.update(EPSILON)
    assert done.released == expected


class CountOnly(SitePrivacy):
    """A site's privacy with its real count noise, and ε as :class:`CountNoise` says (the accountant,
    tested in tests/privacy, imports Opacus: seconds)."""

    def metrics(self):
        return dict(EPSILON)


def test_the_noised_count_is_drawn_once_and_released_again_every_round():
    state: dict = {}
    first = run(CountOnly(DP_SGD, state, round_num=1, noise_seed=3), release_choices(DP_SGD))
    assert first.weight != TRUE_COUNT and first.weight == state[COUNT_KEY]
    later = run(CountOnly(DP_SGD, state, round_num=2, noise_seed=4), release_choices(DP_SGD))
    assert later.weight == first.weight and later.released == {}
