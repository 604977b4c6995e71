"""The plan a site checks is the plan that runs: every component's copy of the run configuration,
network settings, model shape and rounds must be the same, or the party refuses to start."""

import os
from types import SimpleNamespace

import pytest
import yaml

from fedcontrast.cli import main
from fedcontrast.config import RunConfig
from fedcontrast.deploy.workspace import check_plan_consistency, load_plan_file
from fedcontrast.errors import ConfigError
from fedcontrast.openfl.guard import fx_plan_path
from fedcontrast.openfl.loader import SiteDataLoader
from fedcontrast.openfl.plan import build_plan, create_workspace, dump_yaml
from fedcontrast.openfl.protocol import CollaboratorStopped
from fedcontrast.openfl.runner import PluginTaskRunner
from fedcontrast.openfl.startup_checks import check_aggregator_plan, check_settings_in_effect
from fedcontrast.privacy.policy import POLICY_ENV

from .conftest import run_collaborator, small_config

FX_COLLABORATOR = ["/venv/bin/fx", "collaborator", "start", "-n", "site_0"]


def loaded_plan(config=None, **network):
    """A plan as OpenFL loads it from its file: the YAML anchors become shared objects."""
    return yaml.safe_load(dump_yaml(build_plan(config or small_config(), **network)))


def split_privacy(plan):
    """(A) privacy only in the data loader's copy: the policy sees noise that training never adds."""
    noised = RunConfig.from_dict(plan["task_runner"]["settings"]["run_config"]).replace(
        privacy={"dp_sgd": {"noise_multiplier": 1.0}}).to_dict()
    plan["data_loader"]["settings"]["run_config"] = noised
    return plan


def split_rounds(plan):
    """(B) more rounds for the aggregator than the sites' copies (and their privacy budget) say."""
    plan["aggregator"]["settings"]["rounds_to_train"] = 4
    return plan


def split_network(plan):
    """(C) TLS and client authentication off on the real connection, on in the copy the policy reads."""
    plan["data_loader"]["settings"]["network"] = dict(plan["network"]["settings"])
    plan["network"]["settings"].update(use_tls=False, require_client_auth=False)
    return plan


def test_the_generated_plan_is_consistent():
    for config in (small_config(), small_config(algorithm="flesd"), small_config(algorithm="fedpcl")):
        check_plan_consistency(build_plan(config))
        check_plan_consistency(loaded_plan(config))


@pytest.mark.parametrize("split, expected", [
    (split_privacy, "data_loader.settings.run_config differs from task_runner.settings.run_config in: privacy"),
    (split_rounds, "aggregator.settings.rounds_to_train (4) differs from the run configuration's rounds (2)"),
    (split_network, "data_loader.settings.network differs from network.settings in: require_client_auth, use_tls"),
])
def test_a_plan_that_splits_its_copies_is_refused_naming_them(split, expected):
    with pytest.raises(ConfigError) as info:
        check_plan_consistency(split(loaded_plan()), "plan/plan.yaml")
    message = str(info.value)
    assert message.startswith("plan/plan.yaml does not give every component the same settings")
    assert expected in message and "\n" not in message


def test_every_aggregation_copy_and_the_task_list_are_checked():
    plan = loaded_plan()
    plan["tasks"]["train"]["aggregation_type"]["settings"] = {
        "run_config": {**plan["task_runner"]["settings"]["run_config"], "seed": 7},
        "model_shape": {**plan["aggregator"]["settings"]["model_shape"], "num_classes": 3}}
    with pytest.raises(ConfigError) as info:
        check_plan_consistency(plan)
    assert "tasks.train.aggregation_type.settings.run_config differs from task_runner.settings.run_config in: seed" \
        in str(info.value)
    assert "tasks.train.aggregation_type.settings.model_shape differs from aggregator.settings.model_shape in: " \
           "num_classes" in str(info.value)
    plan = loaded_plan()
    del plan["tasks"]
    with pytest.raises(ConfigError, match="tasks.evaluate is missing.*tasks.train is missing"):
        check_plan_consistency(plan)
    with pytest.raises(ConfigError, match="is not a plan: its top level is a list"):
        check_plan_consistency([1, 2])


def test_the_plan_file_fx_parsed_is_found_from_its_command_line(tmp_path):
    assert fx_plan_path("collaborator", FX_COLLABORATOR, tmp_path) == tmp_path / "plan" / "plan.yaml"
    for option in (["-p", "other.yaml"], ["--plan", "other.yaml"], ["--plan=other.yaml"], ["-pother.yaml"]):
        assert fx_plan_path("collaborator", FX_COLLABORATOR + option, tmp_path) == tmp_path / "other.yaml"
    assert fx_plan_path("aggregator", ["fx", "aggregator", "start", "-p", "a.yaml"], tmp_path) == tmp_path / "a.yaml"
    assert fx_plan_path("collaborator", ["fx", "aggregator", "start"]) is None
    assert fx_plan_path("collaborator", ["pytest", "-p", "no:cacheprovider"]) is None


