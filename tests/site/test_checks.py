"""A site's checks and data name a refusal as a plain SiteRefusal (issue 36): one sentence with no
engine's prefix, not a SystemExit; the engine decides how it ends (OpenFL's collaborator, a Flower site)."""

import pytest

from fedcontrast.config import RunConfig
from fedcontrast.errors import FedContrastError, SiteRefusal
from fedcontrast.privacy.policy import POLICY_ENV
from fedcontrast.site.checks import enforce_site_policy
from fedcontrast.site.data import SiteData

SHAPE = {"in_channels": 1, "image_size": 16, "num_classes": 10}
SECURE = {"use_tls": True, "require_client_auth": True}


def test_tls_off_without_a_policy_is_a_plain_refusal(tmp_path, monkeypatch):
    monkeypatch.delenv(POLICY_ENV, raising=False)
    monkeypatch.chdir(tmp_path)  # no site_policy.yaml here
    with pytest.raises(SiteRefusal) as info:
        enforce_site_policy(RunConfig(), {"use_tls": False, "require_client_auth": False}, SHAPE, "shard:0",
                            cwd=tmp_path)
    assert isinstance(info.value, FedContrastError) and not isinstance(info.value, SystemExit)
    assert str(info.value).startswith("the plan turns TLS off")
    assert enforce_site_policy(RunConfig(), SECURE, SHAPE, "shard:0", cwd=tmp_path) is None  # no policy: accepted


def test_the_policy_file_the_engine_names_is_the_one_checked(tmp_path, monkeypatch):
    monkeypatch.delenv(POLICY_ENV, raising=False)
    monkeypatch.chdir(tmp_path)  # no site_policy.yaml here
    policy = tmp_path / "elsewhere" / "policy.yaml"
    policy.parent.mkdir()
    policy.write_text("allow_weights: false\n")
    with pytest.raises(SiteRefusal, match=f"^this site's policy {policy} refuses the plan before any data is read"):
        SiteData(data_path=str(tmp_path / "no such folder"), run_config=RunConfig().to_dict(), network=SECURE,
                 model_shape=SHAPE, policy_path=policy)


def test_a_data_problem_is_a_refusal_in_one_sentence(tmp_path, monkeypatch):
    monkeypatch.delenv(POLICY_ENV, raising=False)
    monkeypatch.chdir(tmp_path)  # no site_policy.yaml here
    with pytest.raises(SiteRefusal, match=r"^this site reads its own folder .* but the plan has no data_schema"):
        SiteData(data_path=str(tmp_path / "images"), run_config=RunConfig().to_dict(), network=SECURE,
                 model_shape=SHAPE)
