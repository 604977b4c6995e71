"""Run configurations the tests of several packages share (plain helpers, no fixtures)."""

from fedcontrast.config import RunConfig


def small_config(**changes) -> RunConfig:
    """Digits, 2 collaborators, 2 rounds of 1 local epoch: a real federation in seconds of compute."""
    base = RunConfig(algorithm="moon", dataset="digits", clients=2, rounds=2, min_samples=5,
                     training={"local_epochs": 1})
    return base.replace(**changes) if changes else base
