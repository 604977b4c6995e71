"""The simulator on Ray: a run whose sites are Ray tasks equals the sequential run at the same threads
per site, bit for bit (metrics.csv and the final downlink), for every registered algorithm, DP,
partial participation and a resumed run; a worker that dies is retried once, then the run stops
naming the site; a bad cluster is one sentence."""

import os
import sys
from pathlib import Path

import pytest

from fedcontrast import device_check
from fedcontrast.algorithms import available_algorithms
from fedcontrast.errors import ConfigError
from fedcontrast.sim.checkpoint import load_checkpoint
from fedcontrast.sim.simulator import run_simulation

ray = pytest.importorskip("ray", reason="Ray is an install extra (pip install -e '.[ray]'; included in .[test])")

from fedcontrast.sim.ray_executor import RayExecutor, SiteTaskFailed, plan_tasks, train_sites_task  # noqa: E402


def config(algorithm: str, kind: str, **settings):
    """4 sites, 2 rounds, one thread per site (both executors)."""
    executor = {"kind": kind, "site_cpus": 1, **({"cpus": 2} if kind == "ray" else {})}
    return device_check.config(algorithm, "cpu", rounds=2, executor=executor, **settings).replace(clients=4)


def test_a_cluster_without_room_for_one_site_and_a_bad_address_are_one_sentence():
    with pytest.raises(ConfigError, match=r"has 2 CPU\(s\), fewer than one site needs \(executor.site_cpus 3\)"):
        RayExecutor(config("fedavg", "ray").replace(executor={"kind": "ray", "site_cpus": 3, "cpus": 2}))
    assert not ray.is_initialized()  # the local Ray it started is stopped again
    with pytest.raises(ConfigError, match="cannot reach the Ray cluster at 127.0.0.1:1"):
        RayExecutor(config("fedavg", "ray").replace(executor={"kind": "ray", "address": "127.0.0.1:1"}))


def test_without_ray_installed_the_executor_is_refused_in_one_sentence(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ConfigError,
                       match=r"executor ray needs Ray, which is not installed: pip install -e \"\.\[ray\]\""):
        RayExecutor(config("fedavg", "ray"))


@pytest.fixture(scope="module")
def executor():
    ex = RayExecutor(config("fedavg", "ray"))
    yield ex
    ex.close()


def same_as_sequential(tmp_path: Path, executor, algorithm: str, **settings) -> None:
    run_simulation(config(algorithm, "sequential", **settings), tmp_path / "sequential")
    run_simulation(config(algorithm, "ray", **settings), tmp_path / "ray", executor=executor)
    a, b = device_check._metrics(tmp_path / "sequential"), device_check._metrics(tmp_path / "ray")
    assert device_check.differences(a, b) == []
    assert (tmp_path / "ray" / "config.yaml").read_text().count("kind: ray") == 1  # recorded with the run


@pytest.mark.parametrize("algorithm", available_algorithms())
def test_every_algorithm_on_ray_equals_the_sequential_run(tmp_path, executor, algorithm):
    same_as_sequential(tmp_path, executor, algorithm)


@pytest.mark.parametrize("algorithm,privacy", [("fedavg", device_check.DP_SGD),
                                               ("fedssc", device_check.REPRESENTATIONS),
                                               ("flesd", device_check.REPRESENTATIONS)])
def test_dp_and_its_accounting_on_ray_equal_the_sequential_run(tmp_path, executor, algorithm, privacy):
    same_as_sequential(tmp_path, executor, algorithm, privacy=privacy)


def test_partial_participation_on_ray_equals_the_sequential_run(tmp_path, executor):
    same_as_sequential(tmp_path, executor, "moon", sample_fraction=0.5)


def test_a_killed_ray_run_resumed_equals_the_uninterrupted_one(tmp_path, executor):
    run_simulation(config("moon", "sequential"), tmp_path / "whole")
    run_simulation(config("moon", "ray"), tmp_path / "parts", executor=executor, stop_after=1)
    run_simulation(config("moon", "ray"), tmp_path / "parts", executor=executor, resume=True)
    assert device_check.differences(device_check._metrics(tmp_path / "whole"),
                                    device_check._metrics(tmp_path / "parts")) == []


def deaths(marker) -> int:
    """How many times a :func:`dying` task's worker died (one file each)."""
    return len(list(Path(marker).parent.glob(Path(marker).name + ".*")))


