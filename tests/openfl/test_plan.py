"""Plans come from the typed configuration: the committed ones must equal what the code generates."""

from pathlib import Path

import pytest
import yaml

from fedcontrast.algorithms import available_algorithms
from fedcontrast.config import RunConfig
from fedcontrast.errors import ConfigError
from fedcontrast.openfl.fx import collaborator_names, read_workspace_config
from fedcontrast.openfl.plan import build_plan, create_workspace, plan_templates

ROOT = Path(__file__).resolve().parents[2]


def test_committed_plan_templates_are_current():
    for name, plan in plan_templates().items():
        committed = yaml.safe_load((ROOT / "plan" / f"{name}.yaml").read_text())
        assert committed == plan, f"plan/{name}.yaml is stale: run `fedcontrast plan write plan`"


def test_committed_workspace_is_current():
    ws = ROOT / "workspaces" / "digits-moon"
    committed = yaml.safe_load((ws / "plan" / "plan.yaml").read_text())
    assert committed == build_plan(RunConfig(algorithm="moon", dataset="digits", clients=3))
    assert collaborator_names(ws) == ["site_0", "site_1", "site_2"]
    for name in ("requirements.txt", ".workspace", "src/README.md"):  # what `fx workspace export` packs
        assert (ws / name).is_file(), name


@pytest.mark.parametrize("algorithm", available_algorithms())
def test_plan_runs_the_plugins_tasks_over_mutual_tls(algorithm):
    config = RunConfig(algorithm=algorithm, clients=2, rounds=4)
    plan = build_plan(config)
    assert plan["network"]["settings"]["use_tls"] and plan["network"]["settings"]["require_client_auth"]
    tasks = plan["assigner"]["settings"]["train_tasks"]
    assert tasks and list(plan["tasks"]) == ["evaluate", *tasks]  # the sites' own evaluation comes first
    assert plan["aggregator"]["settings"]["rounds_to_train"] == 4
    for part in ("data_loader", "task_runner"):
        assert RunConfig.from_dict(plan[part]["settings"]["run_config"]) == config


def test_workspace_round_trip_and_refusals(tmp_path):
    config = RunConfig(algorithm="fedprox", clients=4, hyperparameters={"fedprox": {"mu": 0.1}})
    ws = create_workspace(tmp_path / "ws", config, collaborators=2)
    assert read_workspace_config(ws) == config.replace(clients=2)
    assert (ws / "plan" / "data.yaml").read_text() == "site_0,shard:0\nsite_1,shard:1\n"
    with pytest.raises(ConfigError, match="already holds a workspace"):
        create_workspace(tmp_path / "ws", config)
    with pytest.raises(ConfigError, match="sample_fraction"):
        build_plan(config.replace(sample_fraction=0.5))
    with pytest.raises(ConfigError, match="not a workspace"):
        read_workspace_config(tmp_path / "nowhere")


def test_a_schema_plan_needs_no_data_at_all(tmp_path):
    # No data exists anywhere (no data_root): the operator's plan comes from the schema alone, and the
    # loader `fx plan initialize` builds reads nothing.
    from fedcontrast.config import DataSchema
    from fedcontrast.openfl.loader import SiteDataLoader

    schema = DataSchema((3, 20, 20), ("x", "y", "z"))
    config = RunConfig(algorithm="moon", dataset="imagefolder", sites=("a", "b"), clients=2, data_schema=schema)
    plan = build_plan(config)
    assert plan["aggregator"]["settings"]["model_shape"] == {"in_channels": 3, "image_size": 20, "num_classes": 3}
    loader = SiteDataLoader(data_path=None, run_config=config.to_dict())
    assert loader.get_feature_shape() == (3, 20, 20) and loader.train is None and loader.public is None


def test_a_site_reading_its_own_folder_is_refused_in_one_sentence(tmp_path):
    from fedcontrast.config import DataSchema
    from fedcontrast.openfl.loader import SiteDataLoader

    (tmp_path / "images" / "cat").mkdir(parents=True)
    demo = RunConfig(clients=2)
    with pytest.raises(SystemExit, match="no data_schema to check it against"):
        SiteDataLoader(data_path=str(tmp_path / "images"), run_config=demo.to_dict())
    schema = RunConfig(dataset="imagefolder", sites=("a", "b"), clients=2,
                       data_schema=DataSchema((1, 16, 16), ("dog", "bird")))
    with pytest.raises(SystemExit, match=r"^fedcontrast collaborator: error: class folder\(s\) cat .* not among"):
        SiteDataLoader(data_path=str(tmp_path / "images"), run_config=schema.to_dict())
    with pytest.raises(SystemExit, match="does not exist"):
        SiteDataLoader(data_path=str(tmp_path / "nowhere"), run_config=schema.to_dict())


def test_the_evaluate_task_name_is_reserved():
    from fedcontrast.algorithms import registry
    from fedcontrast.algorithms.fedavg import FedAvg

    class Clash(FedAvg):
        name = "clash"
        tasks = ("evaluate", "train")

    registry._REGISTRY["clash"] = Clash
    try:
        with pytest.raises(ConfigError, match="reserves for the sites' own evaluation"):
            build_plan(RunConfig(algorithm="clash", clients=2))
    finally:
        del registry._REGISTRY["clash"]
