"""The plugins on Flower's simulation runtime (flwr 1.42, the extra ``[flower]``; these tests run in
the environment a Flower user has, made by the README's test command): the simulator's round loop in
a ServerApp, each site's round a ``train`` message to a SuperNode whose ClientApp runs the plugin's
collaborator tasks. Results are bit-identical to the in-process simulator at the same threads per
site (metrics.csv and every tensor of the final downlink), for every registered algorithm."""

import sys

import pytest

from fedcontrast import device_check
from fedcontrast.algorithms import available_algorithms
from fedcontrast.errors import ConfigError
from fedcontrast.sim.simulator import run_simulation

SEQUENTIAL = {"kind": "sequential", "site_cpus": 1}


def config(algorithm: str, executor: dict):
    return device_check.config(algorithm, "cpu", rounds=2, executor=executor).replace(clients=3)


def test_without_flower_installed_the_executor_is_refused_in_one_sentence(monkeypatch, tmp_path):
    from fedcontrast.sim.flower_executor import run_on_flower

    monkeypatch.setitem(sys.modules, "flwr", None)
    with pytest.raises(ConfigError, match=r"the Flower engine needs flwr 1.42, which is not installed: in an "
                                          r"environment without OpenFL .* pip install -e \"\.\[flower\]\""):
        run_on_flower(config("fedavg", {"kind": "flower"}), tmp_path / "run")


def test_every_algorithm_on_flowers_simulation_runtime_equals_the_in_process_simulator(tmp_path):
    pytest.importorskip("flwr", reason="Flower is the extra [flower], in an environment of its own (the README's "
                                       "test command makes it)")
    from fedcontrast.sim.flower_executor import run_many_on_flower

    algorithms = available_algorithms()
    for algorithm in algorithms:
        run_simulation(config(algorithm, SEQUENTIAL), tmp_path / f"{algorithm}-sequential")
    run_many_on_flower([(config(a, {"kind": "flower", "site_cpus": 1}), tmp_path / f"{a}-flower") for a in algorithms])
    for algorithm in algorithms:
        assert "kind: flower" in (tmp_path / f"{algorithm}-flower" / "config.yaml").read_text()
        assert device_check.differences(device_check._metrics(tmp_path / f"{algorithm}-sequential"),
                                        device_check._metrics(tmp_path / f"{algorithm}-flower")) == [], algorithm


def test_simulate_with_the_flower_executor_from_the_command_line(tmp_path, capsys):
    pytest.importorskip("flwr", reason="Flower is the extra [flower], in an environment of its own")
    from fedcontrast.cli import main

    common = ["--dataset", "synthetic", "--image-size", "16", "--clients", "2", "--rounds", "2", "--local-epochs", "1",
              "--min-samples", "5", "--site-cpus", "1", "--runs-dir", str(tmp_path), "--quiet"]
    assert main(["simulate", "--algorithm", "moon", *common, "--name", "sequential"]) == 0
    assert main(["simulate", "--algorithm", "moon", *common, "--executor", "flower", "--name", "flower"]) == 0
    assert device_check.differences(device_check._metrics(tmp_path / "sequential"),
                                    device_check._metrics(tmp_path / "flower")) == []


def test_a_flower_run_stopped_after_round_1_resumes_to_the_uninterrupted_result(tmp_path):
    pytest.importorskip("flwr", reason="Flower is the extra [flower], in an environment of its own")
    from fedcontrast.sim.flower_executor import run_on_flower

    run_simulation(config("moon", SEQUENTIAL), tmp_path / "whole")
    flower = config("moon", {"kind": "flower", "site_cpus": 1})
    run_on_flower(flower, tmp_path / "parts", stop_after=1)
    run_on_flower(flower, tmp_path / "parts", resume=True)
    assert device_check.differences(device_check._metrics(tmp_path / "whole"),
                                    device_check._metrics(tmp_path / "parts")) == []
