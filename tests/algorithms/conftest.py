import pytest
import torch

from fedcontrast.algorithms import SiteContext
from fedcontrast.config import TrainingConfig
from fedcontrast.data import load_dataset
from fedcontrast.models import build_model


@pytest.fixture(scope="session")
def synthetic():
    return load_dataset("synthetic", image_size=16, synthetic_samples=300, public_fraction=0.0)


@pytest.fixture
def make_site(synthetic):
    def make(training=None, state=None, seed=0, n=96):
        torch.manual_seed(0)
        model = build_model("simple_cnn", in_channels=1, image_size=16, num_classes=synthetic.num_classes,
                            projection_dim=32)
        return SiteContext(name="site_0", data=synthetic.train.subset(torch.arange(n)), model=model,
                           training=training or TrainingConfig(local_epochs=2, batch_size=32),
                           round_num=0, seed=seed, device=torch.device("cpu"), state=state if state is not None else {})
    return make
