import pytest

from fedcontrast.config import RunConfig, TrainingConfig


@pytest.fixture
def tiny_config():
    """2 sites × 2 rounds on synthetic data: seconds, not minutes."""
    return RunConfig(algorithm="fedavg", dataset="synthetic", image_size=16, clients=2, rounds=2,
                     min_samples=5, projection_dim=32, public_fraction=0.2,
                     training=TrainingConfig(local_epochs=1, batch_size=32))