def dying(marker: str, times: int, site: int | None = None):
    """A site task whose worker process dies the first ``times`` times it runs (counted in ``marker``);
    with ``site``, only a task that trains that site (by index) dies."""
    def task(config, round_num, received, jobs, threads):
        died = deaths(marker)  # one file per death, each made by exactly one task (tasks run at once)
        if died < times and (site is None or any(index == site for index, _, _ in jobs)):
            try:
                os.close(os.open(f"{marker}.{died}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:  # another task took this death
                return train_sites_task(config, round_num, received, jobs, threads)
            os._exit(1)  # the worker process dies mid-task
        return train_sites_task(config, round_num, received, jobs, threads)
    return task


def test_sites_are_sent_in_few_balanced_tasks():
    from types import SimpleNamespace

    sites = [SimpleNamespace(index=i, data=range(n)) for i, n in enumerate([90, 10, 40, 40, 30, 50, 20, 60, 5, 5])]
    groups = plan_tasks(sites, 4, fixed=0)
    assert len(groups) == 4
    assert sorted(s.index for g in groups for s in g) == list(range(10))  # every site once
    loads = [sum(len(s.data) for s in g) for g in groups]
    assert max(loads) - min(loads) <= 90  # no group heavier than the lightest by more than the largest site
    assert sum(loads) == 350
    assert [len(g) for g in plan_tasks(sites[:3], 8)] == [1, 1, 1]  # never more tasks than sites


def test_a_task_of_several_sites_whose_worker_dies_twice_names_the_site_at_fault(tmp_path, executor):
    run = tmp_path / "ray"
    stock, slots = executor.remote, executor.slots
    executor.remote, executor.slots = executor.remote_of(dying(str(tmp_path / "deaths"), 99, site=2)), 1
    try:  # one slot: 4 sites in 2 tasks of 2; the one with site_2 dies twice, then site_2 alone twice
        with pytest.raises(SiteTaskFailed, match=r"site site_2's task of round 1 failed twice on the Ray cluster"):
            run_simulation(config("fedavg", "ray"), run, executor=executor)
    finally:
        executor.remote, executor.slots = stock, slots
    assert deaths(tmp_path / "deaths") == 4


def test_a_worker_that_dies_once_is_retried_with_the_same_result(tmp_path, executor):
    run_simulation(config("fedavg", "sequential"), tmp_path / "sequential")
    stock = executor.remote
    executor.remote = executor.remote_of(dying(str(tmp_path / "deaths"), 1))
    try:
        run_simulation(config("fedavg", "ray"), tmp_path / "ray", executor=executor)
    finally:
        executor.remote = stock
    assert deaths(tmp_path / "deaths") == 1
    assert device_check.differences(device_check._metrics(tmp_path / "sequential"),
                                    device_check._metrics(tmp_path / "ray")) == []


def test_a_worker_that_dies_twice_stops_the_run_naming_the_site_and_keeps_finished_rounds(tmp_path, executor):
    run = tmp_path / "ray"
    run_simulation(config("fedavg", "ray"), run, executor=executor, stop_after=1)
    stock = executor.remote
    executor.remote = executor.remote_of(dying(str(tmp_path / "deaths"), 99))
    try:
        with pytest.raises(SiteTaskFailed, match=r"site site_\d's task of round 2 failed twice on the Ray cluster"):
            run_simulation(config("fedavg", "ray"), run, executor=executor, resume=True)
    finally:
        executor.remote = stock
    assert load_checkpoint(run / "checkpoint.pt")["rounds_done"] == 1  # round 1 is kept
    run_simulation(config("fedavg", "ray"), run, executor=executor, resume=True)  # and the run goes on


def test_site_groups_equal_tasks_of_one_site_and_the_sequential_run(tmp_path, executor):
    """6 sites, 2 rounds: a task per site, the automatic groups (two tasks per slot) and tasks of 4
    sites (model and data built once per worker, each site's state swapped in) give the sequential
    run's metrics; the summary records how the sites went out."""
    import json

    def six(kind, **executor_settings):
        c = config("fedavg", kind).replace(clients=6)
        return c.replace(executor={**c.executor.__dict__, **executor_settings}) if executor_settings else c

    run_simulation(six("sequential"), tmp_path / "sequential")
    want = device_check._metrics(tmp_path / "sequential")
    for name, per_task, tasks in [("one", 1, 6), ("auto", None, 4), ("four", 4, 2)]:
        run_simulation(six("ray", sites_per_task=per_task), tmp_path / name, executor=executor)
        assert device_check.differences(want, device_check._metrics(tmp_path / name)) == [], name
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["executor"]["sites_per_task"] == (per_task or "automatic")
        assert summary["executor"]["tasks_per_round"] == tasks
    assert "sites_per_task: 4" in (tmp_path / "four" / "config.yaml").read_text()


def test_sites_per_task_belongs_to_the_ray_executor():
    with pytest.raises(ConfigError, match="executor.sites_per_task are settings of the ray executor"):
        config("fedavg", "sequential").replace(executor={"kind": "sequential", "sites_per_task": 2})
    with pytest.raises(ConfigError, match="executor.sites_per_task must be an integer >= 1, got 0"):
        config("fedavg", "ray").replace(executor={"kind": "ray", "sites_per_task": 0})
