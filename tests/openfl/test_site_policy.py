"""`fx collaborator start` refuses a plan that violates the site's own policy, before reading data."""

import os

from fedcontrast.config import RunConfig
from fedcontrast.openfl.plan import create_workspace
from fedcontrast.privacy.policy import POLICY_ENV, POLICY_FILE

from .conftest import run_collaborator


def test_fx_collaborator_start_refuses_a_plan_over_the_sites_epsilon_budget(tmp_path, monkeypatch):
    monkeypatch.delenv(POLICY_ENV, raising=False)
    config = RunConfig(algorithm="fedssc", clients=2, rounds=30,
                       privacy={"dp_sgd": {"noise_multiplier": 0.5}, "representations": {"noise_multiplier": 1.0}})
    ws = create_workspace(tmp_path / "ws", config)  # no certificates, no aggregator: the refusal comes first
    # A folder that does not exist: had the collaborator read its data first, it would fail on that instead.
    (ws / "plan" / "data.yaml").write_text(f"site_0,{tmp_path / 'private-images'}\n")
    (ws / POLICY_FILE).write_text("max_epsilon: 5.0\nrequire_tls: true\nsite_samples: 400\n")
    code, reason = run_collaborator(ws, "site_0", timeout=120)
    assert code != 0
    assert f"this site's policy {POLICY_FILE} refuses the plan before any data is read" in reason
    assert "over the policy's max_epsilon 5" in reason
    assert not os.path.exists(ws / "local_state" / "sites")  # no task ran
