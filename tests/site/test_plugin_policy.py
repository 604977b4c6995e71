"""A site decides which plugin modules it imports: its policy's ``plugins:`` lists them, and a plan
whose ``plugins`` names another (the operator chooses the plan) is refused in one sentence before
anything imports it — at the site's start on both engines, at ``site join``, in the doctor and in
``fedcontrast audit --policy``. The plugin below writes a marker file when it is imported."""

import json
import sys
import textwrap
import zipfile

import pytest
import yaml

from fedcontrast.algorithms import registry
from fedcontrast.cli import main
from fedcontrast.config import RunConfig
from fedcontrast.deploy.common import FAIL, DeploymentError
from fedcontrast.deploy.trust import PackageRefused
from fedcontrast.errors import ConfigError, SiteRefusal
from fedcontrast.privacy.policy import POLICY_ENV, POLICY_FILE, SitePolicy, check_policy
from fedcontrast.site.checks import enforce_site_policy
from tests.plans import small_config

PLUGIN = "policy_marker_plugin"
SOURCE = '''
from pathlib import Path

from fedcontrast.algorithms import register_algorithm
from fedcontrast.algorithms.fedavg import FedAvg

Path(__file__).with_name("IMPORTED").write_text("the plan's plugin ran here")


@register_algorithm
class PolicyMarker(FedAvg):
    name = "policy_marker"
'''
SHAPE = {"in_channels": 1, "image_size": 16, "num_classes": 10}
SECURE = {"use_tls": True, "require_client_auth": True}


@pytest.fixture
def marker(monkeypatch, tmp_path):
    """The marker the plugin ``policy_marker_plugin`` (importable, in ``tmp_path/plugins``) writes when it
    is imported; the registry, the imported plugins and the modules as they were after the test."""
    monkeypatch.delenv(POLICY_ENV, raising=False)
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_PLUGINS", dict(registry._PLUGINS))
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / f"{PLUGIN}.py").write_text(textwrap.dedent(SOURCE))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.chdir(tmp_path)
    yield folder / "IMPORTED"
    sys.modules.pop(PLUGIN, None)


def policy_file(folder, text):
    path = folder / "policy.yaml"
    path.write_text(text)
    return path


def refusal(listed: str = "") -> str:
    """The sentence refusing the marker plugin under a policy that lists ``listed`` (comma-separated)."""
    wanted = ", ".join([*filter(None, listed.split(", ")), PLUGIN])
    return (f"the plan makes this site import the plugin module {PLUGIN}, which its policy does not list under "
            f"plugins: (add plugins: [{wanted}] to the policy once this site has reviewed and installed it)")


def naming_the_plugin(plan):
    """``plan`` with the marker plugin in every copy of its run configuration, as an operator could send it."""
    if isinstance(plan, dict):
        if isinstance(plan.get("run_config"), dict):
            plan["run_config"]["plugins"] = [PLUGIN]
        for value in plan.values():
            naming_the_plugin(value)
    return plan


@pytest.mark.parametrize("text,fragment", [
    ("plugins: mylab.algorithms\n", "policy plugins must be a list of plugin module names, got 'mylab.algorithms'"),
    ("plugins: [json]\n", "policy plugins: 'json' is a module of Python's standard library, not a plugin"),
    ("plugins: [my-lab]\n", "policy plugins: 'my-lab' is not a Python module name"),
])
def test_the_plugins_key_lists_module_names(tmp_path, text, fragment):
    assert SitePolicy.from_yaml(policy_file(tmp_path, "plugins: [mylab.algorithms]\n")).plugins == ("mylab.algorithms",)
    assert SitePolicy.from_yaml(policy_file(tmp_path, "plugins:\n")).plugins == ()  # the key alone: none allowed
    with pytest.raises(ConfigError) as info:
        SitePolicy.from_yaml(policy_file(tmp_path, text))
    assert fragment in str(info.value)


@pytest.mark.parametrize("listed", ["", "mylab.algorithms"])
def test_a_plugin_the_policy_does_not_list_is_refused_in_one_sentence_and_never_imported(marker, tmp_path, listed):
    policy = policy_file(tmp_path, f"plugins: [{listed}]\n")
    config = RunConfig(algorithm="policy_marker", plugins=(PLUGIN,))
    with pytest.raises(SiteRefusal) as info:
        enforce_site_policy(config, SECURE, SHAPE, "shard:0", policy_path=policy)
    assert str(info.value) == f"this site's policy {policy} refuses the plan before any data is read: {refusal(listed)}"
    assert not marker.exists() and PLUGIN not in sys.modules
    # a policy that says nothing of plugins lists none either
    silent = policy_file(tmp_path, "allow_weights: true\n")
    with pytest.raises(SiteRefusal, match="does not list under plugins:"):
        enforce_site_policy(config, SECURE, SHAPE, "shard:0", policy_path=silent)
    assert not marker.exists()


def test_a_listed_plugin_is_imported_once_the_policy_accepted_the_plan(marker, tmp_path):
    policy = policy_file(tmp_path, f"plugins: [mylab.algorithms, {PLUGIN}]\n")
    config = RunConfig(algorithm="policy_marker", plugins=(PLUGIN,))
    assert enforce_site_policy(config, SECURE, SHAPE, "shard:0", policy_path=policy).plugins == \
        ("mylab.algorithms", PLUGIN)
    assert marker.exists()  # the audit of the accepted plan built its algorithm
    assert enforce_site_policy(config, SECURE, SHAPE, "shard:0", cwd=tmp_path) is None  # no policy: accepted