def test_invalid_truncated_and_taskless_plan_files_are_one_sentence(tmp_path):
    good = dump_yaml(build_plan(small_config()))
    path = tmp_path / "plan.yaml"
    path.write_text("task_runner: {settings: [\n")
    with pytest.raises(ConfigError, match=r"plan .*plan.yaml is not valid YAML"):
        load_plan_file(path)
    for fraction in (0.5, 0.8):  # cut at a line: still YAML, with sections or copies missing
        path.write_text(good[: int(len(good) * fraction)].rsplit("\n", 1)[0] + "\n")
        with pytest.raises(ConfigError, match="is not a fedcontrast plan|does not give every component the same"):
            load_plan_file(path)
    with pytest.raises(ConfigError, match="nowhere.yaml does not exist"):
        load_plan_file(tmp_path / "nowhere.yaml")


def write_workspace_plan(tmp_path, split):
    ws = create_workspace(tmp_path / "ws", small_config(), max_retries=2)
    plan = split(yaml.safe_load((ws / "plan" / "plan.yaml").read_text()))
    (ws / "plan" / "plan.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))
    return ws, plan


@pytest.mark.parametrize("split, expected", [(split_privacy, "in: privacy"), (split_rounds, "rounds_to_train (4)"),
                                             (split_network, "in: require_client_auth, use_tls")])
def test_the_collaborators_loader_checks_the_plan_that_fx_parsed(tmp_path, monkeypatch, split, expected):
    monkeypatch.delenv(POLICY_ENV, raising=False)
    ws, plan = write_workspace_plan(tmp_path, split)
    monkeypatch.chdir(ws)
    monkeypatch.setattr("sys.argv", FX_COLLABORATOR)
    with pytest.raises(CollaboratorStopped) as info:
        SiteDataLoader(data_path="shard:0", **plan["data_loader"]["settings"])
    assert str(info.value).startswith("fedcontrast collaborator: error: plan/plan.yaml does not give every component")
    assert expected in str(info.value)


def test_the_loader_must_be_given_the_settings_of_that_file(tmp_path, monkeypatch):
    monkeypatch.delenv(POLICY_ENV, raising=False)
    ws = create_workspace(tmp_path / "ws", small_config())
    other = build_plan(small_config(rounds=9))  # consistent in itself, but not the file fx was told to run
    monkeypatch.chdir(ws)
    monkeypatch.setattr("sys.argv", FX_COLLABORATOR)
    with pytest.raises(CollaboratorStopped, match="was not given the data_loader settings of plan/plan.yaml "
                                                  r"\(differ: run_config\)"):
        SiteDataLoader(data_path="shard:0", **other["data_loader"]["settings"])
    plan = yaml.safe_load((ws / "plan" / "plan.yaml").read_text())
    assert SiteDataLoader(data_path="shard:0", **plan["data_loader"]["settings"]).train is not None


def test_the_aggregator_runs_the_rounds_of_the_run_configuration(tmp_path):
    config = small_config()
    plan = build_plan(config)
    settings = {k: plan["aggregator"]["settings"][k] for k in ("run_config", "model_shape", "rounds_to_train")}
    check_aggregator_plan(config, settings)
    with pytest.raises(ConfigError, match=r"rounds_to_train \(4\) differs from the run configuration's rounds \(2\)"):
        check_aggregator_plan(config, {**settings, "rounds_to_train": 4})
    ws, _ = write_workspace_plan(tmp_path, split_privacy)  # under `fx aggregator start`: its plan file too
    with pytest.raises(ConfigError, match="data_loader.settings.run_config differs"):
        check_aggregator_plan(config, settings, argv=["fx", "aggregator", "start"], cwd=ws)


def test_the_connection_and_training_run_the_settings_the_policy_checked(tmp_path, monkeypatch):
    monkeypatch.delenv(POLICY_ENV, raising=False)
    settings = build_plan(small_config())["data_loader"]["settings"]
    loader = SiteDataLoader(data_path="shard:0", **settings)
    runner = PluginTaskRunner(data_loader=loader, run_config=settings["run_config"], state_dir=str(tmp_path))
    check_settings_in_effect(runner, SimpleNamespace(use_tls=True, require_client_auth=True))
    with pytest.raises(ConfigError) as info:
        check_settings_in_effect(runner, SimpleNamespace(use_tls=False, require_client_auth=False))
    assert "use_tls is False on the connection but True in the settings this site's policy was checked" \
        in str(info.value)
    runner.config = runner.config.replace(rounds=5)
    with pytest.raises(ConfigError, match="task runner's run configuration differs from the data loader's in: rounds"):
        check_settings_in_effect(runner, SimpleNamespace(use_tls=True, require_client_auth=True))
    with pytest.raises(ConfigError, match="not fedcontrast's"):
        check_settings_in_effect(SimpleNamespace(data_loader=loader), SimpleNamespace(use_tls=True))


def test_audit_refuses_a_split_plan_in_one_sentence(tmp_path, capsys):
    ws, _ = write_workspace_plan(tmp_path, split_network)
    assert main(["audit", str(ws / "plan" / "plan.yaml")]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedcontrast: error:") and "\n" not in err
    assert "data_loader.settings.network differs from network.settings in: require_client_auth, use_tls" in err


def test_fx_collaborator_start_refuses_a_split_plan_before_reading_data(tmp_path, monkeypatch):
    monkeypatch.delenv(POLICY_ENV, raising=False)
    ws, _ = write_workspace_plan(tmp_path, split_privacy)
    code, reason = run_collaborator(ws, "site_0", timeout=120)
    assert code != 0
    assert "data_loader.settings.run_config differs from task_runner.settings.run_config in: privacy" in reason
    assert not os.path.exists(ws / "local_state" / "sites")  # no task ran
