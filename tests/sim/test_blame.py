"""Blame names the right site: a hostile site whose update stays inside every bound (test-only patch)."""

import math

import pytest
import torch

from fedcontrast.robust import RejectedUpload
from fedcontrast.sim import Federation


def in_bound_attacker(federation, site_name, fraction):
    """``site_name`` sends, every round, its update sign-flipped and scaled to ``fraction`` × ‖w‖
    (``w``: the global model it received): inside ``max_update_ratio`` when ``fraction`` is below it."""
    run_task = federation.algorithm.run_task

    def patched(task, site, received):
        result = run_task(task, site, received)
        if site.name == site_name:
            start = federation.downlink.global_tensors
            names = [n for n in start if n.startswith("model.") and start[n].is_floating_point()]
            update = math.sqrt(sum(float(((result.uploads[n] - start[n]) ** 2).sum()) for n in names))
            norm = math.sqrt(sum(float((start[n] ** 2).sum()) for n in names))
            result.uploads = {k: start[k] - fraction * norm / update * (v - start[k]) if k in names else v
                              for k, v in result.uploads.items()}
        return result

    object.__setattr__(federation.algorithm, "run_task", patched)  # test only: past the built plugin's guard


def run_until_stopped(federation, rounds):
    for r in range(rounds):
        try:
            federation.run_round(r + 1)
        except RejectedUpload as exc:
            return r + 1, str(exc)
    return None, None


# The plain local step (no augmentation, a constant rate, no clipping): a wrecked global model then
# drives an honest site's training to non-finite weights, the symptom the blame is tested on (a clipped
# step keeps them finite, and the run then goes on with a worse model instead of stopping).
PLAIN = {"augmentation": "none", "lr_schedule": "constant", "clip_grad_norm": 0}


@pytest.fixture
def two(tiny_config):
    return tiny_config.replace(rounds=4, training={"lr": 0.05, **PLAIN})


def test_in_bound_attacker_is_named_and_the_correcting_honest_site_is_not_blamed(two):
    federation = Federation(two.replace(robustness={"max_update_ratio": 1.0}))
    in_bound_attacker(federation, "site_1", 0.99)
    stopped, message = run_until_stopped(federation, 4)
    assert stopped is not None, "the wrecked global model went unnoticed"
    assert "site 'site_1' is the likely cause" in message and "moved abnormally in round" in message
    assert "site 'site_0' is the likely cause" not in message
    assert "max_update_ratio off?" not in message  # the bound was on
    assert {m.site for m in federation.screen.moves} == {"site_1"}  # every abnormal move: the attacker's


def test_under_exclude_every_record_names_the_attacker_never_the_honest_site(two):
    federation = Federation(two.replace(robustness={"max_update_ratio": 1.0, "on_rejected": "exclude"}))
    in_bound_attacker(federation, "site_1", 0.99)
    causes = []
    for r in range(3):
        try:
            rows = federation.run_round(r + 1)
        except RejectedUpload as exc:  # every upload non-finite: the hint names the cause
            assert "site 'site_1' is the likely cause" in str(exc) and "site_0' is the likely" not in str(exc)
            break
        causes += [row["site"] for row in rows if row["task"] == "likely_cause"]
    assert causes and set(causes) == {"site_1"}
    assert {m.site for m in federation.screen.moves} == {"site_1"}


def test_default_ratio_poison_blames_the_attacker_not_a_ratio_that_was_on(two):
    federation = Federation(two)  # max_update_ratio 10 (the default): 9.9 × ‖w‖ passes it
    in_bound_attacker(federation, "site_1", 9.9)
    stopped, message = run_until_stopped(federation, 3)
    assert stopped is not None
    assert "the global model they all started from is the likely cause" in message
    assert "max_update_ratio off?" not in message and "site 'site_1' is the likely cause" in message


def test_honest_sites_are_never_named(tiny_config):
    federation = Federation(tiny_config.replace(clients=3, rounds=3, robustness={"max_update_ratio": 1.0}))
    for r in range(3):
        rows = federation.run_round(r + 1)
        assert not [row for row in rows if row["task"] in ("rejected", "likely_cause")]
    assert federation.screen.moves == []
    assert torch.isfinite(next(iter(federation.downlink.global_tensors.values()))).all()
