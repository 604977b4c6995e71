"""Under DP-SGD a site's log says once, truly, how the noise is sampled (as the audit does), instead
of Opacus's "Secure RNG turned off" warning at every session."""

import logging
import warnings

import torch
from torch import nn

from fedcontrast.privacy import dp_sgd
from fedcontrast.privacy.dp_sgd import DPSGDSession


def session(secure):
    model = nn.Sequential(nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    s = DPSGDSession(model, optimizer, num_samples=8, batch_size=4, noise_multiplier=1.0, max_grad_norm=1.0,
                     generator=torch.Generator().manual_seed(0), secure=secure)
    s.close()


def test_one_true_line_instead_of_opacus_warning(caplog, monkeypatch):
    monkeypatch.setattr(dp_sgd, "_NOISE_SAID", set())
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, logger=dp_sgd.__name__):
        warnings.simplefilter("always")
        session(secure=True)
        session(secure=True)
        session(secure=False)
    assert not [w for w in caught if "Secure RNG" in str(w.message)]
    said = [r.getMessage() for r in caplog.records if r.name == dp_sgd.__name__]
    assert len(said) == 2
    assert said[0].startswith("DP-SGD noise: secure") and said[1].startswith("DP-SGD noise: not secure")