def test_a_flower_site_refuses_the_plugin_before_importing_it_or_reading_its_data(marker, tmp_path):
    from fedcontrast.flower.site_app import SiteRefused, SiteRuntime

    policy = policy_file(tmp_path, "plugins: []\n")
    settings = {"site-name": "site_0", "workdir": str(tmp_path / "work"), "data": str(tmp_path / "no such folder"),
                "policy": str(policy)}
    with pytest.raises(SiteRefused) as info:
        SiteRuntime(small_config(plugins=(PLUGIN,)), settings, {})
    assert str(info.value) == f"this site's policy {policy} refuses the plan before any data is read: {refusal()}"
    assert not marker.exists() and PLUGIN not in sys.modules


def test_openfl_start_join_and_doctor_refuse_the_plugin_before_importing_it(marker, tmp_path):
    from fedcontrast.openfl.doctor import run_checks
    from fedcontrast.openfl.guard import guard_collaborator_start
    from fedcontrast.openfl.institution_flows import join
    from fedcontrast.openfl.plan import create_workspace

    ws = create_workspace(tmp_path / "fed", small_config())
    plan = naming_the_plugin(yaml.safe_load((ws / "plan" / "plan.yaml").read_text()))
    (ws / "plan" / "plan.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))
    (ws / POLICY_FILE).write_text("plugins: [mylab.algorithms]\n")
    start = ["fx", "collaborator", "start", "-n", "site_0"]
    with pytest.raises(PackageRefused) as info:  # fx's start-up guard
        guard_collaborator_start(start, ws)
    assert str(info.value) == (f"this site's policy {ws / POLICY_FILE} refuses the plan before any data is read: "
                               f"{refusal('mylab.algorithms')}")
    checks = {c.name: c for c in run_checks(ws, "site_0")}
    assert checks["policy"].status == FAIL and refusal("mylab.algorithms") in checks["policy"].message
    for name in ("shared files", "code"):  # each would import the plan's plugins
        assert (checks[name].status, checks[name].message) == (FAIL, refusal("mylab.algorithms"))
    archive = tmp_path / "fed.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("plan/plan.yaml", yaml.safe_dump(plan, sort_keys=False))
    with pytest.raises(DeploymentError) as info:
        join(archive, name="site_0", data=tmp_path, into=tmp_path / "site", policy=ws / POLICY_FILE)
    assert str(info.value) == f"fed.zip is refused, nothing was unpacked: {refusal('mylab.algorithms')}"
    assert not (tmp_path / "site").exists()
    assert not marker.exists() and PLUGIN not in sys.modules
    (ws / POLICY_FILE).write_text(f"plugins: [{PLUGIN}]\n")  # listed: the policy passes, and the plugin is imported
    with pytest.raises(PackageRefused, match=r"col_site_0.key, .* missing, and the plan uses TLS"):
        guard_collaborator_start(start, ws)  # what stops this bare workspace is the next check, its certificate
    assert marker.exists()


def test_the_audit_prints_the_plugins_and_whether_the_policy_allows_them(marker, tmp_path, capsys):
    from fedcontrast.audit.report import audit_plan
    from fedcontrast.openfl.plan import build_plan

    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(naming_the_plugin(build_plan(small_config(), tls=False)), sort_keys=False))
    transport = "require_tls: false\nrequire_client_auth: false\n"
    refusing = policy_file(tmp_path, transport + "plugins: [mylab.algorithms]\n")
    assert main(["audit", str(plan), "--policy", str(refusing)]) == 1
    out, err = capsys.readouterr()
    assert f"plugins the plan imports: {PLUGIN}: NOT ALLOWED: {PLUGIN} not listed (the policy's plugins: " \
           "mylab.algorithms); a site refuses the plan before importing it" in out
    assert f"  VIOLATION: {refusal('mylab.algorithms')}" in out
    assert err.strip() == f"fedcontrast: policy violated: {refusal('mylab.algorithms')}"
    assert main(["audit", str(plan), "--policy", str(refusing), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert (data["plugins"], data["violations"], data["audited"]) == ([PLUGIN], [refusal("mylab.algorithms")], False)
    assert not marker.exists() and PLUGIN not in sys.modules  # nothing else audited: the plugin is not imported
    allowing = policy_file(tmp_path, transport + f"plugins: [{PLUGIN}]\n")
    assert main(["audit", str(plan), "--policy", str(allowing)]) == 0
    out = capsys.readouterr().out
    assert f"plugin modules every party imports before it builds the algorithm (plugins:, installed on each host): " \
           f"{PLUGIN}" in out
    assert f"plugins the plan imports: {PLUGIN}: allowed (the policy's plugins: {PLUGIN})" in out
    assert marker.exists()
    report = audit_plan(yaml.safe_load(plan.read_text()), source="plan")  # check_policy names it too
    assert report.plugins == [PLUGIN]
    assert check_policy(report, SitePolicy(require_tls=False, require_client_auth=False)) == [refusal()]
    assert check_policy(report, SitePolicy(require_tls=False, require_client_auth=False, plugins=[PLUGIN])) == []
